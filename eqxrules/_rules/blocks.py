r"""Block-scaled float quantisers: their protocol (`BlockQuantizer`), the blocked
layout (an axis split in place), and OCP MX (MXFP8, MXFP6, MXFP4): blocks of
consecutive elements along one axis sharing a power-of-two scale, elements in an
FP8/FP6/FP4 format (see `floats`), with straight-through derivatives, the scales
held fixed. NVFP4 is in `nvfp4`, float32 and row scales in `fine_grained`.
(Notation: see `_elementwise`.)"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._axis_names import check_bound
from .._catalogue import Domain, JVPRule
from .._hyper import at_least, axis_index, hyperparameter, integer, one_of
from .._inputs import check_axis, check_float_array
from ._encoded import Encoded, LowPrecision, code_dtype, holds_nan
from ._formats import (
    FORMATS,
    extremes,
    pow2,
    reference_amax,
    reference_round_with,
    round_with,
)
from ._rounding import Rounded, rounding_mode
from .floats import (
    _F32,
    _bits,
    _reference_bits,
    element_format,
)


def _blocked_axes(axis: int | tuple[int, int], ndim: int) -> tuple[int, ...]:
    """The axes that `axis` blocks, non-negative and ascending."""
    return tuple(sorted(a % ndim for a in ((axis,) if isinstance(axis, int) else axis)))


def _to_blocks(x: Array, axis: int | tuple[int, int], size: int) -> Array:
    """`x` with each blocked axis (`axis`, or both of a pair) split in place into
    `(n // size, size)`: a reshape, which moves no data, so that XLA neither
    transposes nor copies the operand of a product. A block's elements run along
    the axes `_within` names (reduce over them, keeping dimensions, for one value
    per block); for two axes a block is `size` x `size` over both.

    Two axes are split by two reshapes, one axis each: JAX's sharding-in-types
    (an explicitly sharded batch under `vmap`) takes a reshape that splits one
    axis, not one that splits two at once; XLA folds them into one."""
    for j, a in enumerate(_blocked_axes(axis, x.ndim)):
        i = a + j  # the axes blocked before `a` each became two
        x = x.reshape(x.shape[:i] + (x.shape[i] // size, size) + x.shape[i + 1 :])
    return x


def _within(axis: int | tuple[int, int], ndim: int) -> tuple[int, ...]:
    """The axes of `_to_blocks(x, axis, size)` (for `x` of `ndim` axes) that run
    within a block."""
    return tuple(a + j + 1 for j, a in enumerate(_blocked_axes(axis, ndim)))


def _from_blocks(b: Array, like: Any) -> Array:
    """The inverse of `_to_blocks` for an array of `like`'s shape (an array or a
    `jax.ShapeDtypeStruct`): the split was in place, so a reshape, merging one
    pair of axes at a time (as `_to_blocks` splits them)."""
    shape = tuple(like.shape)
    for i in range(len(shape)):
        if b.ndim > len(shape) and b.shape[i] != shape[i]:
            b = b.reshape(b.shape[:i] + (shape[i],) + b.shape[i + 2 :])
    # Blocks of one element leave a pair `(n, 1)` that compares equal: one reshape.
    return b if b.shape == shape else b.reshape(shape)


class BlockQuantizer(Rounded, JVPRule):
    r"""The base of block quantisers ([`MXQuantize`][eqxrules.MXQuantize],
    [`NVFP4Quantize`][eqxrules.NVFP4Quantize],
    [`BlockFloatQuantize`][eqxrules.BlockFloatQuantize],
    [`RowFloatQuantize`][eqxrules.RowFloatQuantize], or a user's): the protocol through
    which [`quantize`][eqxrules.quantize], [`Quantized`][eqxrules.Quantized] and the
    quantised products ([`quantized_dot_general`][eqxrules.quantized_dot_general]
    and the rest) put blocks along the dimension a product contracts.

    A subclass has the fields `block_size` (elements per block, an `int`: the
    length a blocked axis must be a multiple of, which the products pad to; 1 for
    [`RowFloatQuantize`][], whose block is the whole row), `axis` (the axis the
    blocks run along, or a pair of axes for square blocks of `block_size` ×
    `block_size`) and `rounding` (`"nearest"` or `"stochastic"`,
    which then needs `key=`), and defines its value (`_with_bits`, given one uint32
    of random bits per element or `None`, and `_reference`). It is not elementwise:
    it takes one floating-point array, whose blocked axes `block_size` divides. Its
    derivative is straight-through, the scales held fixed.

    The products call [`for_reduction_axis`][eqxrules.BlockQuantizer.for_reduction_axis]
    to put the blocks along the contracted dimension; a subclass may override it.
    """

    if TYPE_CHECKING:  # each subclass's own fields, in its own order
        block_size: int
        axis: Any
        rounding: str

    elementwise: ClassVar[bool] = False
    domain: ClassVar[Domain] = Domain(shape=(4, 32))

    def _check_call(self, args: tuple[Any, ...]) -> None:
        check_float_array(self.rule_name(), args)
        axis = getattr(self, "axis")
        shape = tuple(jnp.shape(args[0]))
        check_axis(self.rule_name(), axis, shape, "x")
        axes = (axis,) if isinstance(axis, int) else axis
        if len({a % len(shape) for a in axes}) < len(axes):
            raise ValueError(
                f"`{self.rule_name()}`: `axis` (={axis!r}) must name two different "
                f"axes of `x` (shape {shape})."
            )
        for a in axes:
            self.check_length(shape[a], a, f"`x` (shape {shape})")
        check_bound(self.rule_name(), getattr(self, "axis_name", None))

    def check_length(self, length: int, axis: int, where: str) -> None:
        """A `ValueError` naming the rule, the block, `axis` and `where` unless the
        block divides `length`."""
        size = getattr(self, "block_size")
        if length % size:
            raise ValueError(
                f"`{self.rule_name()}`: `block_size` (={size}) must divide the length of the "
                f"blocked axis, axis {axis} of {where}, whose length is {length}."
            )

    def for_reduction_axis(self, axis: int, length: int, where: str) -> BlockQuantizer:
        """This quantiser with its blocks along `axis` (of length `length`, in
        `where`): how `Quantized` puts weight and input blocks along a layer's
        reduction dimension."""
        self.check_length(length, axis, where)
        if isinstance(getattr(self, "axis"), tuple):  # square blocks: both axes
            return self
        return dataclasses.replace(self, axis=axis)  # pyright: ignore[reportCallIssue]

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        **kwargs: Any,
    ) -> Any:
        """The straight-through tangent `t`: the scales are held fixed."""
        (t,) = t_args
        return t

    def reference_derivative(
        self, x: Array, *, key: PRNGKeyArray | None = None
    ) -> Array:
        """The straight-through derivative's reference: the identity."""
        return x

    def primal(
        self, x: Float[Array, "*shape"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*shape"]:
        """The quantised value of `x` (rounding stochastically with `key`)."""
        return self._with_bits(x, _bits(self, x, key))

    @abc.abstractmethod
    def _with_bits(self, x: Array, bits: Array | None) -> Array:
        """The value, rounding the elements stochastically with `bits` (one uint32
        per element of `x`), or to nearest where `bits` is `None`."""


class _Encoding(BlockQuantizer, LowPrecision):
    """A block quantiser of the float formats whose value is its codes times its
    scales (`_encoded`): the value is `decode(encode(x))`, one definition."""

    @abc.abstractmethod
    def _encode(self, x: Array, bits: Array | None) -> Encoded:
        """The parts of the value, rounding with `bits` as `_with_bits` does."""

    def _with_bits(self, x: Array, bits: Array | None) -> Array:
        return self.decode(self._encode(x, bits), x)

    def encode(self, x: Array, *, key: PRNGKeyArray | None = None) -> Encoded:
        return self._encode(x.astype(_F32), _bits(self, x, key))

    def reference_forward(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        """The reference value, drawing as documented."""
        return self._reference(x, _reference_bits(self, x, key))

    @abc.abstractmethod
    def _reference(self, x: Array, bits: Array | None) -> Array:
        """The reference value, rounding as `_with_bits` does."""

    def neighbours(self, x: Array) -> tuple[Array, Array]:
        """The two values each element of `x` may take with `rounding="stochastic"`,
        lower first (see `extremes`), with the scales of rounding to nearest."""
        return extremes(self._reference, jnp.asarray(x))


_NAN_BLOCK = -128  # an MX block's exponent when the block is NaN

scale_rule = one_of("floor", "ceil")


def _times_pow2(q: Array, k: Array) -> Array:
    r"""$q \cdot 2^k$ for integers `k` in [-127, 127], by two normal powers of two:
    $2^{-127}$ is subnormal, which XLA may flush to zero, and at the top of float32
    a finite $q \cdot 2^k$ must not pass through an infinite $q \cdot 2^{k+1}$."""
    half = k >> 1  # floor(k / 2): an arithmetic shift (`//` is a dozen operations)
    return q * pow2(half) * pow2(k - half)


def _block_peak(b: Array, within: tuple[int, ...]) -> tuple[Array, Array]:
    r"""Each block's largest magnitude $a$ (over the axes `within`, kept), and
    whether the block is finite (no NaN, no infinity).

    Finiteness is read from $\sum_i (b_i - b_i)$, which is $0$ for finite
    elements and NaN as soon as one is NaN or infinite: a sum keeps a NaN
    wherever XLA reduces it, where XLA's CPU `max` of many elements drops one
    (`amax`), and unlike a boolean `any` it is one more vectorised reduction,
    not a scalar loop. $a$ itself is a plain `max`: where a NaN was dropped
    from it the block is not finite, and its $a$ is not used."""
    top = jnp.max(jnp.abs(b), axis=within, keepdims=True, initial=0.0)
    finite = ~jnp.isnan(jnp.sum(b - b, axis=within, keepdims=True))
    return top, finite


def _scale_exponent(top: Array, fmt_name: str, rounding: str) -> Array:
    r"""The block exponent $k$ of a block of largest magnitude `top` ($a \ge 0$;
    clipped to $[-127, 127]$; for a block that is not finite, some $k$ in that
    range, which the caller masks): `"floor"`,
    $\lfloor \log_2 a \rfloor - e_\max$, is $a$'s biased exponent field less
    $127 + e_\max$; `"ceil"`, $\lceil \log_2 (a / M) \rceil$, is the floor's plus
    one where $a$'s significand exceeds $M$'s, which adding
    $2^{23} - 1 - \mathrm{sig}(M)$ to $a$'s bits carries into the exponent
    field exactly then (three integer operations, not seven: XLA computes a
    block's $k$ again for each of its elements)."""
    fmt = FORMATS[fmt_name]
    carry = 0
    if rounding == "ceil":
        carry = 0x7FFFFF - (int(np.float32(fmt.max).view(np.int32)) & 0x7FFFFF)
    bits = jax.lax.bitcast_convert_type(top, jnp.int32)
    k = ((bits + carry) >> 23) - (127 + fmt.emax)
    return jnp.clip(k, -127, 127)


def pow2_encode(
    x: Array,
    fmt_name: str,
    axis: int,
    size: int,
    rounding: str,
    bits: Array | None,
    nan_elements: bool = False,
) -> Encoded:
    r"""The parts of a power-of-two block scaling ([`MXQuantize`][]'s, with
    blocks of `size` along `axis`): codes and each block's exponent $k$, $X = 2^k$,
    by `rounding` (`"floor"`: $\lfloor \log_2 a \rfloor - e_\max$; `"ceil"`:
    $\lceil \log_2 (a / M) \rceil$, which is the floor's exponent plus one where
    the significand of $a$ exceeds that of $M$, exactly); $k$ is $-128$ for a
    block with a NaN or an infinity. Only the floor rule clips $b_i / 2^k$ to
    $\pm M$: under `"ceil"` every finite $\lvert b_i \rvert \le a \le M \cdot 2^k$
    already ($k$ is clipped at $-127$ only where $a < M \cdot 2^{-127}$, and
    never at the top, where $k \le 120$), and a block that is not finite is
    masked.

    With `nan_elements` (`LowPrecision.encode_operand`; codes whose dtype holds a
    NaN), no block is tested: each NaN or infinite element is a NaN code, the
    other elements of its block whatever the exponent of its $a$ (an infinity, a
    NaN, or what a `max` left of a NaN) gives them; every element of every other
    block as without it."""
    b = _to_blocks(x.astype(_F32), axis, size)
    within = _within(axis, x.ndim)
    if bits is not None:
        bits = _to_blocks(bits, axis, size)
    if nan_elements:
        top = jnp.max(jnp.abs(b), axis=within, keepdims=True, initial=0.0)
        k = _scale_exponent(top, fmt_name, rounding)
        q = _scaled_codes(b, k, fmt_name, rounding, bits)
        return Encoded(_nan_elements(b, q), k)
    top, finite = _block_peak(b, within)
    k = _scale_exponent(top, fmt_name, rounding)
    q = _scaled_codes(b, k, fmt_name, rounding, bits)
    # A block with a NaN or an infinity is NaN (the spec's NaN scale): its
    # exponent -128, outside the scales' range [-127, 127].
    return Encoded(jnp.where(finite, q, 0.0), jnp.where(finite, k, _NAN_BLOCK))


def _nan_elements(b: Array, q: Array) -> Array:
    """The codes `q`, NaN at each element of `b` that is NaN or infinite."""
    return jnp.where(jnp.isfinite(b), q, jnp.nan)


def _scaled_codes(
    b: Array, k: Array, fmt_name: str, rounding: str, bits: Array | None
) -> Array:
    r"""The codes of blocks `b` at exponents `k`: $b_i / 2^k$ (clipped to $\pm M$
    under the floor rule) rounded to the format, stochastically with `bits` (in
    `b`'s layout) if given."""
    fmt = FORMATS[fmt_name]
    y = b * pow2(-k)
    if rounding == "floor":  # `"ceil"` puts every finite |y| at most M: no clip
        y = jnp.clip(y, -fmt.max, fmt.max)
    return round_with(fmt, y, bits)


def pow2_decode(e: Encoded, like: Any) -> Array:
    """The value of `pow2_encode`'s parts, in `like`'s shape and dtype."""
    assert e.scales is not None
    k = e.scales
    out = _times_pow2(e.codes, jnp.maximum(k, -127))
    out = jnp.where(k == _NAN_BLOCK, jnp.nan, out)
    return _from_blocks(out, like).astype(like.dtype)


def pow2_reference(
    x: Array, fmt_name: str, axis: int, size: int, rounding: str, bits: Array | None
) -> Array:
    """An independent `pow2_decode(pow2_encode(...))`: the exponent from `frexp`,
    rounded up by a comparison of the scaled amax with $M$."""
    fmt = FORMATS[fmt_name]
    b = _to_blocks(x.astype(_F32), axis, size)
    top = reference_amax(b, axis=_within(axis, x.ndim), keepdims=True)
    _, e = jnp.frexp(top)  # top = m·2^e with m in [1/2, 1)
    k = e - 1 - fmt.emax
    if rounding == "ceil":  # the least k with top / 2^k <= M
        k = k + (jnp.ldexp(top, -k) > fmt.max)
    k = jnp.clip(k, -127, 127)
    y = jnp.ldexp(b, -k)
    y = jnp.where(y > fmt.max, fmt.max, jnp.where(y < -fmt.max, -fmt.max, y))
    if bits is not None:
        bits = _to_blocks(bits, axis, size)
    out = jnp.ldexp(reference_round_with(fmt, y, bits), k)
    out = jnp.where(jnp.isnan(top) | (top == jnp.inf), jnp.nan, out)
    return _from_blocks(out, x).astype(x.dtype)


class MXQuantize(_Encoding):
    r"""Microscaling (OCP MX v1.0) fake quantisation: MXFP8, MXFP6 or MXFP4, with
    the straight-through estimator. Blocks of `block_size` consecutive elements
    along `axis` share a power-of-two scale (E8M0).

    For a block $b$ with $a = \max_i \lvert b_i \rvert$, $M$ the element format's
    largest value and $e_\max$ its largest exponent (8, 15, 4, 2, 2 for e4m3,
    e5m2, e3m2, e2m3, e2m1), the scale's exponent is

    $$k_\mathrm{floor} = \lfloor \log_2 a \rfloor - e_\max, \qquad
    k_\mathrm{ceil} = \Big\lceil \log_2 \frac{a}{M} \Big\rceil$$

    by `scale_rounding`, and

    $$X = \operatorname{clip}\big(2^{k},\, 2^{-127},\, 2^{127}\big), \qquad
    q_i = X \cdot \operatorname{round}_{\mathrm{fmt}}\!\big(
    \operatorname{clip}(b_i / X, -M, M)\big), \qquad \dot q = t$$

    The OCP rule (`"floor"`) puts $a / X$ in $[2^{e_\max}, 2^{e_\max + 1})$, so a
    block whose $a$ has a larger significand than $M$ (above 1.75 for E4M3, 1.5
    for E2M1) saturates: its largest elements are clipped to $\pm M$, by up to
    12.5% (E4M3) or 25% (E2M1). `"ceil"` takes the least power of two with
    $a / X \le M$: nothing saturates, and where the floor rule does not
    saturate the two are the same scale. $k_\mathrm{ceil}$ is computed exactly,
    as $k_\mathrm{floor}$ plus one where $a$'s significand exceeds $M$'s (JAX's
    `scaled_dot_general` and NVIDIA's MXFP8 recipe round $a / M$ up to a power
    of two: the same scale).

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
    - `scale_rounding`: `"floor"` (the OCP specification's rule, the default) or
        `"ceil"` (no element saturates; the training recipes'
        [`mxfp8`][eqxrules.recipes.mxfp8] and [`mxfp4`][eqxrules.recipes.mxfp4]).

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
    scale_rounding: str = hyperparameter("floor", scale_rule)

    summary: ClassVar[str] = (
        "OCP MX: blocks of block_size along axis share the scale "
        "X = 2^(floor(log2 amax) − emax), or 2^ceil(log2(amax/max)) (`scale_rounding`); "
        "X·round_fmt(clip(x/X)), nearest or unbiased stochastic (`rounding`); "
        "derivative `t`"
    )
    functional_name: ClassVar[str] = "mx_quantize"

    def _encode(self, x: Array, bits: Array | None) -> Encoded:
        return pow2_encode(
            x, self.format, self.axis, self.block_size, self.scale_rounding, bits
        )

    def encode_operand(self, x: Array, *, key: PRNGKeyArray | None = None) -> Encoded:
        """`encode`'s parts, but where the codes' dtype holds a NaN (every format
        but E2M1) a NaN or infinite element is a NaN code and no block is tested
        for one (`pow2_encode`'s `nan_elements`): a product that reads blocks
        whole gives the same values (`LowPrecision.encode_operand`)."""
        if not holds_nan(self.format):
            return self.encode(x, key=key)
        bits = _bits(self, x, key)
        return pow2_encode(
            x.astype(_F32),
            self.format,
            self.axis,
            self.block_size,
            self.scale_rounding,
            bits,
            nan_elements=True,
        )

    def decode(self, e: Encoded, like: Any) -> Array:
        """`codes · 2^k` per block (NaN where `k = -128`), back in `like`'s layout
        and dtype: this quantiser's value, bit for bit."""
        return pow2_decode(e, like)

    def payload(self, e: Encoded, like: Any) -> tuple[Array, Array | None]:
        """`(value, None)`: with power-of-two scales the value is exact in
        bfloat16."""
        # Power-of-two scales: the value itself is exact in bfloat16.
        return self.decode(e, jax.ShapeDtypeStruct(like.shape, _F32)), None

    def storage(self) -> tuple[Any, Any]:
        """The element format's dtype for codes, int8 for the block exponents."""
        return code_dtype(self.format), jnp.int8

    def restored(self, e: Encoded) -> Encoded:
        """`stored`'s inverse: float32 codes and int32 exponents."""
        assert e.scales is not None
        return Encoded(e.codes.astype(_F32), e.scales.astype(jnp.int32))

    def _reference(self, x: Array, bits: Array | None) -> Array:
        return pow2_reference(
            x, self.format, self.axis, self.block_size, self.scale_rounding, bits
        )

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[MXQuantize]:
        return [
            cls(),
            cls(format="e4m3", block_size=4, axis=0, scale_rounding="ceil"),
            cls(format="e3m2", block_size=8, rounding="stochastic"),
        ]
