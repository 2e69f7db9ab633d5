r"""One product of the quantised core: its two operands quantised as its recipe's
`Product` says, along what its operation (`ops.Op`) contracts, then the operation.
Role-agnostic: a gradient product is the forward product of a transposed
operation (`Op.transpose`), so everything here reads `Op.operands()` alone.

**Blocks.** A block quantiser's blocks run along the dimensions the product
contracts of its operand (`Operand.blocked`). Several are moved to the front, in
the order the product pairs them, and flattened row-major into one, blocked as
one. A length that a block does not divide is padded with zeros at the end (the
partial block is the last): zeros change no block's scale, quantise to zero and
add nothing. Where the operation pads its contraction (`Op.padded_contraction`, a
`dot_general`) the padding stays in the contraction (`Op.flat`), so the result is,
bit for bit, that of the padded operands; elsewhere it is sliced off after
quantising. Square blocks (`axis` a pair) cover the blocked dimension and the one
it pairs with (`Operand.paired`), each padded with zeros to the block.

**Independent tensors.** Each index of `Operand.independent` (a ragged product's
per-group weights) is a tensor of its own, and so is each segment of rows of
`Operand.segmented` (a ragged product's groups, laid out each from row 0 and padded
with zeros at its end): per-tensor scales are theirs, blocks never cross them, and
slice or segment $i$ draws with `fold_in(key, i)`.

**The random Hadamard transform** (`Product.hadamard`) rotates both operands along
the flattened, padded contraction (`Op.flat`) with the same signs before
quantising, leaving the unquantised product unchanged.

**Non-finite elements.** Where a product reads an operand's blocks whole
(`Operand.whole`), a `LowPrecision` quantiser gives its parts by `encode_operand`:
`MXQuantize` then marks a NaN or an infinity NaN at its element alone, with no
reduction over the blocks to find it; every output that reads the block reads
that NaN, so the values are those of the block made NaN.

**Named axes.** A quantiser whose scale spans a tensor (one with an `axis_name`
field: `FloatQuantize(scale="amax")`, `NVFP4Quantize`) is given the names still
bound as collectives (`jax.shard_map`'s), so its scale spans them with one `pmax`
of a scalar.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from .._rules._encoded import Encoded, LowPrecision
from .._rules.blocks import BlockQuantizer
from . import ops, segments
from .hadamard import random_signs, rotate
from .ops import Op, Operand, flatten, unflatten
from .recipes import Product

_DEFAULT, _HIGHEST = jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST


def operand_keys(key: PRNGKeyArray) -> tuple[Array, Array, Array]:
    """A product's keys: its left operand's, its right operand's (independent, so
    that the expectation of a product of two stochastically rounded operands is
    the product of their expectations), and its Hadamard signs'."""
    k = jax.random.split(key, 3)
    return k[0], k[1], k[2]


def product_keys(key: PRNGKeyArray | None) -> tuple[Any, Any, Any]:
    """One key per product (forward, then the two gradient products)."""
    if key is None:
        return None, None, None
    k = jax.random.split(key, 3)
    return k[0], k[1], k[2]


def block_of(q: Any) -> int:
    """The block length `q` needs a blocked length to be a multiple of."""
    return q.block_size if isinstance(q, BlockQuantizer) else 1


def multiple_of(spec: Product) -> int:
    """The least common multiple of the block lengths of `spec`: its quantisers'
    and its Hadamard transform's (1 if none)."""
    return math.lcm(spec.hadamard or 1, block_of(spec.lhs), block_of(spec.rhs))


def pad(v: Array, multiple: int) -> Array:
    """`v` with zeros appended along axis 0 to a multiple of `multiple`."""
    return ops.pad_axis(v, 0, multiple)


def spanning(q: Any, names: tuple[Hashable, ...]) -> Any:
    """`q` with its tensor-wide scale spanning the named axes, if it has one (an
    `axis_name` field) and any are named."""
    if not names or "axis_name" not in {f.name for f in dataclasses.fields(q)}:
        return q
    (first, *rest) = names
    return dataclasses.replace(q, axis_name=names if rest else first)


class Plan(NamedTuple):
    """How a product is computed: `op` is what it contracts (the operation, or
    its `flat` form: with a random Hadamard transform, or a contraction padded in
    place), `prepare` lays each operand out for it (or `None`); `source` is the
    operation itself (`op` unless flattened)."""

    op: Op
    prepare: tuple[Any, Any] | None
    spec: Product
    role: str
    source: Op


def plan(op: Op, spec: Product, lhs_shape: Sequence[int], role: str) -> Plan:
    """The plan of product `role` of `op` with `spec`, for a left operand of
    `lhs_shape` (module docstring: blocks, padding, the Hadamard transform)."""
    multiple = multiple_of(spec)
    blocked = op.operands()[0].blocked
    blocked_length = math.prod(lhs_shape[d] for d in blocked)
    # Without a Hadamard transform, square blocks pad their own two axes (`_fit`),
    # and the other operand its flattened contraction, each sliced back: zeros
    # change no scale, so the contraction need not be padded in place (which
    # square blocks cannot follow).
    if spec.hadamard is None and not (
        op.padded_contraction() and blocked_length % multiple and not _square(spec)
    ):
        return Plan(op, None, spec, role, op)
    flat = op.flat(multiple)
    if flat is None:
        raise ValueError(
            f"`{op.name}`: the {role} product cannot take a random Hadamard "
            f"transform (`hadamard`={spec.hadamard}): it is not a contraction "
            "of its operands, which the transform needs; give that product "
            "`hadamard=None` (e.g. `dataclasses.replace(recipes.nvfp4(), "
            "hadamard=None)`)."
        )
    _no_square(op, spec, role)
    return Plan(flat.op, flat.prepare, spec, role, op)


def _prepared(p: Plan, side: int, v: Array, extras: tuple[Array, ...], keys: Any):
    """Operand `side` laid out for `p.op`, rotated if `p.spec` asks."""
    if p.prepare is not None:
        v = p.prepare[side](v, extras)
    if p.spec.hadamard is not None:
        v = _rotated(v, p.op.operands()[side], keys[2], p.spec.hadamard)
    return v


def operand(
    p: Plan,
    side: int,
    v: Array,
    extras: tuple[Array, ...],
    keys: Any,
    names: tuple[Hashable, ...],
) -> Quantised:
    """Operand `side` (0, 1) of the product `p` quantised as `p.spec` says."""
    q = (p.spec.lhs, p.spec.rhs)[side]
    geometry = p.op.operands()[side]
    v = _prepared(p, side, v, extras, keys)
    return quantise(q, v, geometry, keys[side], extras, names, Where(p.op.name, p.role))


def keys_of(key: Any) -> tuple[Any, Any, Any]:
    """A product's operand keys (`operand_keys`), or `None`s without a key."""
    return (None, None, None) if key is None else operand_keys(key)


def evaluate(
    op: Op,
    spec: Product,
    lhs: Array,
    rhs: Array,
    extras: tuple[Array, ...],
    key: Any,
    names: tuple[Hashable, ...],
    role: str,
) -> Array:
    """The product `op(Q_lhs(lhs), Q_rhs(rhs), *extras)` with the quantisers and
    Hadamard transform of `spec` (the module docstring); `role` names it in
    errors."""
    keys = keys_of(key)
    p = plan(op, spec, lhs.shape, role)
    q_lhs = operand(p, 0, lhs, extras, keys, names)
    q_rhs = operand(p, 1, rhs, extras, keys, names)
    return contract(p.op, q_lhs, q_rhs, extras)


class Quantised(NamedTuple):
    """An operand as a product takes it: `value` times `scale` (a float32 scalar,
    or `None` for 1); with `exact`, `value` is exactly representable in bfloat16
    (`LowPrecision.payload`)."""

    value: Array
    scale: Array | None = None
    exact: bool = False

    def dequantised(self) -> Array:
        return self.value if self.scale is None else self.value * self.scale


def contract(op: Op, a: Quantised, b: Quantised, extras: tuple[Array, ...]) -> Array:
    """`op` on two quantised operands, exact whatever the backend's default matmul
    precision, which it always names. Where both operands are exact in bfloat16
    (`Quantised.exact`), at `Precision.DEFAULT`: a GPU's TF32, a TPU's bfloat16
    pass and a CPU's float32 all hold such values exactly, so every product is
    exact and the float32 accumulation the only rounding, at the backend's
    fastest float32 precision; the tensor scales multiply the output. Otherwise
    at `Precision.HIGHEST`. (Operands cast to bfloat16 would take a GPU's bfloat16
    tensor cores, but XLA's CPU cannot compute every layout of a bfloat16 product
    with a float32 result.)"""
    if a.exact and b.exact:
        out = op(a.value, b.value, *extras, precision=_DEFAULT)
        scales = [s for s in (a.scale, b.scale) if s is not None]
        if scales:
            out = out * (scales[0] if len(scales) == 1 else scales[0] * scales[1])
        return out
    return op(a.dequantised(), b.dequantised(), *extras, precision=_HIGHEST)


def _rotated(v: Array, operand: Operand, key: Any, n: int) -> Array:
    """`v` rotated along what its product contracts by the random Hadamard
    transform of blocks of `n`, its signs drawn from `key`; each index of an
    independent dimension (a ragged product's group) with signs of its own,
    from `fold_in(key, i)`."""
    if not operand.independent:
        return rotate(v, operand.blocked[0], random_signs(key, n))
    dim = operand.independent[0]
    inner = _without(operand, dim)

    def one(slice_: Array, k: Any) -> Array:
        return _rotated(slice_, inner, k, n)

    keys = _keys(key, v.shape[dim])
    return jax.vmap(one, in_axes=(dim, 0), out_axes=dim)(v, keys)


class Where(NamedTuple):
    """The function and the product an operand is quantised for (messages)."""

    name: str
    role: str

    def of(self, v: Array) -> str:
        return (
            f"an operand of shape {tuple(v.shape)} of the {self.role} product of "
            f"`{self.name}`"
        )


def _square(spec: Product) -> bool:
    """Whether a quantiser of `spec` has square blocks."""
    return any(
        isinstance(q, BlockQuantizer) and isinstance(q.axis, tuple)
        for q in (spec.lhs, spec.rhs)
    )


def _no_square(op: Op, spec: Product, role: str) -> None:
    for q in (spec.lhs, spec.rhs):
        if isinstance(q, BlockQuantizer) and isinstance(q.axis, tuple):
            raise ValueError(
                f"`{op.name}`: the {role} product's quantiser {q!r} has square "
                "blocks, which cannot follow the flattening of what the product "
                "contracts (for its random Hadamard transform, or a length its "
                "blocks do not divide): give it blocks along one axis, or the "
                "product `hadamard=None`."
            )


def quantise(
    q: Any,
    v: Array,
    operand: Operand,
    key: Any,
    extras: tuple[Array, ...],
    names: tuple[Hashable, ...],
    where: Where,
) -> Quantised:
    """`v` quantised by `q` as one operand (`operand`) of a product."""
    if q is None:
        return Quantised(v)
    q = spanning(q, names)
    if operand.independent or operand.segmented is not None:
        value, scale = (
            _slices(q, v, operand, key, where)
            if operand.independent
            else _segments(q, v, operand, key, extras[0], where)
        )
        if scale is None:
            return Quantised(value, None, _exact(q))
        # A scale per slice or segment: in the values, which float32 then holds.
        return Quantised(value * scale, None, False)
    return Quantised(*along(q, v, operand, key, where), _exact(q))


def _exact(q: Any) -> bool:
    """Whether `q`'s payload is exact in bfloat16 (`LowPrecision.payload`)."""
    return isinstance(q, LowPrecision) and getattr(q, "exact_payload", True)


def _parts(q: Any, v: Array, key: Any, whole: bool) -> tuple[Array, Array | None]:
    """`(payload, tensor scale)` of `q` at `v` for a `LowPrecision` quantiser (its
    `encode_operand` for a product that reads blocks `whole`), else
    `(q(v), None)`."""
    if isinstance(q, LowPrecision):
        return q.payload(encoded(q, v, key, whole), v)
    return q(v, key=key), None


def encoded(q: LowPrecision, v: Array, key: Any, whole: bool) -> Encoded:
    """`q`'s parts of `v` as an operand of a product: `encode_operand` where the
    product reads each block whole (`Operand.whole`), else `encode`."""
    return q.encode_operand(v, key=key) if whole else q.encode(v, key=key)


def _fit(q: Any, v: Array, operand: Operand, where: Where):
    """`(fitted, prepared, restore)`: `q` fitted to `operand` (its blocks along
    what the product contracts), the array it quantises (`v`, flattened along
    several contracted dimensions and padded with zeros to the block, or padded
    along both axes of square blocks), and how its result goes back to `v`'s
    layout (`_restore`)."""
    if not isinstance(q, BlockQuantizer):
        return q, v, ("as is",)
    described = where.of(v)
    if isinstance(q.axis, tuple):
        if len(operand.blocked) != 1 or len(operand.paired) != 1:
            raise ValueError(
                f"`{where.name}`: the quantiser {q!r} has square blocks, which "
                "need an operand with one contracted and one free dimension beside "
                f"its batch dimensions (a matrix); {where.of(v)} contracts "
                f"{operand.blocked} and keeps {operand.paired}. Give it blocks "
                "along one axis."
            )
        axes = tuple(sorted((operand.blocked[0], operand.paired[0])))
        padded = ops.pad_axis(v, axes[0], q.block_size)
        padded = ops.pad_axis(padded, axes[1], q.block_size)
        fitted = q if q.axis == axes else dataclasses.replace(q, axis=axes)
        return fitted, padded, ("slice", tuple(v.shape))
    dims = operand.blocked
    if len(dims) == 1 and v.shape[dims[0]] % q.block_size == 0:
        fitted = q.for_reduction_axis(dims[0], v.shape[dims[0]], described)
        return fitted, v, ("as is",)
    flat = flatten(v, dims)
    padded = pad(flat, q.block_size)
    fitted = q.for_reduction_axis(0, padded.shape[0], described)
    return fitted, padded, ("flat", tuple(dims), flat.shape[0], tuple(v.shape))


def _restore(value: Array, restore: tuple[Any, ...]) -> Array:
    """A quantiser's result (on `_fit`'s prepared array) in the operand's layout."""
    if restore[0] == "slice":
        return jax.lax.slice(value, (0,) * value.ndim, restore[1])
    if restore[0] == "flat":
        _, dims, n, shape = restore
        return unflatten(value[:n], dims, shape)
    return value


def along(
    q: Any, v: Array, operand: Operand, key: Any, where: Where
) -> tuple[Array, Array | None]:
    """`v` quantised by `q`, a block quantiser's blocks along `operand.blocked`
    (flattened, padded with zeros at the end to a multiple of the block, the
    padding sliced off), or square over the blocked and paired dimensions (each
    padded). An elementwise `q` (per element, or one scale per tensor) takes `v`
    whole. Returns the payload (or value) and the tensor scale."""
    fitted, prepared, restore = _fit(q, v, operand, where)
    value, scale = _parts(fitted, prepared, key, operand.whole)
    return _restore(value, restore), scale


def _without(operand: Operand, dim: int) -> Operand:
    """`operand`'s geometry on a slice of it along `dim` (that dimension gone)."""

    def drop(dims: Sequence[int]) -> tuple[int, ...]:
        return tuple(d - (d > dim) for d in dims if d != dim)

    return Operand(
        drop(operand.blocked),
        drop(operand.paired),
        drop(operand.independent),
        whole=operand.whole,
    )


def _keys(key: Any, n: int) -> Any:
    """`fold_in(key, i)` for `i` in `range(n)` (or `None`)."""
    if key is None:
        return None
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n))


def _slices(
    q: Any, v: Array, operand: Operand, key: Any, where: Where
) -> tuple[Array, Array | None]:
    """Each index of the first independent dimension its own tensor: the values,
    and the tensor scales (one per index, shaped to broadcast along that
    dimension) or `None`."""
    dim = operand.independent[0]
    inner = _without(operand, dim)
    keys = _keys(key, v.shape[dim])

    def one(slice_: Array, k: Any) -> tuple[Array, Array | None]:
        if inner.independent:
            return _slices(q, slice_, inner, k, where)
        return along(q, slice_, inner, k, where)

    in_axes = (dim, 0 if keys is not None else None)
    value, scale = jax.vmap(one, in_axes=in_axes, out_axes=(dim, 0))(v, keys)
    return value, _along_dim(scale, dim, v.ndim)


def _along_dim(scale: Array | None, dim: int, ndim: int) -> Array | None:
    """Scales, one per index of `dim`, shaped to broadcast against an array of
    `ndim` dimensions."""
    if scale is None:
        return None
    return jnp.reshape(scale, (1,) * dim + (-1,) + (1,) * (ndim - dim - 1))


def _segments(
    q: Any, v: Array, operand: Operand, key: Any, sizes: Array, where: Where
) -> tuple[Array, Array | None]:
    """Each segment of rows along `operand.segmented` (consecutive, of lengths
    `sizes`) its own tensor (`segment_layout`), quantised, and put back in place
    (`put_back`). Where each block of `q` is quantised from itself alone
    (`_own_blocks`), the values are the same without the `[groups, P, ...]`
    layout (`g` times `v`'s bytes): with no block along the rows `v` is quantised
    in place; with blocks of a fixed length along them (the weight gradient's),
    on the segments packed, each from a whole block (`segments.packed`)."""
    whole = operand._replace(segmented=None)
    dim = operand.segmented
    assert dim is not None
    own, fixed = _own_blocks(q, v, whole, key, where, dim)
    if own and dim not in operand.blocked:
        return along(q, v, whole, key, where)
    if own and fixed and operand.blocked == (dim,):
        rows, back = segments.packed(v, dim, sizes, block_of(q))
        value, scale = along(q, rows, whole, key, where)
        assert scale is None
        return back(value), None
    per, back, inner = segment_layout(q, v, operand, sizes)
    keys = _keys(key, sizes.shape[0])

    def one(rows: Array, k: Any) -> tuple[Array, Array | None]:
        return along(q, rows, inner, k, where)

    in_axes = (0, 0 if keys is not None else None)
    value, scale = jax.vmap(one, in_axes=in_axes)(per, keys)
    return put_back(value, scale, back)


def _own_blocks(
    q: Any, v: Array, whole: Operand, key: Any, where: Where, dim: int
) -> tuple[bool, bool]:
    """`(own, fixed)`, read from the shapes of `q`'s encoding of `v` (its blocks
    along `whole.blocked`): `own`, each block quantised from itself alone (a
    `LowPrecision` quantiser with no tensor scale, `Encoded.tensor` `None`, and
    no `key`: a segment's draws are its own); `fixed`, its blocks along `dim`
    `block_of(q)` long whatever that length (one scale per block there; not a
    row-wise quantiser's, one block the whole axis; no scales: each element
    alone), so that a block from a multiple of it stays within one segment."""
    if key is not None:
        return False, False
    fitted, prepared, _ = _fit(q, v, whole, where)
    if not isinstance(fitted, LowPrecision):
        return False, False
    e = jax.eval_shape(lambda u: fitted.encode(u), prepared)
    length = prepared.shape[dim]
    fixed = e.scales is None or e.scales.shape[dim] * block_of(q) == length
    return e.tensor is None, fixed


def segment_layout(
    q: Any, v: Array, operand: Operand, sizes: Array
) -> tuple[Array, Any, Operand]:
    """Each segment of rows of `v` along `operand.segmented` laid out from row 0
    and padded with zeros to a multiple of `q`'s block (where its blocks run along
    the rows), `[groups, P, ...]`; the function that puts such a layout back in
    place (`segments.segment`: rows past the segments, which a ragged product reads
    not, come back as some row of the last); and one group's geometry."""
    dim = operand.segmented
    assert dim is not None
    along_rows = dim in operand.blocked
    per, back = segments.segment(v, dim, sizes, block_of(q) if along_rows else 1)
    inner = Operand(
        tuple(0 if d == dim else d + (d < dim) for d in operand.blocked),
        tuple(d + (d < dim) for d in operand.paired),
        whole=operand.whole,
    )
    return per, back, inner


def put_back(
    value: Array, scale: Array | None, back: Any
) -> tuple[Array, Array | None]:
    """Quantised segments (`[groups, P, ...]`, their tensor scales `[groups]` or
    `None`) in place: the values, and each row its group's scale."""
    if scale is None:
        return back(value), None
    # Each row its group's scale, shaped to broadcast against the rows.
    rows_shape = (*value.shape[:2], *(1,) * (value.ndim - 2))
    per_row = jnp.broadcast_to(
        jnp.reshape(scale, (-1,) + (1,) * (value.ndim - 1)), rows_shape
    )
    return back(value), back(per_row)
