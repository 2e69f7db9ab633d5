"""`check_unbiased`: test that a stochastic rounding is unbiased, at a stated
false-fail rate, and say what bias the test could have caught. The statistics are
in `_chernoff`, the draws in `_unbiased_draws`; here they are judged."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, PRNGKeyArray

from ._chernoff import _as_int, _as_rate, _envelope, _kl
from ._unbiased_draws import _draw, _draw_seen
from ._unbiased_report import TEST, UnbiasedCheckError, UnbiasedReport

_CHUNK_ELEMENTS = 2**20  # draws x elements held at once: ~4 MiB per float32 array
_MAX_CHUNK = 2**15  # so that `_draw`'s two counts share an int32
_NAME = "`check_unbiased`: "

Pair = tuple[ArrayLike, ArrayLike] | Callable[[np.ndarray], Any]


def _pair(name: str, value: Pair, x: Array, wide: Any) -> tuple[np.ndarray, np.ndarray]:
    """`neighbours`, `bounds` or `within`, called on `x` if a function, as float64 arrays of
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


def _given(mode, fn, x, host, lo, hi, key, draws, chunk, wide) -> dict[str, Any]:
    """Draws against `neighbours` (`exact`) or `within` (a range): the fraction
    `q` of draws at `hi`, or of the way from `lo` to `hi` of their mean."""
    exact = mode == "neighbours"
    (ups, strays, example, spill), sums = _draw(
        fn, x, jnp.asarray(lo, wide), jnp.asarray(hi, wide), key, draws, chunk, exact
    )
    ups, strays = np.asarray(ups), np.asarray(strays)
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
    inside = (p > 0) & (p < 1)
    return dict(
        lower=lo, upper=hi, p=p, q=q, ups=ups, strays=strays, means=means,
        example=np.asarray(example), stat=draws * _kl(q, p), tested=inside,
    )  # fmt: skip


def _seen(fn, x, host, bounds, key, draws, chunk, wide) -> dict[str, Any]:
    """Draws against the two values drawn (see `check_unbiased`), `bounds` (or
    None) bounding the neighbour not drawn."""
    lo, hi, downs, ups, strays, example, spill = (
        np.asarray(v) for v in _draw_seen(fn, x, key, draws, chunk, wide)
    )
    lo, hi = lo.astype(np.float64), hi.astype(np.float64)
    with np.errstate(invalid="ignore"):
        deviation = (
            np.where(downs > 0, downs * (lo - host), 0.0)
            + np.where(ups > 0, ups * (hi - host), 0.0)
            + spill
        )
    means = host + deviation / draws
    clean = strays == 0
    one = clean & (lo == hi)
    exactly = one & (lo == host)  # `x` itself, every draw: representable
    single = one & ~exactly
    two = clean & (lo < hi)
    misplaced = two & ((host < lo) | (host > hi))
    gap = np.where(two, hi - lo, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(two, np.clip((host - lo) / gap, 0, 1), 0.0)
        stat = draws * _kl(np.where(two, ups / draws, 0.0), p)
        # One value v: the other neighbour w, on the other side of `x`, is drawn
        # with probability at least r = |x - v| / |w - v|, least for the farthest
        # w that `bounds` allows; P(all n draws are v) <= (1 - r)^n.
        if bounds is None:
            r = np.ones_like(host)
        else:
            far = np.where(lo < host, bounds[1], bounds[0])
            r = np.where(single, np.abs(host - lo) / np.abs(far - lo), 0.0)
        stat = np.where(single, -draws * np.log1p(-np.minimum(r, 1.0)), stat)
    stat = np.where(misplaced, np.inf, stat)
    lower = np.where(two | exactly, lo, np.where(single & (lo < host), lo, np.nan))
    upper = np.where(two | exactly, hi, np.where(single & (lo > host), lo, np.nan))
    outside = np.zeros(host.shape, np.int64)  # draws outside `bounds`
    if bounds is not None:
        low, high = clean & (lo < bounds[0]), clean & (hi > bounds[1])
        outside = np.where(low, downs, 0) + np.where(high, np.where(two, ups, downs), 0)
    return dict(
        lower=lower, upper=upper, p=p, q=np.where(two, ups / draws, 0.0),
        ups=ups, strays=np.asarray(strays), means=means, example=example,
        stat=stat, tested=~exactly, outside=outside, misplaced=misplaced,
        single=single, r=r, bounds=bounds, seen=(lo, hi),
    )  # fmt: skip


def _detail(mode, d, i, host, draws, alpha, m, c, ends, p_value, failing) -> str:
    """The failure's message at the worst element `i` (empty if it passed)."""
    at = f"at index {tuple(map(int, i))}"
    lo, hi, x = d["lower"][i], d["upper"][i], host[i]
    strays = d["strays"]
    if strays.any():
        if mode == "seen":
            seen = d["seen"]
            what = (
                f"were a third value (or not finite) beside {seen[0][i]:.9g} and "
                f"{seen[1][i]:.9g}, where a rounding draws only the two neighbours "
                f"of `x` (={x:.9g})"
            )
        elif mode == "neighbours":
            what = f"are neither neighbour of `x` (={x:.9g}), {lo:.9g} and {hi:.9g}"
        else:
            what = f"are outside `within` [{lo:.9g}, {hi:.9g}] of `x` (={x:.9g})"
        return (
            f"{_NAME}{strays[i]} of {draws} draws {at} {what}: one was "
            f"{d['example'][i]:.9g}. {int(strays.sum())} stray draws over "
            f"{np.count_nonzero(strays)} element(s)."
        )
    outside = d.get("outside")
    if outside is not None and outside.any():
        b = d["bounds"]
        return (
            f"{_NAME}{outside[i]} of {draws} draws {at} are outside `bounds` "
            f"[{b[0][i]:.9g}, {b[1][i]:.9g}] of `x` (={x:.9g}): they drew "
            f"{d['seen'][0][i]:.9g} to {d['seen'][1][i]:.9g}. "
            f"{np.count_nonzero(outside)} element(s) fail."
        )
    if mode == "seen" and d["misplaced"].any():
        seen = d["seen"]
        side = "below" if seen[1][i] < x else "above"
        return (
            f"{_NAME}every one of {draws} draws {at} lies {side} `x` (={x:.9g}): "
            f"{seen[0][i]:.9g} and {seen[1][i]:.9g}, where an unbiased rounding "
            f"draws the neighbours either side of `x`. "
            f"{np.count_nonzero(d['misplaced'])} element(s) fail."
        )
    if not failing.any():
        return ""
    count = f"{np.count_nonzero(failing)} element(s) fail."
    if mode == "seen" and d["single"][i]:
        v = d["seen"][0][i]
        if d["bounds"] is None:
            delta = -math.expm1(-c / draws)
            return (
                f"{_NAME}all {draws} draws {at} are {v:.9g}, where `x` = {x:.9g}: "
                "an unbiased rounding draws its other neighbour too, and without "
                "`neighbours` or `bounds` an element that draws one value other "
                "than `x` fails (the check assumes every `x` lies at least "
                f"{delta:.3g} of its gap from both neighbours, or on one; pass "
                f"`bounds` if it may lie nearer). {count}"
            )
        b = d["bounds"]
        far = b[1][i] if v < x else b[0][i]
        return (
            f"{_NAME}all {draws} draws {at} are {v:.9g}, where `x` = {x:.9g}: even "
            f"with the other neighbour as far as `bounds` allows ({far:.9g}), an "
            f"unbiased rounding draws only {v:.9g} with probability at most "
            f"{math.exp(-d['stat'][i]):.3g}, below alpha/2m = {alpha / (2 * m):.3g} "
            f"({m} element(s) tested). {count}"
        )
    if mode == "within":
        observed = (
            f"the draws' mean is {d['q'][i]:.6g} of the way from {lo:.9g} to {hi:.9g}"
        )
    else:
        observed = f"{d['ups'][i]} of {draws} draws rounded up to {hi:.9g}"
    return (
        f"{_NAME}the mean of {draws} draws {at} is {d['means'][i]:.9g} where `x` = "
        f"{x:.9g} ({observed}, where an unbiased rounding rounds up with "
        f"probability {d['p'][i]:.6g}); an unbiased rounding keeps the mean in "
        f"[{ends[0]:.9g}, {ends[1]:.9g}] but for probability {alpha:g} over all {m} "
        f"element(s) ({TEST}: n KL = {d['stat'][i]:.4g} > log(2m/alpha) = {c:.4g}, "
        f"p-value at most {p_value:.3g}). {count}"
    )


def check_unbiased(
    fn: Callable[[Array, PRNGKeyArray], Array],
    x: ArrayLike,
    *,
    key: PRNGKeyArray,
    neighbours: Pair | None = None,
    bounds: Pair | None = None,
    within: Pair | None = None,
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

    **The test.** A rounding draws, at each element, one of the two representable
    values $L \le x \le U$ around it ($L = U = x$ where `x` is representable). An
    unbiased one picks $U$ with probability $p = (x - L)/(U - L)$, so its
    fraction $\hat q$ of $U$ among $n$ draws is $\mathrm{Binomial}(n, p)/n$.
    Where $p$ is $0$ or $1$ a single wrong draw fails. Over the $m$ elements with
    $0 < p < 1$ the check fails when, at any one,

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
    closed-form, stable at any $n$, needs no special functions, and serves every
    mode.

    **The neighbours.** With `neighbours=(L, U)` (arrays, or a function of `x`
    returning them), every draw must be $L$ or $U$: any other value fails the
    check at once (no false fail is possible).

    Without them, $L$ and $U$ are read off each element's draws: the least and
    the largest value drawn, of which there must be at most two (a third, or a
    value not finite, fails at once: a rounding draws only its two neighbours).
    The test is then the one above, though $L$ and $U$ now depend on the draws,
    because a correct rounding draws only its true neighbours:

    - where it drew two values, they are its neighbours exactly, and $\hat q$,
        $p$ and the statistic are those that `neighbours` would give;
    - where it drew only `x`, `x` is representable ($L = U = x$), and it passes;
    - where it drew one value $v \ne x$ in every draw (all $L$, say, a count of
        $0$), the test with `neighbours` fails when $(1 - p)^n < e^{-c}$. The
        other neighbour $w$ is unknown. With `bounds=(lo, hi)`, it lies no
        farther than the bound on its side, so $p \ge r = \lvert x - v\rvert /
        \lvert w_\mathrm{far} - v\rvert$, and the element fails only when
        $(1 - r)^n < e^{-c}$: then $(1 - p)^n < e^{-c}$ too. Without `bounds` it
        fails.

    So at every element the draws on which a correct rounding fails are among
    those on which it fails with `neighbours`; and $m$, counted as the elements
    that drew anything but `x`, is for a correct rounding exactly the count of
    those with $0 < p < 1$. The false-fail rate stays at most $\alpha$: with
    `bounds`, always; without, under one assumption on the inputs. A correct
    rounding draws one neighbour in all $n$ draws with probability
    $(1 - p)^n + p^n$, which the test with `neighbours` allows for (counts it in
    its failures) only where $\min(p, 1 - p) > \delta = 1 - e^{-c/n} \approx
    c/n$. So without `bounds` the check assumes that **every `x` is
    representable or lies at least a fraction $\delta$ of its gap from both its
    neighbours** ($\delta = 2.1 \times 10^{-4}$ at $n = 10^5$, $m = 10^3$,
    $\alpha = 10^{-6}$): an `x` nearer a neighbour may rightly draw it in every
    draw, and fails. Pass `bounds` (any range that holds the neighbours, such as
    the format's) or `neighbours` where `x` may lie nearer. Draws outside
    `bounds` fail at once.

    **With `within=(lo, hi)`**, for a random value that is not a rounding onto
    two neighbours (a sum of roundings, such as a product of stochastically
    rounded operands), every draw must lie in $[lo, hi]$ (or fail at once), and
    $\hat q$ is the mean of the draws mapped onto $[0, 1]$,
    $p = (x - lo)/(hi - lo)$: the same bound holds (Hoeffding's Theorem 1 is for
    any variables in $[0, 1]$), as tight as the neighbours' when $[lo, hi] =
    [L, U]$, weaker as the range widens. This range cannot be read off the draws.

    **What it detects.** At each element, any rounding whose $P(U)$ is further
    than [`detectable_bias`][] from $p$ fails with probability at least $1 -$
    `false_pass_rate`; the report gives that bias per element as a fraction of its
    own gap $U - L$. [`draws_to_detect_bias`][] says how many draws a given bias
    needs: a shift of $P(U)$ by 1% of the gap, at $p = 1/2$, takes 107,711 draws
    for one element and 149,063 among 1000 elements (at $\alpha = 10^{-6}$,
    power $1/2$). It cannot see a bias near the resolution of a rounding's
    random bits (say $2^{-20}(U - L)$): that needs of the order of $2^{40}$
    draws; prove it exhaustively instead.

    **Arguments:**

    - `fn`: the rounding, `fn(x, key)`.
    - `x`: the values to round (floating point, finite).
    - `key`: a PRNG key, split into one key per draw.
    - `neighbours`, `bounds`, `within`: at most one, as above; pairs of arrays
        (lower, upper) broadcasting to `x`'s shape, or a function of `x`
        returning one, holding `x` between them.
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

        x = jnp.arange(-200, 201) / 100.0  # 0.01 apart, integers exactly
        report = check_unbiased(sr, x, key=jax.random.key(0))
        report.detectable  # 0.012: P(up) off by 1.2% of the gap is caught
        ```
    """
    name = _NAME
    if not callable(fn):
        raise TypeError(f"{name}`fn` must be callable, not {type(fn).__name__}.")
    draws = _as_int("draws", "check_unbiased", draws)
    alpha = _as_rate("false_fail_rate", "check_unbiased", false_fail_rate)
    beta = _as_rate("false_pass_rate", "check_unbiased", false_pass_rate)
    if chunk is not None:
        chunk = _as_int("chunk", "check_unbiased", chunk)
    given = {
        k: v
        for k, v in (("neighbours", neighbours), ("bounds", bounds), ("within", within))
        if v is not None
    }
    if len(given) > 1:
        raise ValueError(
            f"{name}pass at most one of `neighbours`, `bounds` and `within`; got "
            f"{' and '.join(f'`{k}`' for k in given)}."
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
    mode, pair = next(iter(given.items()), ("seen", None))
    pair = None if pair is None else _pair(mode, pair, x, wide)
    chunk = min(draws, _MAX_CHUNK, chunk or max(1, _CHUNK_ELEMENTS // x.size))
    if mode in ("neighbours", "within"):
        assert pair is not None
        lo, hi = pair
        d = _given(mode, fn, x, host, lo, hi, key, draws, chunk, wide)
    else:
        d = _seen(fn, x, host, pair, key, draws, chunk, wide)
        mode = "seen"
    return _judge(mode, d, host, draws, alpha, beta, raise_on_failure)


def _judge(mode, d, host, draws, alpha, beta, raise_on_failure) -> UnbiasedReport:
    m = max(1, int(np.count_nonzero(d["tested"])))
    c = math.log(2 * m / alpha)
    stat, strays = d["stat"], d["strays"]
    gap = d["upper"] - d["lower"]  # NaN where a neighbour was not drawn
    known = np.isfinite(gap) & (gap > 0)
    below, above, shifts = _envelope(
        np.where(known, d["p"], 0.0), draws, c, math.log(1 / beta)
    )
    fractions = np.where(known, shifts, np.where(np.isfinite(gap), 0.0, np.nan))
    failing = stat > c
    outside = d.get("outside", np.zeros(0))
    misplaced = d.get("misplaced", np.zeros(0, bool))
    first = next((a for a in (strays, outside, misplaced) if a.any()), stat)
    i = np.unravel_index(np.argmax(first), host.shape)
    ends = (d["lower"][i] + gap[i] * below[i], d["lower"][i] + gap[i] * above[i])
    p_value = min(1.0, 2 * m * math.exp(-stat[i]))
    detail = _detail(mode, d, i, host, draws, alpha, m, c, ends, p_value, failing)
    single = d.get("single", np.zeros(host.shape, bool))
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
        mean=float(d["means"][i]),
        interval=(float(ends[0]), float(ends[1])),
        statistic=float(stat[i]),
        p_value=p_value,
        stray_draws=int(strays.sum() + outside.sum()),
        lower=d["lower"],
        upper=d["upper"],
        detectable=float(fractions[known].max(initial=0.0)),
        detectable_fractions=fractions,
        detectable_biases=fractions * np.where(np.isfinite(gap), gap, np.nan),
        means=d["means"],
        one_valued=int(np.count_nonzero(single & ~failing)),
    )
    if detail and raise_on_failure:
        raise UnbiasedCheckError(detail, report)
    return report
