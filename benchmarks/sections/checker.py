"""`check_rule` beside `jax.test_util.check_grads` on a ~1M-parameter MLP, 4 ways.

Each way runs in a fresh process, timed on its first call (cold) and on repeated
calls (warm); the processes are interleaved in rounds, and each ratio is paired
within a round."""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .. import report, xla
from ..config import ROOT, Job, Sizes

NAME = "checker"
DEFAULT = True
WAYS = ("check_grads", "selected", "selected+ref", "full")
"""`check_grads` is the baseline; the others are `check_rule` (see `KWARGS`)."""
SELECTED = ("jvp", "vjp", "finite_differences")
TOLERANCE = 2e-3
"""`check_grads`' own float32 tolerance, given to `check_rule` too: its default
(1e-5) is tighter than float32 reassociation error on a deep MLP."""
GOAL = ("selected", "selected+ref")
"""The ways the requirement speaks of: `check_rule(..., checks=SELECTED)` must take at
most the time of `check_grads(order=1)`, as a paired ratio."""
PHASES = ("cold", "warm")


def kwargs(way: str, f: Any) -> dict[str, Any]:
    """`check_rule`'s keyword arguments for `way` (not `check_grads`)."""
    kw: dict[str, Any] = dict(rtol=TOLERANCE, atol=TOLERANCE)
    if way == "selected":
        kw.update(checks=SELECTED)
    elif way == "selected+ref":
        kw.update(checks=SELECTED, derivative=f, finite_differences=True)
    elif way == "full":
        kw.update(finite_differences=True)
    else:
        raise ValueError(way)
    return kw


def problem(sizes: Sizes):
    """`f(params, x)`, an `eqx.nn.MLP` (tanh) on a batch; its parameters, the batch,
    and how many parameters there are."""
    mlp = eqx.nn.MLP(
        sizes.checker_in,
        10,
        sizes.checker_width,
        sizes.checker_depth,
        activation=jnp.tanh,
        key=jax.random.key(0),
    )
    params, static = eqx.partition(mlp, eqx.is_inexact_array)
    x = jax.random.normal(jax.random.key(1), (sizes.checker_batch, sizes.checker_in))

    def f(params, x):
        return jax.vmap(eqx.combine(params, static))(x)

    n = sum(p.size for p in jtu.tree_leaves(params))
    return f, params, x, n


def measure(way: str, sizes: Sizes) -> dict[str, Any]:
    """In this process: JAX warmed up on a trivial program and the MLP built, then
    one way's first call (cold) and `checker_warm` repeated calls (warm), with the
    checks' statuses and seconds of the last call."""
    from jax.test_util import check_grads

    from eqxrules.testing import check_rule

    jax.jit(lambda a: a + 1)(jnp.ones(3)).block_until_ready()
    f, params, x, n = problem(sizes)
    jax.block_until_ready((params, x))
    kw = None if way == "check_grads" else kwargs(way, f)

    def once() -> dict[str, Any] | None:
        if kw is None:
            check_grads(f, (params, x), order=1, modes=("fwd", "rev"))
            return None
        checked = check_rule(f, params, x, **kw)
        return {r.name: [r.status, r.seconds] for r in checked.results}

    times, checks = [], None
    for _ in range(1 + sizes.checker_warm):
        start = time.perf_counter()
        checks = once()
        times.append(time.perf_counter() - start)
    return dict(params=n, cold=times[0], warm=times[1:], checks=checks)


def _child_main() -> None:
    """`python -c "..." WAY SIZES_JSON`: print `measure`'s figures as JSON."""
    way, sizes = sys.argv[1:]
    print(json.dumps(measure(way, Sizes(**json.loads(sizes)))))


def _in_fresh_process(way: str, sizes: Sizes) -> dict[str, Any]:
    code = f"from {__name__} import _child_main; _child_main()"
    cmd = [sys.executable, "-c", code, way, json.dumps(dataclasses.asdict(sizes))]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"checker child {way} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _seconds(r: dict[str, Any], phase: str) -> float:
    return r["cold"] if phase == "cold" else statistics.median(r["warm"])


def run(job: Job) -> dict[str, Any]:
    sizes = job.sizes
    runs: dict[str, list[dict[str, Any]]] = {w: [] for w in WAYS}
    for i in range(sizes.checker_rounds):
        # The order rotates every round, so that drifting load falls on all alike.
        for way in WAYS[i % len(WAYS) :] + WAYS[: i % len(WAYS)]:
            r = _in_fresh_process(way, sizes)
            runs[way].append(r)
            job.log(
                f"  round {i + 1}/{sizes.checker_rounds} {way}: cold {r['cold']:.2f}s,"
                f" warm {', '.join(f'{t:.2f}' for t in r['warm'])}"
            )
    base = runs["check_grads"]
    seconds = {
        w: {ph: statistics.median(_seconds(r, ph) for r in runs[w]) for ph in PHASES}
        for w in WAYS
    }
    ratios = {
        w: {
            ph: xla.ratio_summary(
                [_seconds(a, ph) / _seconds(b, ph) for a, b in zip(runs[w], base)]
            )
            for ph in PHASES
        }
        for w in WAYS[1:]
    }
    res = dict(
        params=base[0]["params"],
        rounds=sizes.checker_rounds,
        warm_calls=sizes.checker_warm,
        seconds=seconds,
        ratios=ratios,
        # Each way's checks on the last warm call of its last process.
        checks={w: runs[w][-1]["checks"] for w in WAYS[1:]},
        runs=runs,
    )
    res["default_tolerance"] = _default_tolerance(sizes)
    old = job.previous
    if old is not None:
        # Wall-clock ratios move with the load and the code: keep earlier headlines
        # of the full battery (an earlier layout had only that, as `cold`/`warm`).
        full = old["ratios"]["full"] if "ratios" in old else old
        res["earlier"] = [
            *old.get("earlier", []),
            dict(old["measured"], cold=full["cold"], warm=full["warm"]),
        ]
    return res


def _default_tolerance(sizes: Sizes) -> dict[str, Any]:
    """The checks the full battery does not pass on this (correct) MLP at
    `check_rule`'s default float32 tolerance, each with its status and largest
    relative error (`None` if there is none): why the timed runs are given
    `TOLERANCE`."""
    from eqxrules.testing import DEFAULT_TOLERANCES, check_rule

    f, params, x, _ = problem(sizes)
    checked = check_rule(f, params, x, finite_differences=True, raise_on_failure=False)
    rtol, atol = DEFAULT_TOLERANCES["float32"]
    return dict(
        rtol=rtol,
        atol=atol,
        failed={
            r.name: [r.status, r.max_rel_error and float(r.max_rel_error)]
            for r in checked.results
            if r.status not in ("passed", "skipped")
        },
    )


def _verdict(r: dict[str, float]) -> str:
    if r["max"] <= 1:
        return "met (every round)"
    if r["median"] <= 1:
        return "met (median; not every round)"
    return "**NOT met**"


def _checks(checks: dict[str, list]) -> str:
    """What ran (or failed, or was skipped for a reason that cost time)."""
    return ", ".join(
        f"{k} {status} {s:.2f}s"
        for k, (status, s) in checks.items()
        if status != "skipped" or s >= 0.005
    )


def render(res: dict[str, Any] | None, results: dict[str, Any]) -> list[str]:
    if res is None:
        return []
    if "ratios" not in res:  # measured by the earlier, two-way layout
        return report.opening(NAME, res, results, "stale") + [""]
    ratios = res["ratios"]
    n = res["rounds"]
    lines = report.opening(
        NAME, res, results, res=res, tol=TOLERANCE, rounds=f"{n} round{'s' * (n != 1)}"
    )
    for way in WAYS[1:]:
        for ph in PHASES:
            r = ratios[way][ph]
            lines.append(
                f"| `{way}` | {ph} | {res['seconds']['check_grads'][ph]:.2f} | "
                f"{res['seconds'][way][ph]:.2f} | {report.spread(r)} | "
                + (_verdict(r) if way in GOAL else "(not required)")
                + " |"
            )
    lines += report.fill(
        NAME,
        "goal",
        res=res,
        sel_cold=_verdict(ratios["selected"]["cold"]),
        sel_warm=_verdict(ratios["selected"]["warm"]),
        ref_cold=_verdict(ratios["selected+ref"]["cold"]),
        ref_warm=_verdict(ratios["selected+ref"]["warm"]),
        full_cold=ratios["full"]["cold"]["median"],
        full_warm=ratios["full"]["warm"]["median"],
    )
    d = res["default_tolerance"]
    failed = ", ".join(
        f"`{k}` {status}"
        + (f" (elementwise relative error up to {e:.1e})" if e else "")
        for k, (status, e) in d["failed"].items()
    )
    lines += report.fill(
        NAME, "tolerance" if failed else "tolerance_ok", d=d, failed=failed
    )
    for way, checks in res["checks"].items():
        lines += report.fill(NAME, "checks", way=way, checks=_checks(checks))
    for old in res.get("earlier", []):
        lines += report.fill(
            NAME,
            "earlier",
            when=report.measured(dict(measured=old)).strip(),
            cold=report.spread(old["cold"]),
            warm=report.spread(old["warm"]),
        )
    return lines + [""]
