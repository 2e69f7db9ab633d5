r"""Low-precision arrays: a quantiser's value as what hardware holds, element codes
times scales.

A quantiser of the float formats (`FloatQuantize`, `MXQuantize`, `NVFP4Quantize`)
computes its value $q$ in three parts: the element codes $c$ (values of the element
format: E4M3, E2M1, ...), a scale per block $S$ (a power of two for MX, an E4M3
value for NVFP4) and a scale per tensor $t$ (float32: `FloatQuantize`'s `"amax"`
scale, NVFP4's):

$$q = t \cdot (S \cdot c) \quad \text{(each product rounded to float32, in the order
the quantiser's statement gives)}.$$

`encode` gives the parts (`Encoded`), `decode` the value from them, bit for bit the
quantiser's own (its value *is* `decode(encode(x))`). Two uses:

- **Exact products** (`payload`): $S \cdot c$ is exactly representable in bfloat16
  (a code has at most 3 significant bits, an E4M3 scale 4, a power of two none), so
  a product of two such operands is exact in bfloat16 and in TF32, whatever the
  backend's default matmul precision, and its float32 accumulation the only
  rounding; the tensor scales multiply the product's output.
- **Residuals in their formats** (`stored`): the codes fit their format's dtype
  (`float8_e4m3fn`, `float8_e5m2`, `float4_e2m1fn`; FP6 codes in the FP8 dtype of
  their mantissa), MX's exponents an `int8`, NVFP4's scales `float8_e4m3fn`: a
  quarter of float32's bytes, or an eighth for FP4 codes.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

_F32 = jnp.float32
# The dtype that holds each element format's codes exactly (FP6 has no XLA
# conversion on the CPU: its codes go in the FP8 dtype of the same mantissa).
_CODE_DTYPES = {
    "e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
    "e3m2": "float8_e5m2",
    "e2m3": "float8_e4m3fn",
    "e2m1": "float4_e2m1fn",
}


def code_dtype(fmt: str, nan: bool = False) -> Any:
    """The dtype that holds the codes of element format `fmt` exactly: its own
    where JAX has it (`float4_e2m1fn` from jax 0.5), else `float8_e4m3fn`, which
    holds every value of every format narrower than it. With `nan`, one that holds
    a NaN code too (FP4 has none: `float8_e4m3fn`)."""
    name = _CODE_DTYPES[fmt]
    if nan and name == "float4_e2m1fn":
        name = "float8_e4m3fn"
    return getattr(jnp, name, jnp.float8_e4m3fn)


def holds_nan(fmt: str) -> bool:
    """Whether `code_dtype(fmt)` holds a NaN code (every element format but FP4,
    whose codes take `float4_e2m1fn`)."""
    return code_dtype(fmt) == code_dtype(fmt, nan=True)


class Encoded(NamedTuple):
    """A quantiser's value in parts (the module docstring): `codes` (float32
    values of the element format, in the quantiser's blocked layout), `scales` (one
    per block, or `None`) and `tensor` (a float32 scalar, or `None`)."""

    codes: Array
    scales: Array | None = None
    tensor: Array | None = None


class LowPrecision(eqx.Module):
    """The quantisers whose value is codes times scales (the module docstring).

    `exact_payload` is `False` for a quantiser whose scales are float32 per block
    (`BlockFloatQuantize`): no payload is then exact in bfloat16 beside a scalar
    tensor scale, so its `payload` is the value itself, `(value, None)`, and a
    product must take it at `HIGHEST` precision."""

    exact_payload: ClassVar[bool] = True

    @abc.abstractmethod
    def encode(self, x: Array, *, key: PRNGKeyArray | None = None) -> Encoded:
        """The parts of this quantiser's value at `x` (drawing with `key` if it
        rounds stochastically)."""

    def encode_operand(self, x: Array, *, key: PRNGKeyArray | None = None) -> Encoded:
        """The parts of `x` as an operand of a product that reads its blocks whole
        (`ops.Operand.whole`: every output that reads one element of a block reads
        all of them). They may differ from `encode`'s in a block with a NaN or an
        infinity, and only there: such a block's non-finite elements NaN codes,
        its other elements any codes (`MXQuantize`: no reduction over the block
        to find it). `payload` of them is NaN at those elements, so the product
        is NaN at every output that reads the block, as with `encode`'s parts,
        and bit for bit the same elsewhere. `encode` unless a quantiser says
        otherwise."""
        return self.encode(x, key=key)

    @abc.abstractmethod
    def decode(self, e: Encoded, like: Any) -> Array:
        """The value from its parts, bit for bit this quantiser's, in the shape and
        dtype of `like` (the input, or a `jax.ShapeDtypeStruct`)."""

    @abc.abstractmethod
    def payload(self, e: Encoded, like: Any) -> tuple[Array, Array | None]:
        """`(p, t)`: float32 `p` of `like`'s shape, exactly representable in
        bfloat16 (where `exact_payload`; else the value), and the tensor scale `t`
        (`e.tensor`: `None` for 1), with `t · p` the value to within one rounding.
        `p` reads no `e.tensor` (a ragged product's residuals take `p` for every
        group's rows at once and each row's own group's `t`)."""

    @abc.abstractmethod
    def storage(self) -> tuple[Any, Any]:
        """The dtypes that hold the codes and the block scales exactly (the second
        `None` if there are none)."""

    def stored(self, e: Encoded) -> Encoded:
        """`e` with its codes and scales in their own dtypes (exact)."""
        codes, scales = self.storage()
        return Encoded(
            e.codes.astype(codes),
            None if e.scales is None else e.scales.astype(scales),
            e.tensor,
        )

    def restored(self, e: Encoded) -> Encoded:
        """`stored`'s inverse: float32 codes and scales."""
        return Encoded(
            e.codes.astype(_F32),
            None if e.scales is None else e.scales.astype(_F32),
            e.tensor,
        )
