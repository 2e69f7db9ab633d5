r"""Quantisers: rounding onto levels forward, the straight-through estimator
backward. Values are computed in at least float32 and cast to the input's dtype;
`round` goes half to even. (Notation: see `_elementwise`.)"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._catalogue import Domain
from .._hyper import (
    Check,
    at_least,
    at_most,
    finite,
    greater_than,
    hyperparameter,
    integer,
)
from ._elementwise import _Elementwise, masked_identity, wide
from ._exact import MAX_BITS, ge, le, reference_quantize, resolvable, within
from ._formats import (
    RESOLUTION,
    random_bits,
    reference_random_bits,
    stochastic_floor,
)
from ._paths import quantize
from ._rounding import Rounded, rounding_mode
from ._stochastic import (
    reference_neighbours,
    reference_stochastic_quantize,
    stochastic_quantize,
    stochastic_ready,
)


def _reference_round(x: Array) -> Array:
    # Round half to even, written out: ties go to the even neighbour.
    f = jnp.floor(x)
    d = x - f
    even = jnp.remainder(f, 2) == 0
    return jnp.where(d > 0.5, f + 1, jnp.where(d < 0.5, f, jnp.where(even, f, f + 1)))


_AT_MOST_16 = at_most(
    MAX_BITS, " (the exact grid is a constant table of 2^bits levels)"
)
_RESOLVED = Check(
    lambda m: (
        f"leave grid steps that float32 resolves, with `bits` (={m.bits!r}) and "
        f"`lo` (={m.lo!r}): (hi - lo)/(2^bits - 1) must be more than a few float32 "
        "steps of max(|lo|, |hi|)"
    ),
    lambda v, m: resolvable(m.bits, m.lo, v),
    bad=lambda m: (m.lo + max(abs(m.lo), 1.0) * 2.0**-30,),
    after=(greater_than("lo"),),
)


def _quantizer_kinks(bits: int, lo: float, hi: float) -> tuple[float, ...]:
    """The range's ends, where the mask jumps, then the ties between levels (where
    rounding goes to even), the central ones first."""
    n = 2**bits - 1
    ties = [lo + (k + 0.5) * (hi - lo) / n for k in range(n)]
    return (lo, hi, *sorted(ties, key=lambda t: abs(t - (lo + hi) / 2)))


class SteRound(_Elementwise):
    r"""Rounding with the identity derivative.

    $$q = \operatorname{round}(x), \qquad \dot q = t$$

    `round` is `jnp.round`: halves go to the even neighbour ($0.5 \to 0$,
    $1.5 \to 2$).

    **Arguments:** none.

    !!! Example

        ```python
        eqxrules.ste_round(jnp.array([0.5, 1.5, 2.2]))  # [0, 2, 2]
        ```
    """

    summary: ClassVar[str] = "`jnp.round(x)` (half to even); derivative `t`"

    def kinks(self) -> tuple[float, ...]:
        return (-1.5, -0.5, 0.5, 1.5)

    def primal(self, x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        return jnp.round(x)

    def slope(self, x: Array) -> None:
        return None

    def reference_forward(self, x: Array) -> Array:
        return _reference_round(x)

    def reference_derivative(self, x: Array) -> Array:
        return x


_PROVED = Check(
    lambda m: (
        f"be 'nearest' on this grid (`bits`={m._grid()[0]!r}, `lo`={m._grid()[1]!r}, "
        f"`hi`={m._grid()[2]!r}): its stochastic rounding is not proved in float32, "
        "whose normal range it nears (levels below about 1e-27)"
    ),
    lambda v, m: v == "nearest" or stochastic_ready(*m._grid()),
    after=(rounding_mode,),
)


class _Grid(Rounded, _Elementwise):
    """What `SteQuantize` and `DoReFa` share: a static grid (`_grid()`), rounded to
    nearest or stochastically (`rounding`), with a masked straight-through
    derivative."""

    def _grid(self) -> tuple[int, float, float]:
        raise NotImplementedError

    def slope(self, x: Array) -> Array:
        raise NotImplementedError

    def kinks(self) -> tuple[float, ...]:
        return _quantizer_kinks(*self._grid())

    def primal(
        self, x: Float[Array, "*shape"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*shape"]:
        if not self.needs_key():
            return quantize(x, *self._grid(), self.slope(x))
        if key is None:  # the call checks it (`needs_key`); `primal` may be bare
            raise TypeError(f"`{self.rule_name()}` needs a PRNG key (`key=`).")
        return self._with_bits(x, random_bits(key, jnp.shape(x)))

    def _with_bits(
        self, x: Array, bits: Array | None, resolution: int = RESOLUTION
    ) -> Array:
        """The value, rounding stochastically with `bits` (one uint32 per element of
        `x`), or to nearest where `bits` is `None`. (A `resolution` other than
        `RESOLUTION` is for tests that count every `j`.)"""
        if bits is None:
            return quantize(x, *self._grid(), self.slope(x))
        return stochastic_quantize(x, *self._grid(), self.slope(x), bits, resolution)

    def neighbours(self, x: Array) -> tuple[Array, Array]:
        r"""The two values each element of `x` may take with stochastic rounding,
        lower first, from the exact levels: $L \le x \le U$ rounded to `x`'s
        dtype (both `x` where it is one of them; the end level beyond the range)."""
        return reference_neighbours(jnp.asarray(x), *self._grid())

    def reference_forward(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        if not self.needs_key():
            return reference_quantize(x, *self._grid())
        assert key is not None
        bits = reference_random_bits(key, jnp.shape(x))
        return reference_stochastic_quantize(x, *self._grid(), bits)

    def reference_derivative(
        self, x: Array, *, key: PRNGKeyArray | None = None
    ) -> Array:
        _, lo, hi = self._grid()
        return masked_identity(x, ge(x, lo) & le(x, hi))


class SteQuantize(_Grid):
    r"""Uniform quantisation onto $2^b$ levels from `lo` to `hi`, with the
    straight-through estimator inside the range.

    $$n = 2^b - 1, \qquad
    q = \mathrm{lo} + (\mathrm{hi} - \mathrm{lo}) \cdot
    \frac{\operatorname{round}\!\big(n\,(\operatorname{clip}(x, \mathrm{lo},
    \mathrm{hi}) - \mathrm{lo}) / (\mathrm{hi} - \mathrm{lo})\big)}{n}, \qquad
    \dot q = t \cdot [\mathrm{lo} \le x \le \mathrm{hi}]$$

    **Exact, and as fast as the formula.** The level index is the one nearest the
    exact input (computed as if in exact arithmetic), ties to the even index, for
    every input of every floating dtype; the value is the exact level
    $\mathrm{lo} + k(\mathrm{hi} - \mathrm{lo})/n$ rounded once to the input's
    dtype. The index is estimated with one float32 multiply-add and corrected with
    one comparison with its threshold. Threshold and level are a few multiply-adds
    on float32 constants that are checked when traced, against the exact values
    (computed with `fractions.Fraction`) of every threshold and level, rounded
    separately or fused: no table, no gather, within 2x the plain formula's time on
    a CPU (section 7 of `benchmarks/RESULTS.md`). A step $2^e$ with $\mathrm{lo}$
    an even number of steps (such as `lo = -2^{b-1}`, `hi = 2^{b-1} - 1`) takes
    `round(clip(x)/2^e)·2^e`, exact as it is. A grid whose constants fail the check
    (some of 13 bits or more) and float64 inputs read the levels from a table (a
    gather, slower on CPUs and TPUs). Subnormal inputs may act as zero (XLA
    flushes them on the CPU; an H200 keeps them).

    **No zero level by default.** $2^b$ levels on the symmetric $[-1, 1]$ are
    $\pm 1/n, \pm 3/n, \dots$: $0$ is the tie between $-1/n$ and $+1/n$ and goes
    to the even index, $+1/n$ (`ste_quantize(0.0)` is $1/255$), while every negative
    input goes to $-1/n$. This default is kept: it is symmetric (1 bit is $\pm 1$,
    the binarised case), and changing it would silently change trained models. For
    the grid of PyTorch's and AQT's signed integers, which holds 0 exactly, take
    `lo = -2^{b-1} s`, `hi = (2^{b-1} - 1) s` for a step $s$.

    **Stochastic rounding** (`rounding="stochastic"`, also for [`DoReFa`][]). The
    rule must then be called with `key=` (without one it is a `TypeError`). Each
    $x$ in $[\mathrm{lo}, \mathrm{hi}]$ goes to one of the two levels around it,
    $L \le x \le U$, with

    $$P(q = U) = \frac{x - L}{U - L} + \delta, \qquad
    \lvert \delta \rvert < 2^{-22}$$

    for the exact input and the exact levels (each then rounded once to the
    input's dtype, as with rounding to nearest). The resolution is 24 random bits
    per element: with $L_k$ the level nearest $x$ (ties to even) and
    $g = (x - L_k)/s$ its signed distance from it in steps $s$, element $i$ steps
    to the neighbour on $g$'s side iff $2 j_i + 1 < 2^{25} \lvert g \rvert$, with
    $j_i$ the top 24 bits of the word $w_i$ that [`FloatQuantize`][] documents
    (a counter-based hash of element $i$'s index, seeded from `key`): with
    probability within $2^{-25}$ of $\lvert g \rvert$, and never within
    $2^{-25}$ of a step from $L_k$. $g$ is computed in float32 from the level
    written as exact *tiers* (split with TwoSum) to within about
    $2^{-22.4} \lvert g \rvert + 2^{-28}$, a bound proved for the grid when it
    is traced, from its constants and `fractions.Fraction` (`_stochastic`); so
    $\lvert \delta \rvert$ is at most about $2^{-23}$ (exactly at most
    $2^{-25}$ on a dyadic grid), and no level other than the two neighbours is
    ever taken. **A level stays**: an input equal to a level's value in its own
    dtype (the exact level rounded once, e.g. `1/255` rounded to float32 or
    bfloat16) is that level with probability 1, although the exact level may
    differ from it by half an ulp (where levels are finer than the dtype, as for
    bfloat16 inputs on a 16-bit grid, every input may be such a level: its mean is
    then exactly itself). Beyond $[\mathrm{lo}, \mathrm{hi}]$ the value
    saturates to the end levels, NaN stays NaN, and the derivative is the same.
    The same key gives the same draw, eagerly, under `jit` and under `vmap`;
    different keys give independent draws. Grids whose levels near float32's
    underflow (steps below about $10^{-27}$) cannot be rounded stochastically
    (a `ValueError`).

    **Arguments:**

    - `bits`: an integer $1 \le b \le 16$.
    - `lo`, `hi`: the lowest and highest level, finite, `lo < hi`, with steps
        $(\mathrm{hi} - \mathrm{lo})/n$ that float32 resolves (a `ValueError`
        otherwise, for grids finer than a few float32 steps of
        $\max(\lvert\mathrm{lo}\rvert, \lvert\mathrm{hi}\rvert)$).
    - `rounding`: `"nearest"` (ties to the even index) or `"stochastic"` (above).

    At call: `key`, a PRNG key, needed only with `rounding="stochastic"`.

    !!! Example

        ```python
        eqxrules.ste_quantize(jnp.array([-2.0, 0.1, 0.4]), bits=2)  # [-1, 1/3, 1/3]
        ```
    """

    bits: int = hyperparameter(8, at_least(1, integer), _AT_MOST_16, positional=True)
    lo: float = hyperparameter(-1.0, finite, positional=True)
    hi: float = hyperparameter(1.0, _RESOLVED, positional=True)
    rounding: str = hyperparameter("nearest", _PROVED)

    summary: ClassVar[str] = (
        "uniform quantisation of clip(x, lo, hi) onto 2^bits levels, to nearest or "
        "unbiased stochastic (`rounding`); derivative `t·[lo <= x <= hi]`"
    )

    def _grid(self) -> tuple[int, float, float]:
        return self.bits, float(self.lo), float(self.hi)

    def slope(self, x: Array) -> Array:
        return within(x, self.lo, self.hi)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[SteQuantize]:
        return [
            cls(),
            cls(bits=2, lo=-0.5, hi=1.5),
            cls(bits=4, lo=-0.3, hi=0.7, rounding="stochastic"),
        ]


class DoReFa(_Grid):
    r"""The DoReFa-Net quantiser (Zhou et al., 2016): $2^b$ levels on $[0, 1]$.

    $$n = 2^b - 1, \qquad q = \operatorname{round}(n \operatorname{clip}(x, 0, 1)) / n,
    \qquad \dot q = t \cdot [0 \le x \le 1]$$

    Exact and fast like [`SteQuantize`][] (of which this is the grid $[0, 1]$):
    the nearest level of the exact input, ties to the even index, rounded once;
    subnormal inputs may act as zero. (XLA would turn the division by $n$ into a
    multiplication by $1/n$, more than one ulp off: the level is
    $k s_\mathrm{hi} + k s_\mathrm{lo}$ with the step split in two, checked when
    traced for every $k$; from 13 bits, a table.) With `rounding="stochastic"`
    (and `key=` at call), unbiased stochastic rounding onto the same levels,
    exactly as [`SteQuantize`][]'s.

    **Arguments:**

    - `bits`: an integer $1 \le b \le 16$.
    - `rounding`: `"nearest"` (ties to the even index) or `"stochastic"`.

    !!! Example

        ```python
        eqxrules.dorefa_quantize(jnp.array([-0.5, 0.4, 2.0]))  # [0, 1/3, 1]
        ```
    """

    bits: int = hyperparameter(2, at_least(1, integer), _AT_MOST_16, positional=True)
    rounding: str = hyperparameter("nearest", _PROVED)

    summary: ClassVar[str] = (
        "round(clip(x, 0, 1)·n)/n with n = 2^bits − 1, or unbiased stochastic "
        "(`rounding`); derivative `t·[0 <= x <= 1]`"
    )
    domain: ClassVar[Domain] = Domain(low=-1.0, high=2.0)
    functional_name: ClassVar[str] = "dorefa_quantize"

    def _grid(self) -> tuple[int, float, float]:
        return self.bits, 0.0, 1.0

    def slope(self, x: Array) -> Array:
        return within(x, 0.0, 1.0)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[DoReFa]:
        return [cls(), cls(bits=1), cls(bits=3, rounding="stochastic")]


class StochasticRound(_Elementwise):
    r"""Stochastic rounding to the integers, unbiased, with the identity derivative.
    Called as `m(x, key=key)` (functional form `stochastic_round(x, key)`).

    $$q = \operatorname{sign}(x)\,\big(\lfloor \lvert x \rvert \rfloor + [\,j <
    2^{24} f\,]\big), \quad f = \lvert x \rvert - \lfloor \lvert x \rvert
    \rfloor, \qquad \dot q = t$$

    with $j$ the top 24 bits of one uint32 word per element, the counter-based
    draw of the float formats' stochastic rounding (see [`FloatQuantize`][]). $f$ is exact (in float32 for float32, bfloat16 and
    float16 inputs, in float64 for float64), and so is the comparison, so
    $\lvert q \rvert$ rounds up with probability exactly
    $\lceil 2^{24} f \rceil / 2^{24}$:

    $$\mathbb{E}[q] = x + \operatorname{sign}(x)\,\delta, \qquad
    0 \le \delta < 2^{-24},$$

    and $\delta = 0$ where $2^{24} f$ is an integer (for float32, wherever
    $\lvert x \rvert \ge 1/2$). The magnitude is rounded and the sign put
    back, because $x - \lfloor x \rfloor$ is not exact for a negative $x$ near 0
    (for $x = -2^{-30}$ it rounds to 1). An integer $x$ stays $x$ with
    probability 1, $\pm\infty$ stays, NaN stays NaN. Computed in at least
    float32 and cast to the input's dtype. The same key gives the same draw,
    eagerly and under `jit`; different keys give independent draws.

    (eqxrules 0.2.0 computed $\lfloor x + u \rfloor$, $u \sim U[0, 1)$ in
    float32, which is biased where $x + u$ rounds: at $x = 2^{21} + 0.25$ its mean
    was $0.375$ above $\lfloor x \rfloor$. A given key now gives other draws.)

    **Arguments:** none. At call: `key`, a PRNG key.

    !!! Example

        ```python
        q = eqxrules.stochastic_round(jnp.full(1000, 0.25), jax.random.key(0))
        q.mean()  # about 0.25
        ```
    """

    summary: ClassVar[str] = (
        "sign(x)·(floor|x| + [j < 2^24 frac|x|]), j 24 random bits (so E[q] = x within "
        "2^-24); derivative `t`"
    )

    def kinks(self) -> tuple[float, ...]:
        return (-1.0, 0.0, 1.0)

    def primal(
        self, x: Float[Array, "*shape"], *, key: PRNGKeyArray
    ) -> Float[Array, "*shape"]:
        return self._with_bits(x, random_bits(key, jnp.shape(x)))

    def _with_bits(self, x: Array, bits: Array, resolution: int = RESOLUTION) -> Array:
        """The value, rounding with the uint32 `bits` (one per element of `x`). (A
        `resolution` other than `RESOLUTION` is for tests that count every `j`.)"""
        w = x.astype(wide(x.dtype))
        a = stochastic_floor(jnp.abs(w), bits, resolution)
        return jnp.copysign(a, w).astype(x.dtype)

    def neighbours(self, x: Array) -> tuple[Array, Array]:
        """The two values each element of `x` may take, lower first: `floor(x)` and
        `ceil(x)` (both `x` for an integer)."""
        return jnp.floor(x), jnp.ceil(x)

    def slope(self, x: Array) -> None:
        return None

    def reference_forward(self, x: Array, *, key: PRNGKeyArray) -> Array:
        # Independently: the magnitude's lower integer from `ceil`, and the uniform
        # `u = j / 2^24` (exact) against the fraction.
        w = x.astype(wide(x.dtype))
        a = jnp.abs(w)
        c = jnp.ceil(a)
        lower = jnp.where(c == a, c, c - 1)
        j = reference_random_bits(key, jnp.shape(x)) >> (32 - RESOLUTION)
        u = j.astype(jnp.float32) * 2.0**-RESOLUTION
        q = jnp.where(u < a - lower, lower + 1, lower)
        return jnp.where(w < 0, -q, q).astype(x.dtype)

    def reference_derivative(self, x: Array, *, key: PRNGKeyArray) -> Array:
        return x
