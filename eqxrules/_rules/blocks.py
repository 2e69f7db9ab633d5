r"""Block-scaled float quantisers: OCP MX (MXFP8, MXFP6, MXFP4) and NVIDIA's NVFP4,
blocks of consecutive elements along one axis (or 16x16 tiles over two) sharing a
scale, elements in an FP8/FP6/FP4 format (see `floats`), with straight-through
derivatives, the scales held fixed. (Notation: see `_elementwise`.)"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._axis_names import axis_names, check_bound
from .._catalogue import Domain, JVPRule
from .._hyper import at_least, axis_index, fixed, hyperparameter, integer
from .._inputs import check_axis, check_float_array
from ._encoded import Encoded, LowPrecision, code_dtype
from ._formats import (
    FORMATS,
    amax,
    divide,
    exponent,
    extremes,
    pow2,
    reference_amax,
    reference_round_to,
    reference_round_with,
    round_to,
    round_with,
)
from ._rounding import Rounded, rounding_mode
from .floats import (
    _F32,
    _bits,
    _reference_bits,
    element_format,
    pair_of_axes,
    span,
)


def _to_blocks(x: Array, axis: int | tuple[int, int], size: int) -> Array:
    """`x` with `axis` moved last and split into blocks of `size`: shape
    `(..., n // size, size)`. For two axes, blocks of `size` x `size` over both,
    flattened: shape `(..., n0 // size, n1 // size, size * size)`."""
    if isinstance(axis, int):
        x = jnp.moveaxis(x, axis, -1)
        return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)
    x = jnp.moveaxis(x, axis, (-2, -1))
    *lead, n0, n1 = x.shape
    x = x.reshape(*lead, n0 // size, size, n1 // size, size).swapaxes(-3, -2)
    return x.reshape(*lead, n0 // size, n1 // size, size * size)


def _moved(shape: tuple[int, ...], axes: tuple[int, ...]) -> list[int]:
    """`shape` with `axes` moved last, in that order."""
    axes = tuple(a % len(shape) for a in axes)
    return [n for i, n in enumerate(shape) if i not in axes] + [shape[a] for a in axes]


def _from_blocks(b: Array, axis: int | tuple[int, int], like: Any) -> Array:
    """The inverse of `_to_blocks`, for an array of `like`'s shape (an array or a
    `jax.ShapeDtypeStruct`)."""
    if isinstance(axis, int):
        moved = _moved(tuple(like.shape), (axis,))
        return jnp.moveaxis(b.reshape(moved), -1, axis)
    *lead, n0, n1 = _moved(tuple(like.shape), axis)
    size = math.isqrt(b.shape[-1])
    b = b.reshape(*lead, n0 // size, n1 // size, size, size).swapaxes(-3, -2)
    return jnp.moveaxis(b.reshape(*lead, n0, n1), (-2, -1), axis)


class BlockQuantizer(Rounded, JVPRule):
    r"""The base of block quantisers ([`MXQuantize`][eqxrules.MXQuantize],
    [`NVFP4Quantize`][eqxrules.NVFP4Quantize], or a user's): the protocol through
    which [`quantize`][eqxrules.quantize], [`Quantized`][eqxrules.Quantized] and the
    quantised products ([`quantized_dot_general`][eqxrules.quantized_dot_general]
    and the rest) put blocks along the dimension a product contracts.

    A subclass has the fields `block_size` (elements per block, an `int`), `axis`
    (the axis the blocks run along, or a pair of axes for square blocks of
    `block_size` × `block_size`) and `rounding` (`"nearest"` or `"stochastic"`,
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


def _times_pow2(q: Array, k: Array) -> Array:
    r"""$q \cdot 2^k$ for integers `k` in [-127, 127], by two normal powers of two:
    $2^{-127}$ is subnormal, which XLA may flush to zero, and at the top of float32
    a finite $q \cdot 2^k$ must not pass through an infinite $q \cdot 2^{k+1}$."""
    half = k // 2
    return q * pow2(half) * pow2(k - half)


class MXQuantize(_Encoding):
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

    def _encode(self, x: Array, bits: Array | None) -> Encoded:
        fmt = FORMATS[self.format]
        b = _to_blocks(x.astype(_F32), self.axis, self.block_size)
        top = amax(b, axis=-1, keepdims=True)
        k = jnp.clip(exponent(top) - fmt.emax, -127, 127)
        if bits is not None:
            bits = _to_blocks(bits, self.axis, self.block_size)
        q = round_with(fmt, jnp.clip(b * pow2(-k), -fmt.max, fmt.max), bits)
        # A block with a NaN or an infinity is NaN (the spec's NaN scale): its
        # exponent -128, outside the scales' range [-127, 127].
        finite = jnp.isfinite(top)
        return Encoded(jnp.where(finite, q, 0.0), jnp.where(finite, k, _NAN_BLOCK))

    def decode(self, e: Encoded, like: Any) -> Array:
        """`codes · 2^k` per block (NaN where `k = -128`), back in `like`'s layout
        and dtype: this quantiser's value, bit for bit."""
        assert e.scales is not None
        k = e.scales
        out = _times_pow2(e.codes, jnp.maximum(k, -127))
        out = jnp.where(k == _NAN_BLOCK, jnp.nan, out)
        return _from_blocks(out, self.axis, like).astype(like.dtype)

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
        fmt = FORMATS[self.format]
        b = _to_blocks(x.astype(_F32), self.axis, self.block_size)
        top = reference_amax(b, axis=-1, keepdims=True)
        _, e = jnp.frexp(top)  # top = m·2^e with m in [1/2, 1)
        k = jnp.clip(e - 1 - fmt.emax, -127, 127)
        y = jnp.ldexp(b, -k)
        y = jnp.where(y > fmt.max, fmt.max, jnp.where(y < -fmt.max, -fmt.max, y))
        if bits is not None:
            bits = _to_blocks(bits, self.axis, self.block_size)
        out = jnp.ldexp(reference_round_with(fmt, y, bits), k)
        out = jnp.where(jnp.isnan(top) | (top == jnp.inf), jnp.nan, out)
        return _from_blocks(out, self.axis, x).astype(x.dtype)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[MXQuantize]:
        return [
            cls(),
            cls(format="e4m3", block_size=4, axis=0),
            cls(format="e3m2", block_size=8, rounding="stochastic"),
        ]


class NVFP4Quantize(_Encoding):
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

    With two axes, `axis=(0, 1)`, each block is a 16×16 square over both
    (Transformer Engine's 2-D quantisation of weights): the same quantised
    matrix whichever of its axes a product reduces.

    **Arguments:**

    - `block_size`: 16, fixed by the format (any other value is a `ValueError`;
        declared so that NVFP4 is built like [`MXQuantize`][]).
    - `axis`: the axis the blocks run along, or two axes for 16×16 blocks.
    - `rounding`: `"nearest"` (ties to even) or `"stochastic"`: each $b_i / d$
        rounded stochastically as in [`FloatQuantize`][] (unbiased, 24 random
        bits, `key=` needed at call), as NVIDIA's recipe rounds gradients; the
        scales $t$ and $d$ are those of rounding to nearest.
    - `axis_name`: `None` (the array's own $A$) or the name (a tuple of names) of
        mapped axes whose amax $A$ spans, as `eqx.nn.BatchNorm` takes it: under
        `jax.vmap(..., axis_name=name)` the examples share the batch's tensor
        scale, under `jax.shard_map` the devices do (`lax.pmax`). An unbound name
        is a `ValueError`.

    !!! Example

        ```python
        x = jnp.linspace(-1.0, 1.0, 32).reshape(2, 16)
        eqxrules.nvfp4_quantize(x)
        ```
    """

    block_size: int = hyperparameter(16, fixed(16, "the NVFP4 format fixes it"))
    axis: int | tuple[int, int] = hyperparameter(-1, pair_of_axes)
    rounding: str = hyperparameter("nearest", rounding_mode)
    axis_name: Any = hyperparameter(None, axis_names, allow_none=True)

    # Room for 16×16 blocks (the examples' `axis=(0, 1)`).
    domain: ClassVar[Domain] = Domain(shape=(16, 16))
    summary: ClassVar[str] = (
        "NVFP4: t = amax(x)/(448·6), per block of 16 along axis s = round_e4m3("
        "amax_block/6/t), d = t·s, d·round_e2m1(clip(x/d, ±6)), nearest or "
        "unbiased stochastic (`rounding`); derivative `t`"
    )
    functional_name: ClassVar[str] = "nvfp4_quantize"

    def _encode(self, x: Array, bits: Array | None) -> Encoded:
        e4m3, e2m1 = FORMATS["e4m3"], FORMATS["e2m1"]
        w = x.astype(_F32)
        t = divide(span(amax(w), self.axis_name), 448.0 * 6)
        b = _to_blocks(w, self.axis, self.block_size)
        a = jnp.max(jnp.abs(b), axis=-1, keepdims=True)
        s = round_to(e4m3, jnp.clip(divide(divide(a, 6.0), t), 0.0, 448.0))
        if bits is not None:
            bits = _to_blocks(bits, self.axis, self.block_size)
        c = round_with(e2m1, jnp.clip(divide(b, t * s), -6.0, 6.0), bits)
        c = jnp.where(s > 0, c, b * 0)  # (a zero of `b`'s sign)
        # A NaN or an infinity anywhere makes the tensor scale, so the output, NaN.
        return Encoded(jnp.where(jnp.isfinite(b), c, 0.0), s, t)

    def decode(self, e: Encoded, like: Any) -> Array:
        """`codes · (tensor · scale)` per block of 16 (the codes where no scale is
        positive; NaN where the tensor scale is not finite), in `like`'s layout and
        dtype."""
        assert e.scales is not None and e.tensor is not None
        # Where no scale is positive (0, or NaN for an all-zero array: t = 0) the
        # codes are the zeros themselves.
        out = jnp.where(e.scales > 0, e.codes * (e.tensor * e.scales), e.codes)
        out = jnp.where(jnp.isfinite(e.tensor), out, jnp.nan)
        return _from_blocks(out, self.axis, like).astype(like.dtype)

    def payload(self, e: Encoded, like: Any) -> tuple[Array, Array | None]:
        """`(codes · scale, tensor)`: an E2M1 code times an E4M3 scale has at most
        6 significant bits, exact in bfloat16."""
        # An E2M1 code times an E4M3 scale: at most 6 significant bits.
        assert e.scales is not None
        scaled = jnp.where(e.scales > 0, e.codes * e.scales, e.codes)
        return _from_blocks(scaled, self.axis, like), e.tensor

    def storage(self) -> tuple[Any, Any]:
        """E2M1 codes (two to a byte when packed) and E4M3 block scales."""
        return code_dtype("e2m1"), jnp.float8_e4m3fn

    def _reference(self, x: Array, bits: Array | None) -> Array:
        e4m3, e2m1 = FORMATS["e4m3"], FORMATS["e2m1"]
        w = x.astype(_F32)
        b = _to_blocks(w, self.axis, 16)
        A = reference_amax(b, axis=(-2, -1), keepdims=True)
        A = reference_amax(A, axis=tuple(range(A.ndim - 2)), keepdims=True)
        A = span(A, self.axis_name)
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
        return [cls(), cls(rounding="stochastic"), cls(axis=(0, 1))]
