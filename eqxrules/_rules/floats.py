r"""Float quantisers: rounding to the FP8, FP6 and FP4 element formats, scaled, with
straight-through derivatives, to nearest or stochastically; and what the
block-scaled formats (`blocks`) share with them. (Notation: see `_elementwise`.)

Values are computed in float32 and cast to the input's dtype; formats are rounded
arithmetically (see `_formats`), never by casting to their dtypes. XLA flushes
float32 subnormals to zero on CPU and GPU, so a subnormal input, or a result that
would be subnormal in float32 (only possible in blocks whose largest magnitude is
below about $2^{-100}$), may come out as a zero of the same sign."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._axis_names import axis_names, check_bound
from .._catalogue import Domain
from .._hyper import (
    Check,
    axis_index,
    hyperparameter,
    integer,
    positive,
    real,
)
from ._elementwise import _Elementwise, masked_identity
from ._encoded import Encoded, LowPrecision, code_dtype
from ._formats import (
    FORMAT_NAMES,
    FORMATS,
    amax,
    divide,
    extremes,
    random_bits,
    reference_amax,
    reference_random_bits,
    reference_round_with,
    round_with,
    ties,
)
from ._rounding import Rounded, rounding_mode

_string = Check("be a string", lambda v, _: isinstance(v, str), TypeError, (3, None))
element_format = Check(
    f"be one of the formats {FORMAT_NAMES!r}",
    lambda v, _: v in FORMAT_NAMES,
    bad=("e4m4", "E4M3"),
    after=(_string,),
)
_real_or_amax = Check(
    'be a real number or "amax"',
    lambda v, m: v == "amax" or real.holds(v, m),
    TypeError,
    ("2", True),
)
scale_or_amax = Check(
    'be finite and positive, or "amax"',
    lambda v, m: v == "amax" or positive.holds(v, m),
    bad=(0.0, -1.0, float("nan"), float("inf")),
    after=(_real_or_amax,),
)
pair_of_axes = Check(
    "be an int, or a pair of ints (square blocks over both axes)",
    lambda v, m: (
        axis_index.holds(v, m)
        or (
            isinstance(v, tuple) and len(v) == 2 and all(integer.holds(a, m) for a in v)
        )
    ),
    TypeError,
    (1.5, (0,), (0, 1, 2), (0, "1")),
)
_F32 = jnp.float32
_SMALLEST_NORMAL = 2.0**-126


def _key(rule: Any, key: PRNGKeyArray | None) -> PRNGKeyArray:
    # The rule's call has checked it (`needs_key`); here for `primal` called bare.
    if key is None:
        raise TypeError(f"`{rule.rule_name()}` needs a PRNG key (`key=`).")
    return key


def _bits(rule: Any, x: Array, key: PRNGKeyArray | None) -> Array | None:
    """The random bits `rule` rounds `x` with (see [`FloatQuantize`][]), or `None`
    to round to nearest."""
    if rule.rounding == "nearest":
        return None
    return random_bits(_key(rule, key), x.shape)


def _reference_bits(rule: Any, x: Array, key: PRNGKeyArray | None) -> Array | None:
    """The references' bits, drawn as documented by `reference_random_bits` (not by
    `_bits`)."""
    if rule.rounding == "nearest":
        return None
    return reference_random_bits(_key(rule, key), jnp.shape(x))


def _unit(s: Array | float) -> bool:
    """Whether the scale is the constant 1 (then no division is traced)."""
    return isinstance(s, float) and s == 1


_only_amax = Check(
    'be None unless `scale` is "amax" (only a scale from the tensor\'s amax '
    "spans named axes)",
    lambda v, m: v is None or m.scale == "amax",
    bad=("batch",),
    after=(axis_names,),
)


def span(amax: Array, axis_name: Any) -> Array:
    """`amax` over the named axes too (`lax.pmax` of a scalar), if any."""
    return amax if axis_name is None else jax.lax.pmax(amax, axis_name)


class FloatQuantize(LowPrecision, Rounded, _Elementwise):
    r"""Rounding to a floating-point element format (FP8, FP6, FP4), scaled, with
    the straight-through estimator inside the format's range.

    $$u = x / s, \qquad
    q = s \cdot \operatorname{round}_{\mathrm{fmt}}\!\big(
    \operatorname{clip}(u, -M, M)\big), \qquad
    \dot q = t \cdot [\lvert u \rvert \le M]$$

    with $s$ = `scale` and $M$ the format's largest value. $u$ is computed in
    float32 (correctly rounded), and $\operatorname{round}_{\mathrm{fmt}}$ rounds to
    the nearest value of the format, ties to the even mantissa, keeping the
    format's subnormals: bit for bit what `ml_dtypes`' cast gives (JAX's
    `float8_e4m3fn`, ...), computed without casting. NaN stays NaN; $\pm\infty$
    saturates to $\pm s M$. The derivative is selected, not multiplied: where
    $\lvert u \rvert > M$ (or $u$ is NaN) it is exactly 0.

    **Stochastic rounding** (`rounding="stochastic"`; also for [`MXQuantize`][]
    and [`NVFP4Quantize`][]). The rule must then be called with `key=` (without
    one it is a `TypeError`). Each $u$ in $[-M, M]$ goes to one of the two values
    of the format around it, $L \le u \le U$, with

    $$P(q = sU) = \frac{\lceil 2^{24} f \rceil}{2^{24}}, \qquad
    f = \frac{u - L}{U - L}, \qquad \text{so} \quad
    \mathbb{E}[\operatorname{round}_{\mathrm{fmt}}(u)] = u + \delta,\
    0 \le \delta < 2^{-24} (U - L)$$

    on the magnitude, the sign put back ($L$, $U$ are the values around
    $\lvert u \rvert$; the same key rounds $-x$ to minus what it rounds $x$ to).
    The resolution is 24 random bits per element: element $i$ rounds up iff
    $j_i < 2^{24} f$, compared exactly in float32, with $j_i$ the top 24 bits of
    the word $w_i = h\big(h(i \oplus s_0) \oplus s_1\big)$ of a counter-based
    generator: $i$ is the element's flat row-major index (at most $2^{32}$
    elements), $(s_0, s_1)$ = `jax.random.bits(key, (2,), jnp.uint32)`, and $h$ is
    Wellons' `lowbias32` hash, $x \mapsto x \oplus (x \gg 16)$, times
    `0x7feb352d`, $\oplus (\gg 15)$, times `0x846ca68b`, $\oplus (\gg 16)$,
    in uint32. $h$ is a bijection, so $w_i$ is exactly uniform over keys (the
    rounding's bias is that of a uniform $j_i$), and on a CPU it costs about a
    tenth of `jax.random.bits(key, x.shape, jnp.uint32)` (threefry).
    $2^{24} f$ is an integer, so $\delta = 0$, for every $\lvert u \rvert$ of at
    least half the format's smallest subnormal; below that $q$ is 0 or that
    subnormal. A value of the format ($f = 0$) stays itself with probability 1,
    beyond $\pm M$ the value saturates to $\pm sM$, and NaN stays NaN. The
    statement is about $u$: it is $x/s$ rounded once to float32 (exact where $s$ is
    a power of two), and $sL$, $sU$ are rounded to the output's dtype as with
    rounding to nearest. The same key gives the same draw, eagerly and under
    `jit`; different keys give independent draws. So under `jax.vmap` with one
    key for every example, each example draws the same bits (element $i$ of
    every example rounds up together): map split keys with the batch
    (`jax.random.split(key, n)`) for independent examples. The derivative is the
    same.

    | `format` | dtype semantics | largest value $M$ | smallest subnormal |
    |---|---|---|---|
    | `"e4m3"` | `float8_e4m3fn` | 448 | $2^{-9}$ |
    | `"e5m2"` | `float8_e5m2` | 57344 | $2^{-16}$ |
    | `"e3m2"` | `float6_e3m2fn` | 28 | $2^{-4}$ |
    | `"e2m3"` | `float6_e2m3fn` | 7.5 | $2^{-3}$ |
    | `"e2m1"` | `float4_e2m1fn` | 6 | $2^{-1}$ |

    **Arguments:**

    - `format`: the element format, by its OCP name (above).
    - `scale`: $s$, finite and positive; or `"amax"`, one scale for the whole
        array from its current largest magnitude $A$ (Transformer Engine's current
        scaling): $s = \max(A / M, 2^{-126})$ in float32, so that the largest
        element goes to $\pm M$ (nothing is clipped but by the rounding of $s$)
        and $s$ is never zero nor subnormal. The derivative is then $t$ everywhere,
        $s$ held fixed. An infinity or NaN anywhere makes the whole output NaN.
    - `rounding`: `"nearest"` (ties to even) or `"stochastic"` (above).
    - `axis_name`: with `scale="amax"`, `None` (the array's own amax) or the
        name (a tuple of names) of mapped axes whose amax the scale spans, as
        `eqx.nn.BatchNorm` takes it: under `jax.vmap(..., axis_name=name)` the
        examples share the batch's scale, under `jax.shard_map` the devices do
        ($A$ is then `lax.pmax` of each one's). An unbound name is a `ValueError`.

    At call: `key`, a PRNG key, needed only with `rounding="stochastic"`.

    !!! Example

        ```python
        eqxrules.float_quantize(jnp.array([0.3, 1.3, 7.0]), format="e2m1")
        # [0.5, 1.5, 6.0]
        ```
    """

    format: str = hyperparameter("e4m3", element_format)
    scale: float | str = hyperparameter(1.0, scale_or_amax)
    rounding: str = hyperparameter("nearest", rounding_mode)
    axis_name: Any = hyperparameter(None, _only_amax, allow_none=True)

    summary: ClassVar[str] = (
        "scale·round_fmt(clip(x/scale, ±max)) to FP8/FP6/FP4 (e4m3, e5m2, e3m2, "
        "e2m3, e2m1), ties to even or unbiased stochastic (`rounding`); "
        "derivative `t·[|x/scale| <= max]`"
    )

    def _check_call(self, args: tuple[Any, ...]) -> None:
        super()._check_call(args)
        check_bound(self.rule_name(), self.axis_name)

    def _scale(self, w: Array) -> Array | float:
        """$s$ for the float32 `w`: `scale`, or with `"amax"` the array's own."""
        if self.scale != "amax":
            return float(self.scale)
        a = span(amax(w), self.axis_name)
        s = jnp.maximum(divide(a, FORMATS[self.format].max), _SMALLEST_NORMAL)
        return jnp.where(jnp.isinf(a), jnp.nan, s)

    def _fmt_and_u(self, x: Array) -> tuple[Any, Array | float, Array]:
        w = x.astype(_F32)
        s = self._scale(w)
        return FORMATS[self.format], s, (w if _unit(s) else divide(w, s))

    def kinks(self) -> tuple[float, ...]:
        if self.scale == "amax":  # the grid moves with the array
            return ()
        fmt, s = FORMATS[self.format], float(self.scale)
        near_one = 1 + 2.0 ** -(fmt.mbits + 1)
        return tuple(s * v for m in (fmt.max, near_one, *ties(fmt)) for v in (-m, m))

    def input_domain(self) -> Domain:
        if self.scale == "amax":  # any range: the scale follows it
            return type(self).domain
        r = 1.25 * FORMATS[self.format].max * float(self.scale)
        return dataclasses.replace(
            type(self).domain, low=-r, high=r, kinks=tuple(self.kinks())
        )

    def primal(
        self, x: Float[Array, "*shape"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*shape"]:
        return self._with_bits(x, _bits(self, x, key))

    def _with_bits(self, x: Array, bits: Array | None) -> Array:
        """The value, rounding stochastically with `bits` (one uint32 per element of
        `x`), or to nearest where `bits` is `None`."""
        return self.decode(self._encode(x, bits), x)

    def encode(self, x: Array, *, key: PRNGKeyArray | None = None) -> Encoded:
        """`Encoded(codes, None, tensor)`: the element codes `round_fmt(x / s)` and
        the tensor scale `s` (`None` when unscaled)."""
        return self._encode(x.astype(_F32), _bits(self, x, key))

    def decode(self, e: Encoded, like: Any) -> Array:
        """`codes · tensor` in `like`'s dtype: this quantiser's value, bit for bit."""
        q = e.codes if e.tensor is None else e.codes * e.tensor
        return q.astype(like.dtype)

    def payload(self, e: Encoded, like: Any) -> tuple[Array, Array | None]:
        """`(codes, tensor)`: codes of at most 8 bits are exact in bfloat16."""
        return e.codes, e.tensor

    def storage(self) -> tuple[Any, Any]:
        """The element format's own dtype (with a NaN), and no block scales."""
        return code_dtype(self.format, nan=True), None  # a NaN stays in its element

    def _encode(self, x: Array, bits: Array | None) -> Encoded:
        fmt, s, u = self._fmt_and_u(x)
        # Clipping selects with the mask, so XLA computes the mask once, in the
        # forward pass, and keeps that boolean for the backward pass. (Written as
        # two comparisons: with `abs(u) <= max` XLA recomputed the mask in the
        # backward pass from `u`, keeping the float alive: 1.37x the temp bytes of
        # the `stop_gradient` trick in the quantised MLP.)
        inside = self.slope(x)
        clipped = jnp.clip(u, -fmt.max, fmt.max)
        q = round_with(
            fmt, clipped if inside is None else jnp.where(inside, u, clipped), bits
        )
        return Encoded(q, None, None if _unit(s) else jnp.asarray(s, _F32))

    def slope(self, x: Array) -> Array | None:
        if self.scale == "amax":
            return None
        fmt, _, u = self._fmt_and_u(x)
        return (u >= -fmt.max) & (u <= fmt.max)

    def reference_forward(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        return self._reference(x, _reference_bits(self, x, key))

    def _reference(self, x: Array, bits: Array | None) -> Array:
        """The reference value, rounding as `_with_bits` does."""
        fmt = FORMATS[self.format]
        w = x.astype(_F32)
        if self.scale == "amax":
            a = span(reference_amax(w), self.axis_name)
            r = divide(a, fmt.max)
            s = jnp.where(a == jnp.inf, jnp.nan, jnp.where(r < 2.0**-126, 2.0**-126, r))
        else:
            s = float(self.scale)
        u = divide(w, s)
        big = jnp.where(u > 0, fmt.max, -fmt.max).astype(_F32)
        y = jnp.where(jnp.abs(u) > fmt.max, big, u)
        q = reference_round_with(fmt, y, bits)
        return (q * s).astype(x.dtype)

    def neighbours(self, x: Array) -> tuple[Array, Array]:
        """The two values each element of `x` may take with `rounding="stochastic"`,
        lower first (see `extremes`; both the saturated value beyond the range)."""
        return extremes(self._reference, jnp.asarray(x))

    def reference_derivative(
        self, x: Array, *, key: PRNGKeyArray | None = None
    ) -> Array:
        if self.scale == "amax":
            return x
        u = divide(x.astype(_F32), float(self.scale))
        return masked_identity(x, ~(jnp.abs(u) > FORMATS[self.format].max) & (u == u))

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[FloatQuantize]:
        return [
            cls(),
            cls(format="e2m1", scale=0.25),
            cls(format="e3m2", scale=3.0),
            cls(format="e4m3", scale=3.0, rounding="stochastic"),
            cls(format="e5m2", scale="amax"),
        ]
