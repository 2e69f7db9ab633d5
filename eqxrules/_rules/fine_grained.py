r"""Fine-grained FP8 scaling: a float32 scale per tile or square block
(DeepSeek-V3's), and a power-of-two scale per row (torchao's row-wise), with
straight-through derivatives, the scales held fixed. (Notation: see
`_elementwise`.)"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from .._catalogue import Domain
from .._hyper import at_least, axis_index, fixed, hyperparameter, integer
from ._encoded import Encoded, code_dtype
from ._formats import (
    FORMATS,
    amax,
    divide,
    reference_amax,
    reference_round_with,
    round_with,
)
from ._rounding import rounding_mode
from .blocks import (
    _Encoding,
    _from_blocks,
    _to_blocks,
    _within,
    pow2_decode,
    pow2_encode,
    pow2_reference,
)
from .floats import _F32, element_format, pair_of_axes

_SMALLEST_NORMAL = 2.0**-126


def _domain(axis: int | tuple[int, int], size: int) -> Domain:
    """Inputs of two axes, each blocked one two blocks long, the other at least 8
    and long enough for 128 elements: `check_unbiased`'s sample needs 64 that a
    rounding holds, and a block's largest element (clipped to the format's
    largest value) is not held. No more: hypothesis draws every element."""
    axes = {a % 2 for a in ((axis,) if isinstance(axis, int) else axis)}
    other = max(8, -(-128 // (2 * size)))
    return Domain(shape=tuple(2 * size if a in axes else other for a in range(2)))


class BlockFloatQuantize(_Encoding):
    r"""Fine-grained FP8 (DeepSeek-V3, arXiv 2412.19437): blocks of `block_size`
    consecutive elements along `axis` (its 1×128 tiles of activations and
    gradients), or square blocks of `block_size` × `block_size` over two axes (its
    128×128 weight blocks), each with its own float32 scale from its current
    amax; the straight-through estimator.

    For a block $b$ with $a = \max_i \lvert b_i \rvert$ and $M$ the element
    format's largest value (448 for E4M3):

    $$s = \max\big(a / M,\ 2^{-126}\big), \qquad
    q_i = s \cdot \operatorname{round}_{\mathrm{fmt}}\!\big(
    \operatorname{clip}(b_i / s, -M, M)\big), \qquad \dot q = t$$

    each operation rounded to float32 (the division as the backend rounds it:
    correctly on the CPU, within 2 ulps on a GPU): $s$ is not a power of two, so $q_i$ is
    the code times $s$ rounded once more, and the block's largest element goes
    to $\pm M$ (clipped only by the rounding of $s$). $s$ is never zero nor
    subnormal, so an all-zero block stays zero (with its signs). A NaN or
    $\pm\infty$ in a block makes that block NaN (its scale NaN) and leaves the
    other blocks alone. The derivative is straight-through, the scales held fixed
    (no gradient through $a$). Computed in float32; the output has the input's
    dtype. Not elementwise: `block_size` must divide the length of each blocked
    axis (else a `ValueError`); the quantised products pad with zeros. XLA
    flushes float32 subnormals on CPU and GPU, so in a block whose largest
    magnitude is below about $2^{-110}$ a subnormal input or result may be a
    zero of its sign.

    Its parts (`encode`): E4M3 codes and a float32 scale per block. No payload
    is exact in bfloat16 beside a scalar tensor scale (`exact_payload` is
    `False`): the value is the payload, and a product takes it at `HIGHEST`
    precision.

    **Arguments:**

    - `format`: the element format, `"e4m3"` by default (DeepSeek-V3's, for
        every operand).
    - `block_size`: elements per block along each blocked axis, 128 by default.
    - `axis`: the axis the blocks run along, or two axes for square blocks.
    - `rounding`: `"nearest"` (ties to even) or `"stochastic"`: each $b_i / s$
        rounded stochastically as in [`FloatQuantize`][] (`key=` needed at
        call); the scales are those of rounding to nearest.

    !!! Example

        ```python
        x = jnp.linspace(-1.0, 1.0, 256).reshape(2, 128)
        eqxrules.block_float_quantize(x)  # each row one tile of 128
        ```
    """

    format: str = hyperparameter("e4m3", element_format)
    block_size: int = hyperparameter(128, at_least(1, integer))
    axis: int | tuple[int, int] = hyperparameter(-1, pair_of_axes)
    rounding: str = hyperparameter("nearest", rounding_mode)

    exact_payload: ClassVar[bool] = False
    summary: ClassVar[str] = (
        "DeepSeek-V3's fine-grained FP8: blocks of block_size along axis (or square "
        "over two) each scaled by float32 s = amax/max; s·round_fmt(clip(x/s)), "
        "nearest or unbiased stochastic (`rounding`); derivative `t`"
    )

    def input_domain(self) -> Domain:
        return _domain(self.axis, self.block_size)

    def _encode(self, x: Array, bits: Array | None) -> Encoded:
        fmt = FORMATS[self.format]
        b = _to_blocks(x.astype(_F32), self.axis, self.block_size)
        top = amax(b, axis=_within(self.axis, x.ndim), keepdims=True)
        s = jnp.maximum(divide(top, fmt.max), _SMALLEST_NORMAL)
        finite = jnp.isfinite(top)
        s = jnp.where(finite, s, jnp.nan)
        if bits is not None:
            bits = _to_blocks(bits, self.axis, self.block_size)
        c = round_with(fmt, jnp.clip(divide(b, s), -fmt.max, fmt.max), bits)
        # A block with a NaN or an infinity: its codes 0, its scale NaN.
        return Encoded(jnp.where(finite, c, 0.0), s)

    def decode(self, e: Encoded, like: Any) -> Array:
        """`codes · scale` per tile, in `like`'s layout and dtype."""
        assert e.scales is not None
        return _from_blocks(e.codes * e.scales, like).astype(like.dtype)

    def payload(self, e: Encoded, like: Any) -> tuple[Array, Array | None]:
        """`(value, None)`: the float32 value (its scales are not powers of two, so
        it is not exact in bfloat16: `exact_payload` is false)."""
        return self.decode(e, jax.ShapeDtypeStruct(like.shape, _F32)), None

    def storage(self) -> tuple[Any, Any]:
        """The element format's dtype for codes, float32 for the tiles' scales."""
        return code_dtype(self.format), _F32

    def _reference(self, x: Array, bits: Array | None) -> Array:
        fmt = FORMATS[self.format]
        b = _to_blocks(x.astype(_F32), self.axis, self.block_size)
        top = reference_amax(b, axis=_within(self.axis, x.ndim), keepdims=True)
        r = divide(top, fmt.max)
        s = jnp.where(r < _SMALLEST_NORMAL, _SMALLEST_NORMAL, r)
        y = divide(b, s)
        y = jnp.where(y > fmt.max, fmt.max, jnp.where(y < -fmt.max, -fmt.max, y))
        if bits is not None:
            bits = _to_blocks(bits, self.axis, self.block_size)
        out = reference_round_with(fmt, y, bits) * s
        out = jnp.where(jnp.isnan(top) | (top == jnp.inf), jnp.nan, out)
        return _from_blocks(out, x).astype(x.dtype)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[BlockFloatQuantize]:
        return [
            cls(block_size=16),
            cls(format="e5m2", block_size=4, axis=0, rounding="stochastic"),
            cls(block_size=8, axis=(0, 1)),
        ]


class RowFloatQuantize(_Encoding):
    r"""Row-wise FP8 (torchao's `ROWWISE` recipe, its scales rounded to powers of
    two): the elements of each row along `axis` (every 1-D slice of the array
    along it) share one power-of-two scale from their current amax; the
    straight-through estimator.

    For a row $b$ with $a = \max_i \lvert b_i \rvert$ and $M$ the element format's
    largest value:

    $$X = \operatorname{clip}\Big(2^{\lceil \log_2 (a / M) \rceil},\,
    2^{-127},\, 2^{127}\Big), \qquad
    q_i = X \cdot \operatorname{round}_{\mathrm{fmt}}\!\big(
    \operatorname{clip}(b_i / X, -M, M)\big), \qquad \dot q = t$$

    the least power of two that keeps every element within $\pm M$: nothing
    saturates, and each $q_i$ is its code times $X$ exactly. It is
    [`MXQuantize`][]'s `scale_rounding="ceil"` with one block the whole row,
    computed as that is (the exponent exact; an all-zero row stays zero with its
    signs; a NaN or $\pm\infty$ in a row makes that row NaN and leaves the others
    alone). The derivative is straight-through, the
    scales held fixed (no gradient through $a$). Computed in float32; the output
    has the input's dtype.

    **Arguments:**

    - `format`: the element format, `"e4m3"` by default.
    - `block_size`: 1, fixed: a row is the whole axis, whatever its length, so
        the length a blocked axis must be a multiple of is 1 (any other value
        is a `ValueError`; declared so that a row is blocked as
        [`BlockQuantizer`][]'s protocol says).
    - `axis`: the axis the rows run along.
    - `rounding`: `"nearest"` (ties to even) or `"stochastic"`: each $b_i / X$
        rounded stochastically as in [`FloatQuantize`][] (`key=` needed at
        call); the scales are those of rounding to nearest.

    !!! Example

        ```python
        x = jnp.array([[0.5, -3.0, 448.0], [1e-3, 2e-3, 0.0]])
        eqxrules.row_float_quantize(x)  # one scale per row: 1 and 2^-17
        ```
    """

    format: str = hyperparameter("e4m3", element_format)
    block_size: int = hyperparameter(1, fixed(1, "a row is the whole axis"))
    axis: int = hyperparameter(-1, axis_index)
    rounding: str = hyperparameter("nearest", rounding_mode)
    summary: ClassVar[str] = (
        "row-wise FP8: each row along axis shares X = 2^ceil(log2(amax/max)); "
        "X·round_fmt(clip(x/X)), nearest or unbiased stochastic (`rounding`); "
        "derivative `t`"
    )

    def input_domain(self) -> Domain:
        return _domain(self.axis, 8)

    def _length(self, x: Any) -> int:
        return int(x.shape[self.axis])

    def _encode(self, x: Array, bits: Array | None) -> Encoded:
        length = self._length(x)
        return pow2_encode(x, self.format, self.axis, length, "ceil", bits)

    def decode(self, e: Encoded, like: Any) -> Array:
        """`codes · 2^k` per row, in `like`'s layout and dtype."""
        return pow2_decode(e, like)

    def payload(self, e: Encoded, like: Any) -> tuple[Array, Array | None]:
        """`(value, None)`: with power-of-two scales the value is exact in
        bfloat16."""
        # Power-of-two scales: the value itself is exact in bfloat16.
        return self.decode(e, jax.ShapeDtypeStruct(like.shape, _F32)), None

    def storage(self) -> tuple[Any, Any]:
        """The element format's dtype for codes, int8 for the rows' exponents."""
        return code_dtype(self.format), jnp.int8

    def restored(self, e: Encoded) -> Encoded:
        """`stored`'s inverse: float32 codes and int32 exponents."""
        assert e.scales is not None
        return Encoded(e.codes.astype(_F32), e.scales.astype(jnp.int32))

    def _reference(self, x: Array, bits: Array | None) -> Array:
        length = self._length(x)
        return pow2_reference(x, self.format, self.axis, length, "ceil", bits)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[RowFloatQuantize]:
        return [cls(), cls(format="e2m1", axis=0, rounding="stochastic")]
