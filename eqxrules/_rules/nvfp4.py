r"""NVIDIA's NVFP4: FP4 (E2M1) elements in blocks of 16 with E4M3 scales under a
float32 scale per tensor, and Four Over Six's choice of each block's scale.
(Notation: see `_elementwise`.)"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from .._axis_names import axis_names
from .._catalogue import Domain
from .._hyper import Check, fixed, hyperparameter
from ._encoded import Encoded, code_dtype
from ._formats import (
    FORMATS,
    amax,
    divide,
    reference_amax,
    reference_round_to,
    reference_round_with,
    round_to,
    round_with,
)
from ._rounding import rounding_mode
from .blocks import _Encoding, _from_blocks, _to_blocks, _within
from .floats import _F32, pair_of_axes, span

_E4M3, _E2M1 = FORMATS["e4m3"], FORMATS["e2m1"]
# The largest block scale the tensor scale leaves room for: E4M3's 448, or 256
# with 4/6, so that a block scaled to 4 (its scale 6/4 of 256) stays below 448.
_ROOM = {False: 448.0, True: 256.0}
_boolean = Check("be a bool", lambda v, _: isinstance(v, bool), TypeError, (1, None))


def _codes(b: Array, d: Array, s: Array, bits: Array | None) -> Array:
    """The E2M1 codes of blocks `b` under the scale `d` = t·s (zeros of `b`'s sign
    where the block scale `s` is 0)."""
    c = round_with(_E2M1, jnp.clip(divide(b, d), -6.0, 6.0), bits)
    return jnp.where(s > 0, c, b * 0)


class NVFP4Quantize(_Encoding):
    r"""NVIDIA's NVFP4 fake quantisation: FP4 (e2m1) elements in blocks of 16 along
    `axis`, each block with an FP8 (e4m3) scale, under one float32 scale for the
    whole array; the straight-through estimator.

    With $A = \max \lvert x \rvert$ over the whole array and, for each block $b$,
    $a = \max_i \lvert b_i \rvert$:

    $$t = \frac{A}{R \cdot 6}, \qquad
    s_m = \operatorname{round}_{\mathrm{e4m3}}\!\Big(\frac{a / m}{t}\Big), \qquad
    q_i = (t \cdot s) \cdot \operatorname{round}_{\mathrm{e2m1}}\!\big(
    \operatorname{clip}(b_i / (t \cdot s), -6, 6)\big), \qquad \dot q = t$$

    each operation rounded to float32. Without Four Over Six, $R = 448$ and
    $s = s_6$: each block's amax maps to E2M1's largest value, 6.

    **Four Over Six** (`four_over_six=True`; Cook et al., arXiv 2512.02010;
    Transformer Engine's `nvfp4_4over6`): E2M1 has nothing between 4 and 6, so
    the elements of a block that fall between $\frac23 a$ and $a$ lose most. Each
    block is quantised with $s_6$ and with $s_4$ (its amax mapped to 4, where the
    grid is finer) and keeps the one whose values $q$ (rounded to nearest) have
    the lower sum of squared errors $\sum_i (q_i - b_i)^2$ over the block; $s_6$
    on a tie. $R = 256$: a block's $s_4 \le \frac{A/4}{A/(256 \cdot 6)} = 384$
    stays within E4M3's 448 (with $R = 448$ the tensor's largest block would
    need $s_4 = 672$), at the cost of that headroom in $s_6$.

    A block whose scale $s$ is 0 (all zero, or $a / m / t \le 2^{-10}$, below
    half e4m3's smallest subnormal) gives zeros. A NaN or $\pm\infty$ anywhere
    makes the whole output NaN (the tensor scale is not finite). The derivative
    is straight-through, the scales held fixed (no gradient through $A$ or $a$),
    as torchao's NVFP4 QAT does. Computed in float32; the output has the input's
    dtype. Not elementwise: the length of `axis` must be a multiple of 16 (else a
    `ValueError`). In [`Quantized`][] the blocks run along the layer's reduction
    dimension, as for [`MXQuantize`][].

    With two axes, `axis=(0, 1)`, each block is a 16×16 square over both
    (Transformer Engine's 2-D quantisation of weights): the same quantised
    matrix whichever of its axes a product reduces.

    **Arguments:**

    - `block_size`: 16, fixed by the format (any other value is a `ValueError`;
        declared so that NVFP4 is built like [`MXQuantize`][]).
    - `axis`: the axis the blocks run along, or two axes for 16×16 blocks.
    - `rounding`: `"nearest"` (ties to even) or `"stochastic"`: each
        $b_i / (t s)$ rounded stochastically as in [`FloatQuantize`][]
        (unbiased, 24 random bits, `key=` needed at call), as NVIDIA's recipe
        rounds gradients; the scales $t$ and $s$ are those of rounding to
        nearest (with Four Over Six, chosen by the errors of rounding to
        nearest: the choice depends on $x$ alone, so the rounding stays
        unbiased).
    - `axis_name`: `None` (the array's own $A$) or the name (a tuple of names) of
        mapped axes whose amax $A$ spans, as `eqx.nn.BatchNorm` takes it: under
        `jax.vmap(..., axis_name=name)` the examples share the batch's tensor
        scale, under `jax.shard_map` the devices do (`lax.pmax`). An unbound name
        is a `ValueError`.
    - `four_over_six`: `False` (the default: every block scaled to 6) or `True`.

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
    four_over_six: bool = hyperparameter(False, _boolean)

    # Room for 16×16 blocks (the examples' `axis=(0, 1)`).
    domain: ClassVar[Domain] = Domain(shape=(16, 16))
    summary: ClassVar[str] = (
        "NVFP4: t = amax(x)/(448·6), per block of 16 along axis s = round_e4m3("
        "amax_block/6/t), d = t·s, d·round_e2m1(clip(x/d, ±6)), nearest or "
        "unbiased stochastic (`rounding`); or each block scaled to 4 or 6, "
        "whichever errs less, under t = amax(x)/(256·6) (`four_over_six`); "
        "derivative `t`"
    )
    functional_name: ClassVar[str] = "nvfp4_quantize"

    def _encode(self, x: Array, bits: Array | None) -> Encoded:
        w = x.astype(_F32)
        t = divide(span(amax(w), self.axis_name), _ROOM[self.four_over_six] * 6)
        b = _to_blocks(w, self.axis, self.block_size)
        inner = _within(self.axis, w.ndim)
        a = jnp.max(jnp.abs(b), axis=inner, keepdims=True)

        def scale(m: float) -> Array:
            return round_to(_E4M3, jnp.clip(divide(divide(a, m), t), 0.0, 448.0))

        s = scale(6.0)
        if self.four_over_six:
            s4 = scale(4.0)

            def error(s: Array) -> Array:
                d = t * s
                q = jnp.where(s > 0, _codes(b, d, s, None) * d, b * 0)
                return jnp.sum((q - b) ** 2, axis=inner, keepdims=True)

            s = jnp.where(error(s4) < error(s), s4, s)
        if bits is not None:
            bits = _to_blocks(bits, self.axis, self.block_size)
        c = _codes(b, t * s, s, bits)
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
        return _from_blocks(out, like).astype(like.dtype)

    def payload(self, e: Encoded, like: Any) -> tuple[Array, Array | None]:
        """`(codes · scale, tensor)`: an E2M1 code times an E4M3 scale has at most
        6 significant bits, exact in bfloat16."""
        # An E2M1 code times an E4M3 scale: at most 6 significant bits.
        assert e.scales is not None
        scaled = jnp.where(e.scales > 0, e.codes * e.scales, e.codes)
        return _from_blocks(scaled, like), e.tensor

    def storage(self) -> tuple[Any, Any]:
        """E2M1 codes and E4M3 block scales."""
        return code_dtype("e2m1"), jnp.float8_e4m3fn

    def _reference(self, x: Array, bits: Array | None) -> Array:
        w = x.astype(_F32)
        b = _to_blocks(w, self.axis, 16)
        inner = _within(self.axis, w.ndim)
        A = span(reference_amax(reference_amax(b, axis=inner)), self.axis_name)
        t = divide(A, _ROOM[self.four_over_six] * 6)
        a = jnp.max(jnp.abs(b), axis=inner, keepdims=True)

        def quantised(m: float, bits: Array | None) -> Array:
            """The blocks' values with each amax mapped to `m`."""
            r = divide(divide(a, m), t)
            s = reference_round_to(_E4M3, jnp.where(r > 448.0, 448.0, r))
            d = t * s
            y = divide(b, d)
            y = jnp.where(y > 6.0, 6.0, jnp.where(y < -6.0, -6.0, y))
            live = s > 0  # false where s is 0, or NaN (an all-zero array: t = 0)
            q = reference_round_with(_E2M1, y, bits) * d
            return jnp.where(live, q, jnp.zeros_like(b) * b)

        if bits is not None:
            bits = _to_blocks(bits, self.axis, 16)
        out = quantised(6.0, bits)
        if self.four_over_six:
            err = {
                m: jnp.sum(jnp.square(quantised(m, None) - b), inner, keepdims=True)
                for m in (4.0, 6.0)
            }
            out = jnp.where(err[4.0] < err[6.0], quantised(4.0, bits), out)
        out = jnp.where(jnp.isnan(t) | (t == jnp.inf), jnp.nan, out)
        return _from_blocks(out, x).astype(x.dtype)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[NVFP4Quantize]:
        return [
            cls(),
            cls(rounding="stochastic"),
            cls(axis=(0, 1)),
            cls(axis=(0, 1), rounding="stochastic", four_over_six=True),
        ]
