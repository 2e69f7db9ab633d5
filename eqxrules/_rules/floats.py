r"""Float quantisers: the FP8, FP6 and FP4 element formats, and the block-scaled MX
and NVFP4 formats built on them, with straight-through derivatives. (Notation: see
`_elementwise`.)

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

from .._catalogue import Domain, JVPRule, check_axis, check_float_array
from .._hyper import (
    Check,
    at_least,
    axis_index,
    hyperparameter,
    integer,
    one_of,
    positive,
)
from ._elementwise import _Elementwise, masked_identity
from ._formats import (
    FORMAT_NAMES,
    FORMATS,
    divide,
    exponent,
    extremes,
    pow2,
    random_bits,
    reference_round_to,
    reference_round_with,
    round_to,
    round_with,
    ties,
)

_string = Check("be a string", lambda v, _: isinstance(v, str), TypeError, (3, None))
element_format = Check(
    f"be one of the formats {FORMAT_NAMES!r}",
    lambda v, _: v in FORMAT_NAMES,
    bad=("e4m4", "E4M3"),
    after=(_string,),
)
rounding_mode = dataclasses.replace(one_of("nearest", "stochastic"), after=(_string,))
_F32 = jnp.float32


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
    """The references' bits, drawn as documented (not by `_bits`)."""
    if rule.rounding == "nearest":
        return None
    return jax.random.bits(_key(rule, key), jnp.shape(x), jnp.uint32)


def fixed(value: int, why: str) -> Check:
    """A hyperparameter that a format fixes: declared so that the rule takes it
    like its kin (`NVFP4Quantize(block_size=16)`, as `MXQuantize(block_size=32)`),
    and any other value is a `ValueError` that says why, rather than Python's
    "unexpected keyword argument"."""
    return Check(
        f"be {value!r} ({why})",
        lambda v, _: v == value,
        bad=(value * 2,),
        after=(integer,),
    )


class FloatQuantize(_Elementwise):
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
    $j_i < 2^{24} f$, with $j_i$ the top 24 bits of
    `jax.random.bits(key, x.shape, jnp.uint32)[i]`, compared exactly in float32.
    $2^{24} f$ is an integer, so $\delta = 0$, for every $\lvert u \rvert$ of at
    least half the format's smallest subnormal; below that $q$ is 0 or that
    subnormal. A value of the format ($f = 0$) stays itself with probability 1,
    beyond $\pm M$ the value saturates to $\pm sM$, and NaN stays NaN. The
    statement is about $u$: it is $x/s$ rounded once to float32 (exact where $s$ is
    a power of two), and $sL$, $sU$ are rounded to the output's dtype as with
    rounding to nearest. The same key gives the same draw, eagerly and under
    `jit`; different keys give independent draws. The derivative is the same.

    | `format` | dtype semantics | largest value $M$ | smallest subnormal |
    |---|---|---|---|
    | `"e4m3"` | `float8_e4m3fn` | 448 | $2^{-9}$ |
    | `"e5m2"` | `float8_e5m2` | 57344 | $2^{-16}$ |
    | `"e3m2"` | `float6_e3m2fn` | 28 | $2^{-4}$ |
    | `"e2m3"` | `float6_e2m3fn` | 7.5 | $2^{-3}$ |
    | `"e2m1"` | `float4_e2m1fn` | 6 | $2^{-1}$ |

    **Arguments:**

    - `format`: the element format, by its OCP name (above).
    - `scale`: $s$, finite and positive.
    - `rounding`: `"nearest"` (ties to even) or `"stochastic"` (above).

    At call: `key`, a PRNG key, needed only with `rounding="stochastic"`.

    !!! Example

        ```python
        eqxrules.float_quantize(jnp.array([0.3, 1.3, 7.0]), format="e2m1")
        # [0.5, 1.5, 6.0]
        ```
    """

    format: str = hyperparameter("e4m3", element_format)
    scale: float = hyperparameter(1.0, positive)
    rounding: str = hyperparameter("nearest", rounding_mode)

    summary: ClassVar[str] = (
        "scale·round_fmt(clip(x/scale, ±max)) to FP8/FP6/FP4 (e4m3, e5m2, e3m2, "
        "e2m3, e2m1), ties to even or unbiased stochastic (`rounding`); "
        "derivative `t·[|x/scale| <= max]`"
    )

    def needs_key(self) -> bool:
        """`True` with `rounding="stochastic"`: then called with `key=`."""
        return self.rounding == "stochastic"

    def _fmt_and_u(self, x: Array) -> tuple[Any, Array]:
        w = x.astype(_F32)
        scale = float(self.scale)
        return FORMATS[self.format], (w if scale == 1 else divide(w, scale))

    def kinks(self) -> tuple[float, ...]:
        fmt, s = FORMATS[self.format], float(self.scale)
        near_one = 1 + 2.0 ** -(fmt.mbits + 1)
        return tuple(s * v for m in (fmt.max, near_one, *ties(fmt)) for v in (-m, m))

    def input_domain(self) -> Domain:
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
        fmt, u = self._fmt_and_u(x)
        # Clipping selects with the mask, so XLA computes the mask once, in the
        # forward pass, and keeps that boolean for the backward pass. (Written as
        # two comparisons: with `abs(u) <= max` XLA recomputed the mask in the
        # backward pass from `u`, keeping the float alive: 1.37x the temp bytes of
        # the `stop_gradient` trick in the quantised MLP.)
        inside = self.slope(x)
        q = round_with(fmt, jnp.where(inside, u, jnp.clip(u, -fmt.max, fmt.max)), bits)
        scale = float(self.scale)
        return (q if scale == 1 else q * scale).astype(x.dtype)

    def slope(self, x: Array) -> Array:
        fmt, u = self._fmt_and_u(x)
        return (u >= -fmt.max) & (u <= fmt.max)

    def reference_forward(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        return self._reference(x, _reference_bits(self, x, key))

    def _reference(self, x: Array, bits: Array | None) -> Array:
        fmt = FORMATS[self.format]
        u = divide(x.astype(_F32), float(self.scale))
        big = jnp.where(u > 0, fmt.max, -fmt.max).astype(_F32)
        y = jnp.where(jnp.abs(u) > fmt.max, big, u)
        q = reference_round_with(fmt, y, bits)
        return (q * float(self.scale)).astype(x.dtype)

    def neighbours(self, x: Array) -> tuple[Array, Array]:
        """The two values each element of `x` may take with `rounding="stochastic"`,
        lower first (see `extremes`; both the saturated value beyond the range)."""
        return extremes(self._reference, jnp.asarray(x))

    def reference_derivative(
        self, x: Array, *, key: PRNGKeyArray | None = None
    ) -> Array:
        u = divide(x.astype(_F32), float(self.scale))
        return masked_identity(x, ~(jnp.abs(u) > FORMATS[self.format].max) & (u == u))

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[FloatQuantize]:
        return [
            cls(),
            cls(format="e2m1", scale=0.25),
            cls(format="e3m2", scale=3.0),
            cls(format="e4m3", scale=3.0, rounding="stochastic"),
        ]


def _to_blocks(x: Array, axis: int, size: int) -> Array:
    """`x` with `axis` moved last and split into blocks of `size`: shape
    `(..., n // size, size)`."""
    x = jnp.moveaxis(x, axis, -1)
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


def _from_blocks(b: Array, axis: int, like: Array) -> Array:
    moved = jnp.moveaxis(like, axis, -1).shape
    return jnp.moveaxis(b.reshape(moved), -1, axis)


class _Blocked(JVPRule):
    """A quantiser on blocks of `block_size` consecutive elements along `axis` (each
    subclass's fields): not elementwise (it takes one floating-point array whose
    `axis` the block divides), with the straight-through derivative, the scales
    held fixed."""

    elementwise: ClassVar[bool] = False
    domain: ClassVar[Domain] = Domain(shape=(4, 32))

    def _check_call(self, args: tuple[Any, ...]) -> None:
        check_float_array(self.rule_name(), args)
        axis = getattr(self, "axis")
        shape = tuple(jnp.shape(args[0]))
        check_axis(self.rule_name(), axis, shape, "x")
        self.check_length(shape[axis], axis, f"`x` (shape {shape})")

    def check_length(self, length: int, axis: int, where: str) -> None:
        """A `ValueError` naming the rule, the block, `axis` and `where` unless the
        block divides `length`."""
        size = getattr(self, "block_size")
        if length % size:
            raise ValueError(
                f"`{self.rule_name()}`: `block_size` (={size}) must divide the length of the "
                f"blocked axis, axis {axis} of {where}, whose length is {length}."
            )

    def for_reduction_axis(self, axis: int, length: int, where: str) -> _Blocked:
        """This quantiser with its blocks along `axis` (of length `length`, in
        `where`): how `Quantized` puts weight and input blocks along a layer's
        reduction dimension."""
        self.check_length(length, axis, where)
        return dataclasses.replace(self, axis=axis)  # pyright: ignore[reportCallIssue]

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        **kwargs: Any,
    ) -> Any:
        (t,) = t_args
        return t

    def reference_derivative(
        self, x: Array, *, key: PRNGKeyArray | None = None
    ) -> Array:
        return x

    def needs_key(self) -> bool:
        """`True` with `rounding="stochastic"`: then called with `key=`."""
        return getattr(self, "rounding") == "stochastic"

    def primal(
        self, x: Float[Array, "*shape"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*shape"]:
        return self._with_bits(x, _bits(self, x, key))

    def _with_bits(self, x: Array, bits: Array | None) -> Array:
        """The value, rounding the elements stochastically with `bits` (one uint32
        per element of `x`), or to nearest where `bits` is `None`."""
        raise NotImplementedError

    def reference_forward(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        return self._reference(x, _reference_bits(self, x, key))

    def _reference(self, x: Array, bits: Array | None) -> Array:
        """The reference value, rounding as `_with_bits` does."""
        raise NotImplementedError

    def neighbours(self, x: Array) -> tuple[Array, Array]:
        """The two values each element of `x` may take with `rounding="stochastic"`,
        lower first (see `extremes`), with the scales of rounding to nearest."""
        return extremes(self._reference, jnp.asarray(x))


class MXQuantize(_Blocked):
    r"""Microscaling (OCP MX v1.0) fake quantisation: MXFP8, MXFP6 or MXFP4, with
    the straight-through estimator. Blocks of `block_size` consecutive elements
    along `axis` share a power-of-two scale (E8M0).

    For a block $b$ with $a = \max_i \lvert b_i \rvert$ and $e_\max$ the element
    format's largest exponent (8, 15, 4, 2, 2 for e4m3, e5m2, e3m2, e2m3, e2m1):

    $$X = \operatorname{clip}\big(2^{\lfloor \log_2 a \rfloor - e_\max},\,
    2^{-127},\, 2^{127}\big), \qquad
    q_i = X \cdot \operatorname{round}_{\mathrm{fmt}}\!\big(
    \operatorname{clip}(b_i / X, -M, M)\big), \qquad \dot q = t$$

    An all-zero block stays zero (with its signs). A NaN or $\pm\infty$ in a block
    makes that whole block NaN (the spec's NaN scale) and leaves the other blocks
    alone. The derivative is straight-through, the scales held fixed (no gradient
    through $a$), as torchao's MX QAT does. Computed in float32; the output has
    the input's dtype. Not elementwise: the length of `axis` must be a multiple of
    `block_size` (else a `ValueError`). XLA flushes float32 subnormals on CPU and
    GPU, so in a block whose largest magnitude is below about $2^{-100}$ a result
    that would be subnormal may be a zero of its sign.

    In [`Quantized`][] and [`quantize`][], blocks run along the layer's reduction
    (input) dimension, whatever `axis` says: the input axis of a `Linear` weight
    and the input-channel axis of a `Conv` weight, and the feature (channel) axis
    of the layer's input, as MX hardware expects.

    **Arguments:**

    - `format`: the element format: `"e4m3"` or `"e5m2"` (MXFP8), `"e3m2"` or
        `"e2m3"` (MXFP6), `"e2m1"` (MXFP4).
    - `block_size`: elements per block, a positive integer (32 in the spec).
    - `axis`: the axis the blocks run along.
    - `rounding`: `"nearest"` (ties to even) or `"stochastic"`: each $b_i / X$
        rounded stochastically as in [`FloatQuantize`][] (unbiased, 24 random
        bits, `key=` needed at call); the scales $X$ are those of rounding to
        nearest.

    !!! Example

        ```python
        x = jnp.linspace(-1.0, 1.0, 64).reshape(2, 32)
        eqxrules.mx_quantize(x)  # MXFP4: each row one block, 15 levels
        ```
    """

    format: str = hyperparameter("e2m1", element_format)
    block_size: int = hyperparameter(32, at_least(1, integer))
    axis: int = hyperparameter(-1, axis_index)
    rounding: str = hyperparameter("nearest", rounding_mode)

    summary: ClassVar[str] = (
        "OCP MX: blocks of block_size along axis share the scale "
        "X = 2^(floor(log2 amax) − emax); X·round_fmt(clip(x/X)), nearest or "
        "unbiased stochastic (`rounding`); derivative `t`"
    )
    functional_name: ClassVar[str] = "mx_quantize"

    def _with_bits(self, x: Array, bits: Array | None) -> Array:
        fmt = FORMATS[self.format]
        b = _to_blocks(x.astype(_F32), self.axis, self.block_size)
        amax = jnp.max(jnp.abs(b), axis=-1, keepdims=True)
        k = jnp.clip(exponent(amax) - fmt.emax, -127, 127)
        if bits is not None:
            bits = _to_blocks(bits, self.axis, self.block_size)
        q = round_with(fmt, jnp.clip(b * pow2(-k), -fmt.max, fmt.max), bits)
        # `2^k` in two steps: `2^-127` is subnormal, which XLA may flush to zero.
        out = q * pow2(k + 1) * 0.5
        out = jnp.where(jnp.isfinite(amax), out, jnp.nan)
        return _from_blocks(out, self.axis, x).astype(x.dtype)

    def _reference(self, x: Array, bits: Array | None) -> Array:
        fmt = FORMATS[self.format]
        b = _to_blocks(x.astype(_F32), self.axis, self.block_size)
        amax = jnp.max(jnp.abs(b), axis=-1, keepdims=True)
        _, e = jnp.frexp(amax)  # amax = m·2^e with m in [1/2, 1)
        k = jnp.clip(e - 1 - fmt.emax, -127, 127)
        y = jnp.ldexp(b, -k)
        y = jnp.where(y > fmt.max, fmt.max, jnp.where(y < -fmt.max, -fmt.max, y))
        if bits is not None:
            bits = _to_blocks(bits, self.axis, self.block_size)
        out = jnp.ldexp(reference_round_with(fmt, y, bits), k)
        out = jnp.where(jnp.isnan(amax) | (amax == jnp.inf), jnp.nan, out)
        return _from_blocks(out, self.axis, x).astype(x.dtype)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[MXQuantize]:
        return [
            cls(),
            cls(format="e4m3", block_size=4, axis=0),
            cls(format="e3m2", block_size=8, rounding="stochastic"),
        ]


class NVFP4Quantize(_Blocked):
    r"""NVIDIA's NVFP4 fake quantisation: FP4 (e2m1) elements in blocks of 16 along
    `axis`, each block with an FP8 (e4m3) scale, under one float32 scale for the
    whole array; the straight-through estimator.

    With $A = \max \lvert x \rvert$ over the whole array and, for each block $b$,
    $a = \max_i \lvert b_i \rvert$:

    $$t = \frac{A}{448 \cdot 6}, \qquad
    s = \operatorname{round}_{\mathrm{e4m3}}\!\Big(\frac{a / 6}{t}\Big), \qquad
    d = t \cdot s, \qquad
    q_i = d \cdot \operatorname{round}_{\mathrm{e2m1}}\!\big(
    \operatorname{clip}(b_i / d, -6, 6)\big), \qquad \dot q = t$$

    each operation rounded to float32. A block whose scale $s$ is 0 (all zero, or
    $a / 6 / t \le 2^{-10}$, below half e4m3's smallest subnormal) gives zeros. A
    NaN or $\pm\infty$ anywhere makes the whole output NaN (the tensor scale is not
    finite). The derivative is straight-through, the scales held fixed (no
    gradient through $A$ or $a$), as torchao's NVFP4 QAT does. Computed in
    float32; the output has the input's dtype. Not elementwise: the length of
    `axis` must be a multiple of 16 (else a `ValueError`). In [`Quantized`][] the
    blocks run along the layer's reduction dimension, as for [`MXQuantize`][].

    **Arguments:**

    - `block_size`: 16, fixed by the format (any other value is a `ValueError`;
        declared so that NVFP4 is built like [`MXQuantize`][]).
    - `axis`: the axis the blocks run along.
    - `rounding`: `"nearest"` (ties to even) or `"stochastic"`: each $b_i / d$
        rounded stochastically as in [`FloatQuantize`][] (unbiased, 24 random
        bits, `key=` needed at call), as NVIDIA's recipe rounds gradients; the
        scales $t$ and $d$ are those of rounding to nearest.

    !!! Example

        ```python
        x = jnp.linspace(-1.0, 1.0, 32).reshape(2, 16)
        eqxrules.nvfp4_quantize(x)
        ```
    """

    block_size: int = hyperparameter(16, fixed(16, "the NVFP4 format fixes it"))
    axis: int = hyperparameter(-1, axis_index)
    rounding: str = hyperparameter("nearest", rounding_mode)

    summary: ClassVar[str] = (
        "NVFP4: t = amax(x)/(448·6), per block of 16 along axis s = round_e4m3("
        "amax_block/6/t), d = t·s, d·round_e2m1(clip(x/d, ±6)), nearest or "
        "unbiased stochastic (`rounding`); derivative `t`"
    )
    functional_name: ClassVar[str] = "nvfp4_quantize"

    def _with_bits(self, x: Array, bits: Array | None) -> Array:
        e4m3, e2m1 = FORMATS["e4m3"], FORMATS["e2m1"]
        w = x.astype(_F32)
        t = divide(jnp.max(jnp.abs(w), initial=0.0), 448.0 * 6)
        b = _to_blocks(w, self.axis, self.block_size)
        a = jnp.max(jnp.abs(b), axis=-1, keepdims=True)
        s = round_to(e4m3, jnp.clip(divide(divide(a, 6.0), t), 0.0, 448.0))
        d = t * s
        if bits is not None:
            bits = _to_blocks(bits, self.axis, self.block_size)
        q = round_with(e2m1, jnp.clip(divide(b, d), -6.0, 6.0), bits) * d
        q = jnp.where(s > 0, q, b * 0)
        q = jnp.where(jnp.isfinite(t), q, jnp.nan)
        return _from_blocks(q, self.axis, x).astype(x.dtype)

    def _reference(self, x: Array, bits: Array | None) -> Array:
        e4m3, e2m1 = FORMATS["e4m3"], FORMATS["e2m1"]
        w = x.astype(_F32)
        b = _to_blocks(w, self.axis, 16)
        A = jnp.max(jnp.abs(b), axis=(-2, -1), keepdims=True)
        A = jnp.max(A, axis=tuple(range(A.ndim - 2)), keepdims=True, initial=0.0)
        t = divide(A, 2688.0)
        a = jnp.max(jnp.abs(b), axis=-1, keepdims=True)
        r = divide(divide(a, 6.0), t)
        s = reference_round_to(e4m3, jnp.where(r > 448.0, 448.0, r))
        d = t * s
        y = divide(b, d)
        y = jnp.where(y > 6.0, 6.0, jnp.where(y < -6.0, -6.0, y))
        if bits is not None:
            bits = _to_blocks(bits, self.axis, 16)
        live = s > 0  # false where s is 0, or NaN (an all-zero array: t = 0)
        q = reference_round_with(e2m1, y, bits) * d
        out = jnp.where(live, q, jnp.zeros_like(b) * b)
        out = jnp.where(jnp.isnan(t) | (t == jnp.inf), jnp.nan, out)
        return _from_blocks(out, self.axis, x).astype(x.dtype)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[NVFP4Quantize]:
        return [cls(), cls(rounding="stochastic")]
