"""`check_rule` against `jax.test_util.check_grads` on a ~1M-parameter MLP.

Each is timed in fresh processes (cold) and on repeated calls (warm)."""

from __future__ import annotations

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
from ..config import FULL, QUICK, ROOT, Job, Sizes

NAME = "checker"
DEFAULT = True
CHECK_GRADS_TOL = 2e-3
"""`check_grads`' own float32 tolerance, given to `check_rule` too: the default 1e-5
is tighter than float32 reassociation error on a deep MLP (see RESULTS.md)."""
CHECKERS = ("check_grads", "check_rule")


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


def child(sizes: Sizes, which: str) -> dict[str, Any]:
    """Runs in a fresh process: JAX warmed up on a trivial program, then the first
    call (cold) and `checker_warm` repeated calls (warm) of one checker."""
    from jax.test_util import check_grads

    from eqxrules.testing import check_rule

    jax.jit(lambda a: a + 1)(jnp.ones(3)).block_until_ready()
    f, params, x, n = problem(sizes)
    jax.block_until_ready((params, x))

    def once():
        if which == "check_grads":
            check_grads(f, (params, x), order=1, modes=("fwd", "rev"))
            return None
        report = check_rule(
            f,
            params,
            x,
            finite_differences=True,
            num_directions=2,
            rtol=CHECK_GRADS_TOL,
            atol=CHECK_GRADS_TOL,
        )
        return {r.name: [r.status, r.seconds] for r in report.results}

    times, detail = [], None
    for _ in range(1 + sizes.checker_warm):
        t0 = time.perf_counter()
        detail = once()
        times.append(time.perf_counter() - t0)
    return dict(which=which, params=n, cold=times[0], warm=times[1:], checks=detail)


def _child_main() -> None:
    """`python -c "..." WHICH [--quick]`: print `child`'s figures as JSON."""
    which, *flags = sys.argv[1:]
    print(json.dumps(child(QUICK if "--quick" in flags else FULL, which)))


def _in_fresh_process(which: str, quick: bool) -> dict[str, Any]:
    code = f"from {__name__} import _child_main; _child_main()"
    cmd = [sys.executable, "-c", code, which, *(["--quick"] if quick else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"checker child {which} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(job: Job) -> dict[str, Any]:
    runs: dict[str, list] = {w: [] for w in CHECKERS}
    for i in range(job.sizes.checker_pairs):
        for which in CHECKERS if i % 2 == 0 else CHECKERS[::-1]:
            result = _in_fresh_process(which, job.quick)
            runs[which].append(result)
            job.log(f"  {which}: cold {result['cold']:.2f}s warm {result['warm']}")
    pairs = list(zip(runs["check_rule"], runs["check_grads"]))
    cold = [a["cold"] / b["cold"] for a, b in pairs]
    warm = [
        statistics.median(a["warm"]) / statistics.median(b["warm"]) for a, b in pairs
    ]
    return dict(
        params=runs["check_rule"][0]["params"],
        runs=runs,
        cold=xla.ratio_summary(cold),
        warm=xla.ratio_summary(warm),
        checks=runs["check_rule"][-1]["checks"],
    )


def render(res: dict[str, Any] | None, results: dict[str, Any]) -> list[str]:
    if res is None:
        return []
    g = res["runs"]["check_grads"]
    r = res["runs"]["check_rule"]
    lines = report.opening(
        NAME,
        res,
        results,
        params=res["params"],
        grads_cold=statistics.median(x["cold"] for x in g),
        rule_cold=statistics.median(x["cold"] for x in r),
        cold=report.spread(res["cold"]),
        grads_warm=statistics.median(statistics.median(x["warm"]) for x in g),
        rule_warm=statistics.median(statistics.median(x["warm"]) for x in r),
        warm=report.spread(res["warm"]),
        checks=", ".join(f"{k} {v[0]} {v[1]:.2f}s" for k, v in res["checks"].items()),
    )
    return lines + [""]
