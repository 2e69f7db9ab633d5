"""How long `eqxrules.testing.check_rule` takes beside `jax.test_util.check_grads`,
on the same ~1M-parameter MLP.

    python benchmarks/checker_speed.py            # 990,218 parameters, 5 rounds
    python benchmarks/checker_speed.py --quick    # a small MLP, 1 round

Four ways of checking `f(params, x)`, an `eqx.nn.MLP` (tanh) applied to a batch:

- `check_grads`: `check_grads(f, (params, x), order=1, modes=("fwd", "rev"))`, the
    JVP and the VJP against central differences (one direction each).
- `selected`: `check_rule(f, params, x, checks=("jvp", "vjp", "finite_differences"))`
    with no reference, as one would check a plain function: `jvp` and `vjp` have
    nothing to compare with (reported skipped), so this is the finite-difference
    check, 2 directions in float64.
- `selected+ref`: the same three checks with `derivative=f` and
    `finite_differences=True`, so that `jvp` and `vjp` run too.
- `full`: the whole battery of `check_rule` (no reference, `finite_differences`).

`check_rule` is given `check_grads`' float32 tolerance (`rtol=atol=2e-3`).

Each way runs in a fresh process (JAX imported and warmed up on a trivial program,
the MLP built): its first call (cold: tracing and compiling) and then `--warm`
repeated calls (warm). Processes are interleaved, the order rotated every round, so
that the load of a shared machine falls on all alike; each ratio is taken within a
round (paired) and the table gives medians over rounds. No threshold is asserted
here: the suite never times anything.

Importable: `measure(way, sizes, warm)` runs one way in this process; `run(...)`
the interleaved rounds; `render(results)` the markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

WAYS = ("check_grads", "selected", "selected+ref", "full")
SELECTED = ("jvp", "vjp", "finite_differences")
TOLERANCE = 2e-3
"""`check_grads`' own float32 tolerance; `check_rule`'s default (1e-5) is tighter
than float32 reassociation error on a deep MLP."""

ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Sizes:
    width: int = 512
    depth: int = 4
    d_in: int = 384
    d_out: int = 10
    batch: int = 32


QUICK = Sizes(width=128, depth=3, d_in=64, batch=8)


def problem(sizes: Sizes):
    """`(f, params, x, n)`: the MLP as a function of its parameters and a batch."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import jax.tree_util as jtu

    mlp = eqx.nn.MLP(
        sizes.d_in,
        sizes.d_out,
        sizes.width,
        sizes.depth,
        activation=jnp.tanh,
        key=jax.random.key(0),
    )
    params, static = eqx.partition(mlp, eqx.is_inexact_array)
    x = jax.random.normal(jax.random.key(1), (sizes.batch, sizes.d_in))

    def f(params, x):
        return jax.vmap(eqx.combine(params, static))(x)

    n = sum(p.size for p in jtu.tree_leaves(params))
    return f, params, x, n


def measure(way: str, sizes: Sizes, warm: int) -> dict[str, Any]:
    """Run one way of checking once cold and `warm` times warm, in this process."""
    import jax
    import jax.numpy as jnp
    from jax.test_util import check_grads

    from eqxrules.testing import check_rule

    jax.jit(lambda a: a + 1)(jnp.ones(3)).block_until_ready()
    f, params, x, n = problem(sizes)
    jax.block_until_ready((params, x))
    kwargs: dict[str, Any] = dict(rtol=TOLERANCE, atol=TOLERANCE)
    if way == "selected":
        kwargs.update(checks=SELECTED)
    elif way == "selected+ref":
        kwargs.update(checks=SELECTED, derivative=f, finite_differences=True)
    elif way == "full":
        kwargs.update(finite_differences=True)

    def once() -> dict[str, Any] | None:
        if way == "check_grads":
            check_grads(f, (params, x), order=1, modes=("fwd", "rev"))
            return None
        report = check_rule(f, params, x, **kwargs)
        return {r.name: [r.status, round(r.seconds, 3)] for r in report.results}

    times, checks = [], None
    for _ in range(1 + warm):
        start = time.perf_counter()
        checks = once()
        times.append(time.perf_counter() - start)
    return dict(way=way, params=n, cold=times[0], warm=times[1:], checks=checks)


def _child(way: str, quick: bool, warm: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", way, "--warm", str(warm)]
    if quick:
        cmd.append("--quick")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{way} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(rounds: int, warm: int, quick: bool, ways=WAYS, log=print) -> dict[str, Any]:
    """`rounds` rounds of one fresh process per way, the order rotated each round."""
    runs: dict[str, list[dict[str, Any]]] = {w: [] for w in ways}
    for i in range(rounds):
        order = ways[i % len(ways) :] + ways[: i % len(ways)]
        for way in order:
            result = _child(way, quick, warm)
            runs[way].append(result)
            log(
                f"round {i + 1}/{rounds} {way}: cold {result['cold']:.2f}s, warm "
                + ", ".join(f"{t:.2f}" for t in result["warm"])
            )
    return dict(
        params=runs[ways[0]][0]["params"],
        rounds=rounds,
        warm_calls=warm,
        load=os.getloadavg(),
        runs=runs,
    )


def _ratios(results: dict[str, Any], way: str, phase: str) -> list[float]:
    def seconds(r: dict[str, Any]) -> float:
        return r["cold"] if phase == "cold" else statistics.median(r["warm"])

    return [
        seconds(a) / seconds(b)
        for a, b in zip(results["runs"][way], results["runs"]["check_grads"])
    ]


def render(results: dict[str, Any], command: str) -> str:
    runs = results["runs"]
    ways = [w for w in WAYS if w in runs and w != "check_grads"]
    header = "| | check_grads s | " + " | ".join(
        f"{w} s | {w} / check_grads" for w in ways
    )
    lines = [
        f"Command: `{command}`. An `eqx.nn.MLP` with {results['params']:,} "
        f"parameters; {results['rounds']} rounds of fresh processes, "
        f"{results['warm_calls']} warm calls each; medians, ratios paired within a "
        f"round as median [min, max]. Load average after: "
        f"{results['load'][0]:.1f}.",
        "",
        header + " |",
        "|---|---|" + "---|---|" * len(ways),
    ]
    for phase in ("cold", "warm"):

        def seconds(r: dict[str, Any]) -> float:
            return r["cold"] if phase == "cold" else statistics.median(r["warm"])

        cells = [f"{statistics.median(seconds(r) for r in runs['check_grads']):.2f}"]
        for w in ways:
            ratios = _ratios(results, w, phase)
            cells.append(f"{statistics.median(seconds(r) for r in runs[w]):.2f}")
            cells.append(
                f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]"
            )
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    for w in ways:
        checks = runs[w][-1]["checks"]
        lines += [
            "",
            f"`{w}`, each check's status and seconds on the last warm call: "
            + ", ".join(
                f"{k} {v[0]} {v[1]:.2f}s"
                for k, v in checks.items()
                if v[1] or v[0] != "skipped"
            ),
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small MLP, 1 round")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--warm", type=int, default=3, help="warm calls per process")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--json", action="store_true", help="print the raw results")
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else Sizes()
    if args.child:
        print(json.dumps(measure(args.child, sizes, args.warm)))
        return
    rounds = args.rounds or (1 if args.quick else 5)
    ways = tuple(w for w in args.ways.split(",") if w)
    if "check_grads" not in ways:
        ways = ("check_grads", *ways)
    results = run(
        rounds, args.warm, args.quick, ways, log=lambda s: print(s, file=sys.stderr)
    )
    command = "python " + " ".join(
        [str(pathlib.Path(__file__).relative_to(ROOT)), *(argv or sys.argv[1:])]
    )
    if args.json:
        print(json.dumps(results, indent=2))
    print(render(results, command))


if __name__ == "__main__":
    main()
