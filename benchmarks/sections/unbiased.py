"""`check_unbiased` on correct stochastic rounding: its calibration and its speed.

Calibration: each row runs `check_unbiased` many times, one key per run, on a
correct stochastic rounding, and counts the failures: the observed false-fail rate,
next to the stated one (a bound) and to the exact rate of the test as implemented,
computed here independently from binomial probabilities (the reference roundings
draw each element independently, so the elements' failures are independent).
Speed: 100,000 draws of 4096 float8_e4m3fn elements, against drawing alone."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from eqxrules.testing import check_unbiased

from .. import report
from ..config import Job

NAME = "unbiased"
DEFAULT = True
# (grid, elements, draws, stated false-fail rate), each run `RUNS` times.
ROWS = (
    ("integers", 1, 1000, 0.5),
    ("integers", 1, 1000, 0.1),
    ("integers", 64, 1000, 0.1),
    ("integers", 1024, 1000, 0.1),
    ("integers", 64, 1000, 0.01),
    ("float8_e4m3fn", 1024, 1000, 0.1),
)
RUNS = {True: 40, False: 1000}  # by `job.quick`
SPEED = dict(elements=4096, draws=100_000, chunk=250)
CONFIDENCE = 0.95  # of the upper bound on the observed rate


def integer_sr(x: jax.Array, key: jax.Array) -> jax.Array:
    """Stochastic rounding onto the integers: up with probability `x - floor(x)`."""
    floor = jnp.floor(x)
    return floor + (jax.random.uniform(key, x.shape) < x - floor)


def format_values(dtype: Any) -> np.ndarray:
    """Every finite value of an ml_dtypes format, sorted, in float64: each is a
    multiple of the smallest subnormal, so casting those multiples finds them all."""
    info = ml_dtypes.finfo(dtype)
    tiny, top = float(info.smallest_subnormal), float(info.max)
    steps = np.arange(-round(top / tiny), round(top / tiny) + 1) * tiny
    return np.unique(steps.astype(dtype).astype(np.float64))


def neighbours(values: np.ndarray, x: Any) -> tuple[np.ndarray, np.ndarray]:
    """The values `L <= x <= U` of sorted `values` around `x` (`L = U = x` where
    `x` is one of them), in float64."""
    x = np.asarray(x, np.float64)
    i = np.clip(np.searchsorted(values, x, side="right") - 1, 0, len(values) - 2)
    lower = values[i]
    return lower, np.where(lower == x, lower, values[i + 1])


def grid_sr(values: np.ndarray, dtype: Any = jnp.float32) -> Callable[..., Any]:
    """Stochastic rounding onto sorted `values` (finite, representable in float32),
    returned in `dtype`: up to the next value with probability `(x - L)/(U - L)`."""
    table = jnp.asarray(values, jnp.float32)

    def sr(x: jax.Array, key: jax.Array) -> jax.Array:
        i = jnp.clip(jnp.searchsorted(table, x, side="right") - 1, 0, len(values) - 2)
        lower, upper = table[i], table[i + 1]
        upper = jnp.where(lower == x, lower, upper)
        p = jnp.where(lower == upper, 0.0, (x - lower) / (upper - lower))
        return jnp.where(jax.random.uniform(key, x.shape) < p, upper, lower).astype(
            dtype
        )

    return sr


def problem(grid: str, elements: int, key: jax.Array):
    """A correct rounding onto `grid`, `elements` values of `x` strictly between
    neighbours (uniform in the format's range), and their neighbours."""
    if grid == "integers":
        x = jax.random.uniform(key, (elements,), minval=-8, maxval=8)
        return integer_sr, x, (np.floor(np.asarray(x)), np.ceil(np.asarray(x)))
    dtype = getattr(ml_dtypes, grid)
    values = format_values(dtype)
    top = float(ml_dtypes.finfo(dtype).max)
    x = jax.random.uniform(key, (elements,), minval=-top, maxval=top)
    return grid_sr(values, getattr(jnp, grid)), x, neighbours(values, x)


def _log_pmf(n: int, p: np.ndarray) -> np.ndarray:
    """`log P(k)` of Binomial(n, p) for k = 0..n, one row per `p` (in (0, 1))."""
    log_fact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1)))])
    k = np.arange(n + 1)
    p = np.asarray(p, np.float64)[:, None]
    return (
        log_fact[n]
        - log_fact[k]
        - log_fact[n - k]
        + k * np.log(p)
        + (n - k) * np.log1p(-p)
    )


def exact_rate(p: Any, draws: int, threshold: float, truth: Any | None = None) -> float:
    """The exact probability that the check fails a rounding whose elements round
    up independently with probabilities `truth` (by default `p`, a correct one),
    where an element fails when `n KL(k/n || p) > threshold`, summed over the
    binomial law of `k`. Elements with `p` of 0 or 1 are left out (a correct
    rounding never fails there)."""
    p = np.asarray(p, np.float64).ravel()
    truth = p if truth is None else np.broadcast_to(truth, p.shape)
    inside = (p > 0) & (p < 1)
    p, truth = p[inside, None], np.asarray(truth, np.float64)[inside]
    q = np.arange(draws + 1) / draws
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = np.where(q > 0, q * np.log(q / p), 0.0) + np.where(
            q < 1, (1 - q) * np.log((1 - q) / (1 - p)), 0.0
        )
        fails = np.where(draws * kl > threshold, np.exp(_log_pmf(draws, truth)), 0.0)
        # 1 - prod(1 - fail), in log space: the elements' failures are independent.
        return float(-np.expm1(np.log1p(-fails.sum(1).clip(max=1.0)).sum()))


def upper_bound(failures: int, runs: int, confidence: float = CONFIDENCE) -> float:
    """The exact (Clopper-Pearson) one-sided upper confidence bound on a rate,
    given `failures` in `runs`: the `u` with `P(Binomial(runs, u) <= failures)` equal
    to `1 - confidence`, by bisection."""
    low, high = failures / runs, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        cdf = np.exp(_log_pmf(runs, np.array([mid]))[0, : failures + 1]).sum()
        low, high = (mid, high) if cdf > 1 - confidence else (low, mid)
    return high


def calibrate(
    fn: Callable[..., Any],
    x: jax.Array,
    pair: tuple[np.ndarray, np.ndarray],
    *,
    runs: int,
    draws: int,
    rate: float,
    key: jax.Array,
) -> dict[str, Any]:
    """Run `check_unbiased` `runs` times (keys `fold_in(key, run)`), and count the
    failures; with the exact rate of the test on these `x` (`exact_rate`)."""
    failures, threshold = 0, 0.0
    for run in range(runs):
        checked = check_unbiased(
            fn,
            x,
            key=jax.random.fold_in(key, run),
            neighbours=pair,
            draws=draws,
            false_fail_rate=rate,
            raise_on_failure=False,
        )
        failures += not checked.passed
        threshold = checked.threshold
    lower, upper = pair
    gap = upper - lower
    p = (np.asarray(x, np.float64) - lower) / np.where(gap > 0, gap, 1.0)
    return dict(
        runs=runs,
        failures=failures,
        exact=exact_rate(p, draws, threshold),
        upper=upper_bound(failures, runs),
        detectable=checked.detectable,
    )


def _speed(log: Callable[[str], None]) -> dict[str, Any]:
    fn, x, pair = problem("float8_e4m3fn", SPEED["elements"], jax.random.key(1))
    seconds = []
    for run in range(3):  # cold (compiles), then warm
        start = time.perf_counter()
        checked = check_unbiased(
            fn,
            x,
            key=jax.random.key(run),
            neighbours=pair,
            draws=SPEED["draws"],
            chunk=SPEED["chunk"],
        )
        seconds.append(time.perf_counter() - start)
    log(f"  speed: {', '.join(f'{s:.1f}s' for s in seconds)}")

    @jax.jit
    def draw_only(key):
        # The least any mean test does: every draw made and summed.
        keys = jax.random.split(key, SPEED["draws"]).reshape(-1, SPEED["chunk"])
        draw = jax.vmap(fn, in_axes=(None, 0))
        return jax.lax.map(lambda k: draw(x, k).astype(jnp.float32).sum(0), keys)

    draw_only(jax.random.key(0)).block_until_ready()
    start = time.perf_counter()
    draw_only(jax.random.key(1)).block_until_ready()
    alone = time.perf_counter() - start
    return dict(
        SPEED,
        cold=seconds[0],
        warm=min(seconds[1:]),
        alone=alone,
        detectable=checked.detectable,
    )


def run(job: Job) -> dict[str, Any]:
    runs = RUNS[job.quick]
    rows = []
    for i, (grid, elements, draws, rate) in enumerate(ROWS):
        fn, x, pair = problem(grid, elements, jax.random.key(100 + i))
        row = calibrate(
            fn, x, pair, runs=runs, draws=draws, rate=rate, key=jax.random.key(i)
        )
        row.update(grid=grid, elements=elements, draws=draws, rate=rate)
        job.log(f"  {grid} m={elements} rate={rate}: {row['failures']}/{runs}")
        rows.append(row)
    return dict(rows=rows, speed=_speed(job.log))


def render(res: dict[str, Any] | None, results: dict[str, Any]) -> list[str]:
    if res is None:
        return []
    lines = report.opening(NAME, res, results, runs=res["rows"][0]["runs"])
    for r in res["rows"]:
        lines.append(
            f"| {r['grid']} | {r['elements']} | {r['draws']} | {r['rate']:g} | "
            f"{r['failures']}/{r['runs']} = {r['failures'] / r['runs']:.4f} | "
            f"{r['upper']:.4f} | {r['exact']:.4f} | {r['detectable']:.3f} |"
        )
    s = res["speed"]
    lines += report.fill(NAME, "speed", s=s, ratio=s["warm"] / s["alone"])
    return lines + [""]
