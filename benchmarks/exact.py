"""The exact products of the quantised core, written as a careful user would
(issue 41 §1), for the benchmarks' hand-written baselines: each operand quantised
by a public quantiser into its payload and tensor scale (`encode`, `payload`),
the product at `Precision.DEFAULT` on payloads exact in bfloat16 with the tensor
scales on its output, or at `Precision.HIGHEST` on float32 values.

The weight-gradient product's left operand is quantised in the forward pass and
kept in its formats' dtypes (`kept`, then `loaded` in the backward pass), as the
quantised core keeps it (issue 41 §2)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from eqxrules._rules._encoded import LowPrecision


class Operand(NamedTuple):
    value: jax.Array
    scale: Any = None
    exact: bool = False


def quantised(q: Any, v: jax.Array, key: Any) -> Operand:
    """`v` quantised by `q` (`None`: as it is), as a product takes it."""
    if q is None:
        return Operand(v)
    if isinstance(q, LowPrecision):
        value, scale = q.payload(q.encode(v, key=key), v)
        return Operand(value, scale, getattr(q, "exact_payload", True))
    return Operand(q(v, key=key))


def kept(q: Any, v: jax.Array, key: Any) -> Any:
    """`v` quantised by `q` in the forward pass, as the backward pass keeps it: a
    `LowPrecision` quantiser's parts in their formats' dtypes (`stored`), another
    quantiser's float32 value, or `v` itself (`q` is `None`)."""
    if q is None:
        return v
    if isinstance(q, LowPrecision):
        return q.stored(q.encode(v, key=key))
    return q(v, key=key)


def loaded(q: Any, k: Any, like: Any) -> Operand:
    """The operand that `kept(q, v, key)` keeps (`k`), as a product takes it, for
    `v` of `like`'s shape (a `jax.ShapeDtypeStruct`): `quantised(q, v, key)`."""
    if isinstance(q, LowPrecision):
        value, scale = q.payload(q.restored(k), like)
        return Operand(value, scale, getattr(q, "exact_payload", True))
    return Operand(k)


def reshaped(a: Operand, f: Callable[[jax.Array], jax.Array]) -> Operand:
    """`a` with `f` (a reshape or transpose) applied to its value."""
    return Operand(f(a.value), a.scale, a.exact)


def contract(product: Callable[..., jax.Array], a: Operand, b: Operand) -> jax.Array:
    """`product(x, y, precision)` of two quantised operands, exact on any backend."""
    if a.exact and b.exact:
        out = product(a.value, b.value, jax.lax.Precision.DEFAULT)
        scales = [s for s in (a.scale, b.scale) if s is not None]
        if scales:
            out = out * (scales[0] if len(scales) == 1 else scales[0] * scales[1])
        return out

    def dequantised(o: Operand) -> jax.Array:
        return o.value if o.scale is None else o.value * o.scale

    return product(dequantised(a), dequantised(b), jax.lax.Precision.HIGHEST)
