r"""Quantisers: rounding onto levels forward, the straight-through estimator
backward. Values are computed in at least float32 and cast to the input's dtype;
`round` goes half to even. (Notation: see `_elementwise`.)"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import jax
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
from ._paths import quantize


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


class SteQuantize(_Elementwise):
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
    flushes them on CPU and GPU).

    **No zero level by default.** $2^b$ levels on the symmetric $[-1, 1]$ are
    $\pm 1/n, \pm 3/n, \dots$: $0$ is the tie between $-1/n$ and $+1/n$ and goes
    to the even index, $+1/n$ (`ste_quantize(0.0)` is $1/255$), while every negative
    input goes to $-1/n$. This default is kept: it is symmetric (1 bit is $\pm 1$,
    the binarised case), and changing it would silently change trained models. For
    the grid of PyTorch's and AQT's signed integers, which holds 0 exactly, take
    `lo = -2^{b-1} s`, `hi = (2^{b-1} - 1) s` for a step $s$.

    **Arguments:**

    - `bits`: an integer $1 \le b \le 16$.
    - `lo`, `hi`: the lowest and highest level, finite, `lo < hi`, with steps
        $(\mathrm{hi} - \mathrm{lo})/n$ that float32 resolves (a `ValueError`
        otherwise, for grids finer than a few float32 steps of
        $\max(\lvert\mathrm{lo}\rvert, \lvert\mathrm{hi}\rvert)$).

    !!! Example

        ```python
        eqxrules.ste_quantize(jnp.array([-2.0, 0.1, 0.4]), bits=2)  # [-1, 1/3, 1/3]
        ```
    """

    bits: int = hyperparameter(8, at_least(1, integer), _AT_MOST_16, positional=True)
    lo: float = hyperparameter(-1.0, finite, positional=True)
    hi: float = hyperparameter(1.0, _RESOLVED, positional=True)

    summary: ClassVar[str] = (
        "uniform quantisation of clip(x, lo, hi) onto 2^bits levels; derivative "
        "`t·[lo <= x <= hi]`"
    )

    def kinks(self) -> tuple[float, ...]:
        return _quantizer_kinks(self.bits, self.lo, self.hi)

    def primal(self, x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        return quantize(x, self.bits, self.lo, self.hi, self.slope(x))

    def slope(self, x: Array) -> Array:
        return within(x, self.lo, self.hi)

    def reference_forward(self, x: Array) -> Array:
        return reference_quantize(x, self.bits, self.lo, self.hi)

    def reference_derivative(self, x: Array) -> Array:
        return masked_identity(x, ge(x, self.lo) & le(x, self.hi))

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[SteQuantize]:
        return [cls(), cls(bits=2, lo=-0.5, hi=1.5)]


class DoReFa(_Elementwise):
    r"""The DoReFa-Net quantiser (Zhou et al., 2016): $2^b$ levels on $[0, 1]$.

    $$n = 2^b - 1, \qquad q = \operatorname{round}(n \operatorname{clip}(x, 0, 1)) / n,
    \qquad \dot q = t \cdot [0 \le x \le 1]$$

    Exact and fast like [`SteQuantize`][] (of which this is the grid $[0, 1]$):
    the nearest level of the exact input, ties to the even index, rounded once;
    subnormal inputs may act as zero. (XLA would turn the division by $n$ into a
    multiplication by $1/n$, more than one ulp off: the level is
    $k s_\mathrm{hi} + k s_\mathrm{lo}$ with the step split in two, checked when
    traced for every $k$; from 13 bits, a table.)

    **Arguments:**

    - `bits`: an integer $1 \le b \le 16$.

    !!! Example

        ```python
        eqxrules.dorefa_quantize(jnp.array([-0.5, 0.4, 2.0]))  # [0, 1/3, 1]
        ```
    """

    bits: int = hyperparameter(2, at_least(1, integer), _AT_MOST_16, positional=True)

    summary: ClassVar[str] = (
        "round(clip(x, 0, 1)·n)/n with n = 2^bits − 1; derivative `t·[0 <= x <= 1]`"
    )
    domain: ClassVar[Domain] = Domain(low=-1.0, high=2.0)
    functional_name: ClassVar[str] = "dorefa_quantize"

    def kinks(self) -> tuple[float, ...]:
        return _quantizer_kinks(self.bits, 0.0, 1.0)

    def primal(self, x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        return quantize(x, self.bits, 0.0, 1.0, self.slope(x))

    def slope(self, x: Array) -> Array:
        return within(x, 0.0, 1.0)

    def reference_forward(self, x: Array) -> Array:
        return reference_quantize(x, self.bits, 0.0, 1.0)

    def reference_derivative(self, x: Array) -> Array:
        return masked_identity(x, ge(x, 0.0) & le(x, 1.0))

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[DoReFa]:
        return [cls(), cls(bits=1)]


class StochasticRound(_Elementwise):
    r"""Stochastic rounding, unbiased, with the identity derivative. Called as
    `m(x, key=key)`.

    $$q = \lfloor x + u \rfloor,\ u \sim U[0, 1), \qquad
    \mathbb{E}[q] = x, \qquad \dot q = t$$

    The value is computed in at least float32 and cast to the input's dtype.

    **Arguments:** none. At call: `key`, a PRNG key.

    !!! Example

        ```python
        q = eqxrules.stochastic_round(jnp.full(1000, 0.25), jax.random.key(0))
        q.mean()  # about 0.25
        ```
    """

    summary: ClassVar[str] = "floor(x + u), u ~ U[0, 1) (so E[q] = x); derivative `t`"

    def kinks(self) -> tuple[float, ...]:
        return (-1.0, 0.0, 1.0)

    def primal(
        self, x: Float[Array, "*shape"], *, key: PRNGKeyArray
    ) -> Float[Array, "*shape"]:
        w = wide(x.dtype)
        u = jax.random.uniform(key, x.shape, w)
        return jnp.floor(x.astype(w) + u).astype(x.dtype)

    def slope(self, x: Array) -> None:
        return None

    def reference_forward(self, x: Array, *, key: PRNGKeyArray) -> Array:
        w = wide(x.dtype)
        v = x.astype(w) + jax.random.uniform(key, x.shape, w)
        c = jnp.ceil(v)
        return jnp.where(c == v, c, c - 1).astype(x.dtype)

    def reference_derivative(self, x: Array, *, key: PRNGKeyArray) -> Array:
        return x
