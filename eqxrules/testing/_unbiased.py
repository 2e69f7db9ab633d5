"""`check_unbiased`: test that a stochastic rounding is unbiased, at a stated
false-fail rate, and say what bias the test could have caught. The statistics are
in `_chernoff`; here the draws are made (on the device, in chunks) and judged."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, PRNGKeyArray

from ._chernoff import _as_int, _as_rate, _envelope, _kl

TEST = (
    "two-sided Chernoff-KL bound per element (Hoeffding 1963, Theorem 1), "
    "union bound over the elements"
)
_CHUNK_ELEMENTS = 2**20  # draws x elements held at once: ~4 MiB per float32 array
_MAX_CHUNK = 2**15  # so that `_draw`'s two counts share an int32

Pair = tuple[ArrayLike, ArrayLike] | Callable[[np.ndarray], Any]


@dataclasses.dataclass(frozen=True, eq=False)
class UnbiasedReport:
    r"""What [`check_unbiased`][] found. With $n$ = `draws`:

    - `passed`, `detail`: whether it passed; why not (the failure's message).
    - `test`, `draws`, `elements`, `false_fail_rate`, `false_pass_rate`,
        `threshold`: the test; the elements $m$ with $0 < p < 1$ (the union bound's
        count); $\alpha$; $\beta$; $c = \log(2m/\alpha)$, the bound on
        $n\,\mathrm{KL}(\hat q \| p)$.
    - `index`, `x`, `mean`, `interval`, `statistic`, `p_value`: the worst element
        (the one failing, or the nearest to failing): its index, `x` there, the
        observed mean of its draws, the interval an unbiased rounding keeps that
        mean in (but for probability $\alpha$ over all elements), its
        $n\,\mathrm{KL}(\hat q \| p)$, and the bound $\min(1, 2m\,e^{-n\mathrm{KL}})$
        on its union-bound p-value (the check fails when it is below $\alpha$).
        With stray draws, the element with the most.
    - `stray_draws`: draws that were neither neighbour (or outside the bounds).
    - `detectable`: the detectable bias ([`detectable_bias`][]) as a fraction of
        $U - L$, the worst over the elements with $L < U$ ($0$ if none).
    - `detectable_biases`, `means`: per element, the detectable bias in `x`'s
        units (a fraction times $U - L$, or $hi - lo$), and the observed mean.
    """

    passed: bool
    detail: str
    test: str
    draws: int
    elements: int
    false_fail_rate: float
    false_pass_rate: float
    threshold: float
    index: tuple[int, ...]
    x: float
    mean: float
    interval: tuple[float, float]
    statistic: float
    p_value: float
    stray_draws: int
    detectable: float
    detectable_biases: np.ndarray
    means: np.ndarray

    def __str__(self) -> str:
        verdict = "passed" if self.passed else f"failed: {self.detail}"
        return (
            f"check_unbiased {verdict}\n{self.draws} draws, {self.test} over "
            f"{self.elements} element(s) at false-fail rate {self.false_fail_rate:g}. "
            f"Worst element {self.index}: mean {self.mean:.9g} where x = {self.x:.9g} "
            f"(bound [{self.interval[0]:.9g}, {self.interval[1]:.9g}], p-value at "
            f"most {self.p_value:.3g}). Detectable bias {self.detectable:.3g} of the "
            f"gap between neighbours, with power {1 - self.false_pass_rate:g}."
        )


class UnbiasedCheckError(AssertionError):
    """Raised by [`check_unbiased`][] when the draws are biased or stray; `report`
    is its [`UnbiasedReport`][]."""

    def __init__(self, message: str, report: UnbiasedReport) -> None:
        super().__init__(message)
        self.report = report


@eqx.filter_jit
def _draw(fn, x, lo, hi, key, draws: int, chunk: int, exact: bool):
    """One scan over chunks of `chunk` draws (the draws past `draws` in the last
    chunk masked out). Per element: the draws equal to `hi` (with `exact`, where
    `lo < hi`), the stray draws, the largest stray value and the sum of the stray
    draws' `q - x`; without `exact`, also each chunk's sum of `q - x`."""
    chunks = -(-draws // chunk)
    keys = jax.random.split(key, draws)
    # Draw i has key i whatever the chunk: the last chunk is padded with keys
    # already used, whose draws are masked out.
    keys = jnp.concatenate([keys, keys[: chunks * chunk - draws]])
    keys = keys.reshape((chunks, chunk) + keys.shape[1:])

    def body(carry, inputs):
        ups, strays, example, spill = carry
        keys, start = inputs
        q = jax.vmap(fn, in_axes=(None, 0))(x, keys).astype(lo.dtype)
        valid = (start + jnp.arange(chunk) < draws).reshape((chunk,) + (1,) * x.ndim)
        sums = None
        if exact:
            stray = ~((q == hi) | (q == lo)) & valid
            # Both counts in one pass (drawing dominates, and each pass re-reads
            # the draws): a chunk has at most `chunk` of each.
            up = (q == hi) & (lo < hi) & valid
            code = jnp.sum(up + stray * jnp.int32(chunk + 1), 0, dtype=jnp.int32)
            ups, found = ups + code % (chunk + 1), code // (chunk + 1)
        else:
            stray = ~((q >= lo) & (q <= hi)) & valid
            found = jnp.sum(stray, 0, dtype=jnp.int32)
            sums = jnp.sum(jnp.where(valid, q - x, 0), 0)

        def record(example, spill):
            seen = jnp.max(jnp.where(stray, q, -jnp.inf), 0)
            spill = spill + jnp.sum(jnp.where(stray, q - x, 0), 0)
            return jnp.where(found > 0, seen, example), spill

        # Only a failing rounding has stray draws: spare correct ones the passes.
        example, spill = jax.lax.cond(
            jnp.any(found > 0), record, lambda *a: a, example, spill
        )
        return (ups, strays + found, example, spill), sums

    zeros = jnp.zeros(x.shape, jnp.int32)
    nothing = jnp.zeros(x.shape, lo.dtype)
    init = (zeros, zeros, jnp.full(x.shape, jnp.nan, lo.dtype), nothing)
    starts = jnp.arange(chunks) * chunk
    return jax.lax.scan(body, init, (keys, starts))


def _pair(name: str, value: Pair, x: Array, wide: Any) -> tuple[np.ndarray, ...]:
    """`neighbours` or `bounds`, called on `x` if a function, as float64 arrays of
    `x`'s shape, checked: finite, representable in the draws' dtype, around `x`."""
    where = "`check_unbiased`: "
    if callable(value):
        value = value(np.asarray(x))
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(
            f"{where}`{name}` must be a pair (lower, upper) of arrays, or a function "
            f"of `x` returning one, not {type(value).__name__}."
        )
    try:
        pair = [np.broadcast_to(np.asarray(v, np.float64), x.shape) for v in value]
    except ValueError:
        shapes = [np.shape(v) for v in value]
        raise ValueError(
            f"{where}`{name}` has shapes {shapes}, which do not broadcast to `x`'s "
            f"{x.shape}."
        ) from None
    host = np.asarray(x, np.float64)
    for label, v in zip(("lower", "upper"), pair):
        bad = ~np.isfinite(v) | (v.astype(wide).astype(np.float64) != v)
        if bad.any():
            i = tuple(int(j) for j in np.argwhere(bad)[0])
            raise ValueError(
                f"{where}`{name}`'s {label} value at index {i} (={float(v[i])!r}) must be "
                f"finite and representable in the draws' dtype {np.dtype(wide)}."
            )
    outside = (pair[0] > host) | (host > pair[1])
    if outside.any():
        i = tuple(int(j) for j in np.argwhere(outside)[0])
        raise ValueError(
            f"{where}`{name}` at index {i} must hold `x` (={float(host[i])!r}) between them, "
            f"but they are {float(pair[0][i])!r} and {float(pair[1][i])!r}."
        )
    return pair[0], pair[1]


def check_unbiased(
    fn: Callable[[Array, PRNGKeyArray], Array],
    x: ArrayLike,
    *,
    key: PRNGKeyArray,
    neighbours: Pair | None = None,
    bounds: Pair | None = None,
    draws: int = 100_000,
    false_fail_rate: float = 1e-6,
    false_pass_rate: float = 0.5,
    chunk: int | None = None,
    raise_on_failure: bool = True,
) -> UnbiasedReport:
    r"""Test that a stochastic rounding is unbiased, $E[\,$`fn(x, key)`$\,] = x$
    elementwise, failing a correct one with probability at most `false_fail_rate`.

    `fn(x, key)` must return a rounding of `x` of its shape. It is drawn `draws`
    times, under `jax.jit` and `jax.vmap` over `jax.random.split(key, draws)`, in
    chunks of `chunk` draws (by default about $2^{20}$ values at a time); the draws
    must be independent (different keys), as they are for a correct rounding.

    **With `neighbours=(L, U)`**, the representable values around `x` (arrays, or a
    function of `x` returning them; $L = U = x$ where `x` is representable), every
    draw must be $L$ or $U$: any other value fails the check at once (no false
    fail is possible). An unbiased rounding picks $U$ with probability
    $p = (x - L)/(U - L)$, so its fraction $\hat q$ of $U$ among $n$ draws is
    $\mathrm{Binomial}(n, p)/n$. Where $p$ is $0$ or $1$ a single wrong draw fails.
    Over the $m$ elements with $0 < p < 1$ the check fails when, at any one,

    $$n\,\mathrm{KL}(\hat q \,\|\, p) > c = \log\frac{2m}{\alpha}.$$

    By Chernoff's bound in Hoeffding's form (1963, Theorem 1),

    $$P(\hat q \ge a) \le e^{-n\,\mathrm{KL}(a \,\|\, p)}\ (a \ge p), \qquad
    \mathrm{KL}(a \,\|\, p) = a \log\frac{a}{p} + (1 - a) \log\frac{1 - a}{1 - p},$$

    and alike below $p$, so each tail has probability at most $e^{-c} =
    \alpha/2m$, each element at most $\alpha/m$, and by the union bound
    (Bonferroni) the check fails a correct rounding with probability at most
    $\alpha$ = `false_fail_rate`, however the elements' draws depend on each other.
    This is an upper bound, not an approximation: no normal approximation is made.
    Exact binomial tails would allow a threshold about 7% closer to $p$ (at
    $n = 10^5$, $m = 10^3$, $\alpha = 10^{-6}$: $6.1$ standard deviations instead
    of $\sqrt{2c} = 6.5$); the Chernoff-KL bound is used because it is
    closed-form, stable at any $n$, needs no special functions, and serves both
    modes.

    **With `bounds=(lo, hi)`**, for roundings whose neighbours cannot be known,
    every draw must lie in $[lo, hi]$ (or fail at once), and $\hat q$ is the mean of
    the draws mapped onto $[0, 1]$, $p = (x - lo)/(hi - lo)$: the same bound holds
    (Hoeffding's Theorem 1 is for any variables in $[0, 1]$), and is as tight as
    the neighbours' when $[lo, hi] = [L, U]$, weaker as the range widens. A range
    is required: one read off the draws themselves would depend on them, and the
    bound would no longer hold.

    The report says what the test could have caught: at each element, any rounding
    whose $P(U)$ is further than [`detectable_bias`][] from $p$ fails with
    probability at least $1 -$ `false_pass_rate`; [`draws_to_detect_bias`][] says
    how many draws a given bias needs. It cannot see a bias near the
    resolution of a rounding's random bits (say $2^{-20}(U - L)$): that needs of
    the order of $2^{40}$ draws; prove it exhaustively instead.

    **Arguments:**

    - `fn`: the rounding, `fn(x, key)`.
    - `x`: the values to round (floating point, finite).
    - `key`: a PRNG key, split into one key per draw.
    - `neighbours`, `bounds`: exactly one, as above.
    - `draws`: the number of draws $n$.
    - `false_fail_rate`: $\alpha$, the most probability with which a correct
        rounding fails, over all elements together.
    - `false_pass_rate`: $\beta$, for the detectable bias: caught with power
        $1 - \beta$.
    - `chunk`: how many draws are evaluated at once (memory), at most $2^{15}$.
    - `raise_on_failure`: raise [`UnbiasedCheckError`][] on failure (else only
        report it).

    **Returns:** an [`UnbiasedReport`][].

    !!! Example
        ```python
        def sr(x, key):  # stochastic rounding onto the integers
            floor = jnp.floor(x)
            return floor + (jax.random.uniform(key, x.shape) < x - floor)

        x = jnp.linspace(-2, 2, 101)
        report = check_unbiased(
            sr, x, key=jax.random.key(0), neighbours=(jnp.floor(x), jnp.ceil(x))
        )
        report.detectable  # 0.012: P(up) off by 1.2% is caught, with power 1/2
        ```
    """
    name = "`check_unbiased`: "
    if not callable(fn):
        raise TypeError(f"{name}`fn` must be callable, not {type(fn).__name__}.")
    draws = _as_int("draws", "check_unbiased", draws)
    alpha = _as_rate("false_fail_rate", "check_unbiased", false_fail_rate)
    beta = _as_rate("false_pass_rate", "check_unbiased", false_pass_rate)
    if chunk is not None:
        chunk = _as_int("chunk", "check_unbiased", chunk)
    if (neighbours is None) == (bounds is None):
        raise ValueError(
            f"{name}pass exactly one of `neighbours` (the two representable values "
            "around `x`) and `bounds` (a range every draw lies in); got "
            f"{'both' if neighbours is not None else 'neither'}."
        )
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name}`x` must be floating point, not {x.dtype}.")
    if x.size == 0:
        raise ValueError(f"{name}`x` (shape {x.shape}) must have an element.")
    host = np.asarray(x, np.float64)
    if not np.isfinite(host).all():
        i = tuple(int(j) for j in np.argwhere(~np.isfinite(host))[0])
        raise ValueError(
            f"{name}`x` at index {i} (={float(host[i])!r}) must be finite."
        )
    typed = isinstance(key, jax.Array) and jnp.issubdtype(
        key.dtype, jax.dtypes.prng_key
    )
    raw = isinstance(key, jax.Array) and key.dtype == jnp.uint32
    if not ((typed and key.shape == ()) or (raw and key.shape == (2,))):
        raise TypeError(
            f"{name}`key` must be one PRNG key (`jax.random.key(0)`), not {key!r}."
        )
    out = jax.eval_shape(fn, x, key)
    if not isinstance(out, jax.ShapeDtypeStruct) or out.shape != x.shape:
        raise ValueError(
            f"{name}`fn(x, key)` must return one array of `x`'s shape {x.shape}, "
            f"not {out}."
        )
    if not any(jnp.issubdtype(out.dtype, k) for k in (jnp.floating, jnp.integer)):
        raise TypeError(
            f"{name}`fn(x, key)` must return real numbers, not {out.dtype}."
        )
    # Every format narrower than float32 (float8, float4, bfloat16) fits in it
    # exactly, and such dtypes do not promote implicitly.
    wide = np.float64 if np.float64 in (out.dtype, x.dtype) else np.float32
    exact = neighbours is not None
    pair = neighbours if exact else bounds
    assert pair is not None
    lo, hi = _pair("neighbours" if exact else "bounds", pair, x, wide)
    chunk = min(draws, _MAX_CHUNK, chunk or max(1, _CHUNK_ELEMENTS // x.size))
    (ups, strays, example, spill), sums = _draw(
        fn, x, jnp.asarray(lo, wide), jnp.asarray(hi, wide), key, draws, chunk, exact
    )
    ups, strays, example = np.asarray(ups), np.asarray(strays), np.asarray(example)
    if exact:  # the draws' sum of q - x, from the counts and the strays' own sum
        downs = draws - ups - strays
        deviation = ups * (hi - host) + downs * (lo - host) + np.asarray(spill)
    else:
        deviation = np.asarray(sums, np.float64).sum(0)
    means = host + deviation / draws
    gap = hi - lo
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(gap > 0, (host - lo) / gap, 0.0)
        q = ups / draws if exact else np.clip(p + (means - host) / gap, 0, 1)
    q = np.where(gap > 0, q, 0.0)
    m = max(1, int(np.count_nonzero((p > 0) & (p < 1))))
    c = math.log(2 * m / alpha)
    stat = draws * _kl(q, p)
    below, above, shifts = _envelope(p, draws, c, math.log(1 / beta))
    shifts = np.where(gap > 0, shifts, 0.0)
    i = np.unravel_index(np.argmax(strays if strays.any() else stat), x.shape)
    ends = (lo[i] + gap[i] * below[i], lo[i] + gap[i] * above[i])
    p_value = min(1.0, 2 * m * math.exp(-stat[i]))
    if strays.any():
        detail = (
            f"{name}{strays[i]} of {draws} draws at index {tuple(map(int, i))} are "
            f"{'neither neighbour' if exact else 'outside the bounds'} of `x` "
            f"(={host[i]:.9g}), {'neighbours' if exact else 'bounds'} {lo[i]:.9g} "
            f"and {hi[i]:.9g}: one was {example[i]:.9g}. {int(strays.sum())} stray "
            f"draws over {np.count_nonzero(strays)} element(s)."
        )
    elif stat[i] > c:
        observed = (
            f"{ups[i]} of {draws} draws rounded up"
            if exact
            else f"the draws' mean is {q[i]:.6g} of the way from {lo[i]:.9g} to "
            f"{hi[i]:.9g}"
        )
        detail = (
            f"{name}the mean of {draws} draws at index {tuple(map(int, i))} is "
            f"{means[i]:.9g} where `x` = {host[i]:.9g} ({observed}, where an "
            f"unbiased rounding rounds up with probability {p[i]:.6g}); an unbiased "
            f"rounding keeps the mean in [{ends[0]:.9g}, {ends[1]:.9g}] but for "
            f"probability {alpha:g} over all {m} element(s) ({TEST}: "
            f"n KL = {stat[i]:.4g} > log(2m/alpha) = {c:.4g}, p-value at most "
            f"{p_value:.3g}). {np.count_nonzero(stat > c)} element(s) fail."
        )
    else:
        detail = ""
    report = UnbiasedReport(
        passed=not detail,
        detail=detail,
        test=TEST,
        draws=draws,
        elements=m,
        false_fail_rate=alpha,
        false_pass_rate=beta,
        threshold=c,
        index=tuple(map(int, i)),
        x=float(host[i]),
        mean=float(means[i]),
        interval=(float(ends[0]), float(ends[1])),
        statistic=float(stat[i]),
        p_value=p_value,
        stray_draws=int(strays.sum()),
        detectable=float(shifts[gap > 0].max(initial=0.0)),
        detectable_biases=shifts * gap,
        means=means,
    )
    if detail and raise_on_failure:
        raise UnbiasedCheckError(detail, report)
    return report
