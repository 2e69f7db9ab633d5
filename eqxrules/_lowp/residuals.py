r"""The quantised core's custom VJP with its residuals in their formats (issue 41
§2): the forward pass quantises, besides its own product's operands, the left
operand of the weight-gradient product (`a`, blocked along what that product
contracts: the rows), and keeps it for the backward pass as its codes and scales
in their formats' dtypes (`Saved`, `LowPrecision.stored`), where 0.2 kept `a`
whole. The weight `b` is kept as it is (it lives on anyway); of `a` the backward
pass needs nothing else but its type (`Like`: shape, dtype, sharding, varying
mesh axes).

What is kept, in bytes of `a`'s float32 bytes (`tests/test_residuals.py`,
`benchmarks/` section 15):

- `fp8()`: E4M3 codes, 0.25; `fp8_rowwise()`: and an int8 exponent per column,
    0.2501;
- `mxfp8()`: E4M3 codes and an int8 exponent per block of 32, 0.258; `mxfp4()`:
    E2M1 codes, a byte each as JAX stores `float4_e2m1fn`, 0.258;
- `nvfp4()`: E2M1 codes and an E4M3 scale per block of 16, 0.266;
- `fp8_blockwise()`: E4M3 codes and a float32 scale per tile of 128, 0.258.
- A ragged product (`quantized_ragged_dot`) quantises each group's rows as a
    tensor of their own, laid out from row 0 (`[g, P, k]`); it keeps each group's
    codes and block scales one group after another (`_pack`), in a buffer sized
    for any split of the rows (`_bound`): each group's rows (the codes), or its
    rows rounded up to the Hadamard transform's block where the transform rotates
    the padding into values the product reads (`nvfp4()`, `mxfp4()`), and its
    blocks (the scales). So at most $g(B - 1)$ rows more than `a`'s: at 3 groups
    of [100, 200, 212] rows, fp8 0.25, mxfp8 0.259, nvfp4 0.282, mxfp4 0.290.
- Not in formats: a quantiser that is not a `LowPrecision` one (an integer grid,
    `SteQuantize`; a user's function) has no codes narrower than float32, so its
    float32 value is kept (as many bytes as `a`; for a ragged product with a
    Hadamard transform, its groups' padded layout, `g·P` rows: a group's padding
    may quantise to other values than zero there, which a product reads); and so
    is a ragged product's operand whose quantiser's blocks do not run along the
    rows (square blocks).

The values and gradients are bit for bit those of computing every product in
the backward pass (the same quantised operands, the same products). This is the
VJP of every call but one under a `jax.vmap` that `axis_name` names (there the
weight-gradient product's blocks span the batch, which the forward pass of one
example cannot quantise: `core._Bilinear`, which keeps `a`).
"""

from __future__ import annotations

import functools as ft
from collections.abc import Hashable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._rules._encoded import Encoded, LowPrecision
from .._tangents import _cotangent_like, _vary, varying_axes
from . import quantise, segments
from .core import product
from .ops import Op
from .quantise import (
    Plan,
    Quantised,
    Where,
    _along_dim,
    _exact,
    _fit,
    _keys,
    _prepared,
    _restore,
    _without,
    encoded,
    keys_of,
    multiple_of,
    operand,
    plan,
    product_keys,
    put_back,
    segment_layout,
    spanning,
)
from .recipes import Custom

_F32 = jnp.float32


class Config(eqx.Module):
    """What the VJP computes: `op` with the products of `recipe`, per-tensor
    scales spanning the collective axes `spanned`. Static (hashable)."""

    op: Op = eqx.field(static=True)
    recipe: Custom = eqx.field(static=True)
    spanned: tuple[Hashable, ...] = eqx.field(static=True)


class Like(eqx.Module):
    """The type of an array the backward pass needs but not its values: its
    shape, dtype, explicit sharding (or `None`) and varying `shard_map` axes."""

    shape: tuple[int, ...] = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)
    sharding: Any = eqx.field(static=True)
    varying: tuple[str, ...] = eqx.field(static=True)

    @classmethod
    def of(cls, v: Array) -> Like:
        typeof = getattr(jax, "typeof", None)
        sharding = None if typeof is None else getattr(typeof(v), "sharding", None)
        if sharding is not None and getattr(sharding, "mesh", None) is not None:
            sharding = None if sharding.mesh.empty else sharding
        varying = tuple(sorted(varying_axes(v)))
        return cls(tuple(v.shape), v.dtype, sharding, varying)

    def zeros(self, dtype: Any = None) -> Array:
        """Zeros of this type (for a linear transpose's point, and a cotangent's
        type)."""
        z = jnp.zeros(self.shape, self.dtype if dtype is None else dtype)
        if self.sharding is not None:
            z = jax.sharding.reshard(z, self.sharding)
        return _vary(z, self.varying) if self.varying else z


@ft.partial(jax.custom_vjp, nondiff_argnums=(0,))
def bilinear(config: Config, a: Array, b: Array, key: Any, extras: Any) -> Array:
    """`config.op(a, b, *extras)` with the products of `config.recipe`."""
    return _forward(config, a, b, key, extras)


def _forward(config: Config, a: Array, b: Array, key: Any, extras: Any) -> Array:
    k = product_keys(key)
    a32, b32 = a.astype(_F32), b.astype(_F32)
    fwd = product(config.op, "fwd", config.recipe.fwd, (), config.spanned)
    y = fwd(a32, b32, extras, None, k[0], ())
    return y.astype(jnp.result_type(a, b))


def _fwd(config: Config, a: Array, b: Array, key: Any, extras: Any):
    y = _forward(config, a, b, key, extras)
    kept = _keep(config)(a.astype(_F32), b.astype(_F32), extras, key)
    return y, (kept, b, key, extras, Like.of(a))


@ft.cache
def _keep(config: Config) -> Any:
    """The weight-gradient product's left operand, quantised and kept (one
    compiled program eagerly, traced in place under `jit`)."""

    def keep(a: Array, b: Array, extras: Any, key: Any) -> Saved:
        dw = config.op.transpose("dw", b)
        p = plan(dw, config.recipe.dw, a.shape, "dw")
        keys = keys_of(product_keys(key)[2])
        return saved_operand(p, 0, a, extras, keys, config.spanned)

    return jax.jit(keep, inline=True)


@ft.cache
def _weight_gradient(config: Config) -> Any:
    """The weight-gradient product from its kept left operand."""

    def run(kept: Saved, dy: Array, extras: Any, b: Array, key: Any, like: Like):
        dw = config.op.transpose("dw", b)
        p = plan(dw, config.recipe.dw, like.shape, "dw")
        keys = keys_of(product_keys(key)[2])
        q_dy = operand(p, 1, dy, extras, keys, config.spanned)
        return quantise.contract(p.op, loaded(kept, extras), q_dy, extras)

    return jax.jit(run, inline=True)


def _bwd(config: Config, residuals: Any, dy: Array) -> tuple[Any, ...]:
    kept, b, key, extras, like = residuals
    k = product_keys(key)
    b32, dy32 = b.astype(_F32), dy.astype(_F32)
    a_like = like.zeros(_F32)
    dx = product(config.op, "dx", config.recipe.dx, (), config.spanned)
    da = dx(dy32, b32, extras, a_like, k[1], ())
    db = _weight_gradient(config)(kept, dy32, extras, b32, key, like)
    da = _cotangent_like(da, like.zeros())
    db = _cotangent_like(db, b)
    return da, db, None, None


bilinear.defvjp(_fwd, _bwd)


# The kept operand.


class Groups(NamedTuple):
    """How a ragged product's kept operand lies (`Saved.groups`; static): each
    group's rows rounded up to `multiple` (1: its own rows; the Hadamard
    transform's multiple where its padding was rotated too) in the codes, one
    after another, and its blocks of `per_scale` rows in the scales; `rows` is
    the operand's (a bound on the groups' rows together); `codes` and `scales`
    the parts' shapes in one group's layout; `segments` is `(dim, shape)` of an
    operand whose rows go back in place (`quantise.put_back`), or `None` where
    the product takes the groups' layout itself (`[g, P, ...]`)."""

    multiple: int
    per_scale: int
    rows: int
    codes: tuple[int, ...]
    scales: tuple[int, ...] | None
    segments: tuple[int, tuple[int, ...]] | None


class Saved(eqx.Module):
    """An operand quantised in the forward pass and kept for the backward pass.
    Where the quantiser is a `LowPrecision` one, `parts` are its codes and scales
    in their formats' dtypes (`LowPrecision.stored`: a quarter of the float32
    bytes, or an eighth), and `quantiser` is the quantiser fitted to one tensor of
    `shape` (the operand, or one group's rows, `groups`); else `parts` are
    `(value, scale)` as `quantise.operand` gives them and `quantiser` is `None`."""

    parts: Any
    quantiser: Any = eqx.field(static=True)
    shape: tuple[int, ...] = eqx.field(static=True)
    restore: tuple[Any, ...] = eqx.field(static=True)
    exact: bool = eqx.field(static=True)
    groups: Groups | None = eqx.field(static=True, default=None)


def saved_operand(
    p: Plan,
    side: int,
    v: Array,
    extras: tuple[Array, ...],
    keys: Any,
    names: tuple[Hashable, ...],
) -> Saved:
    """`quantise.operand`, kept in its format (`Saved`): a tensor's codes and
    scales; a ragged product's groups' (`_grouped`); or, for a quantiser that is
    not a `LowPrecision` one, or a layout neither covers, the float32 value."""
    q = (p.spec.lhs, p.spec.rhs)[side]
    geometry = p.op.operands()[side]
    if isinstance(q, LowPrecision):
        q = spanning(q, names)
        where = Where(p.op.name, p.role)
        if geometry.independent == () and geometry.segmented is None:
            u = _prepared(p, side, v, extras, keys)
            fitted, prepared, restore = _fit(q, u, geometry, where)
            assert isinstance(fitted, LowPrecision)
            e = encoded(fitted, prepared, keys[side], geometry.whole)
            shape = tuple(prepared.shape)
            return Saved(fitted.stored(e), fitted, shape, restore, _exact(fitted))
        if p.source.operands()[side].segmented is not None:
            kept = _grouped(p, side, q, v, extras, keys, where)
            if kept is not None:
                return kept
    value, scale, exact = operand(p, side, v, extras, keys, names)
    return Saved((value, scale), None, tuple(v.shape), ("as is",), exact)


def _grouped(
    p: Plan,
    side: int,
    q: LowPrecision,
    v: Array,
    extras: tuple[Array, ...],
    keys: Any,
    where: Where,
) -> Saved | None:
    """A ragged product's operand (its rows in groups of `extras[0]` rows, each a
    tensor of its own) kept in its format: each group quantised as `quantise`
    does it, on its rows laid out from row 0 (`[g, P, ...]`), and of each group
    only the codes of its rows and the scales of its blocks, one group after
    another (`_pack`): not the `g·P` rows of that layout. The parts follow the
    rows where the quantiser's blocks run along them (axis 0): its codes are then
    in the rows' order (the blocks split in place, `_to_blocks`) and axis 0 of its
    scales runs along the rows, a block of them each. `None` where they do not."""
    sizes = extras[0]
    segmented = p.source.operands()[side].segmented
    assert segmented is not None
    rows = v.shape[segmented]
    u = _prepared(p, side, v, extras, keys)
    geometry = p.op.operands()[side]
    if p.prepare is None:  # rows in place: `quantise._segments`
        per, _, inner = segment_layout(q, u, geometry, sizes)
        multiple, segments = 1, (segmented, tuple(u.shape))
    elif geometry.independent == (0,):  # laid out per group: `quantise._slices`
        per, inner = u, _without(geometry, 0)
        multiple, segments = multiple_of(p.spec), None
    else:
        return None
    fitted, _, restore = _fit(q, per[0], inner, where)
    if restore != ("as is",) or getattr(fitted, "axis", 0) != 0:
        return None
    assert isinstance(fitted, LowPrecision)
    group_keys = _keys(keys[side], per.shape[0])

    def one(rows: Array, k: Any) -> Encoded:
        return encoded(fitted, rows, k, inner.whole)

    in_axes = (0, 0 if group_keys is not None else None)
    # Packed before `stored`: a gather of the float32 codes (exact values of
    # their format), not of 8-bit ones, which XLA's CPU gathers through float16.
    e = jax.vmap(one, in_axes=in_axes)(per, group_keys)
    g, length = per.shape[:2]
    codes = e.codes.reshape(g, length, -1)
    per_scale = 1 if e.scales is None else length // e.scales.shape[1]
    groups = Groups(
        multiple,
        per_scale,
        rows,
        tuple(e.codes.shape[1:]),
        None if e.scales is None else tuple(e.scales.shape[1:]),
        segments,
    )
    parts = Encoded(
        _pack(codes, _entries(sizes, multiple, 1), _bound(groups, 1, length, g)),
        None
        if e.scales is None
        else _pack(
            e.scales,
            _entries(sizes, multiple, per_scale),
            _bound(groups, per_scale, e.scales.shape[1], g),
        ),
        e.tensor,
    )
    parts = fitted.stored(parts)
    return Saved(parts, fitted, tuple(per.shape[1:]), restore, _exact(q), groups)


def _entries(sizes: Array, multiple: int, per_entry: int) -> Array:
    """How many entries of `per_entry` rows each group keeps: its rows rounded up
    to `multiple`, in whole entries."""
    rows = -(-sizes // multiple) * multiple
    return -(-rows // per_entry)


def _bound(groups: Groups, per_entry: int, length: int, g: int) -> int:
    """The most entries `_entries` gives the `g` groups together, whatever their
    sizes (summing to at most `groups.rows`), and at most `length` each: with
    $M$ = `multiple` and $r$ = `per_entry`, $\\sum_i \\lceil s_i / M \\rceil \\le
    \\lfloor (m + g(M - 1)) / M \\rfloor$ where $r$ divides $M$, else
    $\\sum_i \\lceil n_i / r \\rceil \\le \\lfloor (m + g(M - 1) + g(r - 1)) / r
    \\rfloor$."""
    m, multiple = groups.rows, groups.multiple
    if multiple % per_entry == 0:
        bound = multiple // per_entry * ((m + g * (multiple - 1)) // multiple)
    else:
        bound = (m + g * (multiple - 1) + g * (per_entry - 1)) // per_entry
    return max(1, min(g * length, bound))


def _pack(layout: Array, counts: Array, total: int) -> Array:
    """The first `counts[i]` entries of each group's `layout[i]` (`[g, L, ...]`),
    one group after another, in `total` entries (`[total, ...]`; those past the
    groups' are some entry of the last)."""
    g, length = layout.shape[:2]
    ends = jnp.cumsum(counts)
    j = jnp.arange(total)
    group = segments.group_of(ends, j)
    local = jnp.clip(j - (ends - counts)[group], 0, length - 1)
    return layout[group, local]


def _unpack(packed: Array, counts: Array, length: int) -> Array:
    """`_pack`'s inverse, `[g, length, ...]`: zeros past each group's entries
    (the codes of the zero rows there, and a scale under which zero codes are
    zero)."""
    starts = jnp.cumsum(counts) - counts
    local = jnp.arange(length)
    total = packed.shape[0]
    valid = local[None, :] < counts[:, None]
    # Past its entries, a group reads an entry of zeros appended to `packed`: a
    # select on the `[g, length]` indices, not on the `[g, length, ...]` values.
    index = jnp.where(
        valid, jnp.clip(starts[:, None] + local[None, :], 0, total - 1), total
    )
    zero = jnp.zeros((1, *packed.shape[1:]), packed.dtype)
    return jnp.concatenate([packed, zero])[index]


def loaded(s: Saved, extras: tuple[Array, ...]) -> Quantised:
    """The operand a `Saved` keeps, as a product takes it."""
    if s.quantiser is None:
        value, scale = s.parts
        return Quantised(value, scale, s.exact)
    like = jax.ShapeDtypeStruct(s.shape, jnp.float32)
    if s.groups is None:
        e = s.quantiser.restored(s.parts)
        value, scale = s.quantiser.payload(e, like)
        return Quantised(_restore(value, s.restore), scale, s.exact)
    groups, sizes = s.groups, extras[0]
    if groups.segments is not None and groups.multiple == groups.per_scale == 1:
        return _in_place(s, sizes)
    g, length = sizes.shape[0], s.shape[0]
    codes = _unpack(s.parts.codes, _entries(sizes, groups.multiple, 1), length)
    scales = s.parts.scales
    if scales is not None:
        scales = _unpack(
            scales,
            _entries(sizes, groups.multiple, groups.per_scale),
            length // groups.per_scale,
        )
    stored = Encoded(codes.reshape(g, *groups.codes), scales, s.parts.tensor)
    e = s.quantiser.restored(stored)
    value, scale = jax.vmap(lambda e: s.quantiser.payload(e, like))(e)
    value = jax.vmap(lambda v: _restore(v, s.restore))(value)
    if groups.segments is not None:  # as `quantise._segments`
        dim, shape = groups.segments
        back = segments.segment(jnp.zeros(shape, jnp.float32), dim, sizes, length)[1]
        value, scale = put_back(value, scale, back)
    else:  # as `quantise._slices`
        scale = _along_dim(scale, 0, value.ndim)
    # As `quantise.quantise` takes them: a scale per group in the values.
    if scale is None:
        return Quantised(value, None, s.exact)
    return Quantised(value * scale, None, False)


def _in_place(s: Saved, sizes: Array) -> Quantised:
    """`loaded` where a group keeps each of its rows' codes and scales (no rows
    rounded up, a scale per row or none: `Groups.multiple` and `per_scale` 1): the
    packed parts are then the rows' own, in the rows' order (`_pack` takes row
    $r$ of group $i$ from entry $r - o_i$ of its layout; rows past every group
    read the last group's zeros), so `_unpack` and `put_back` together are the
    identity on them. The same values, bit for bit, without the `[g, P, ...]`
    layout; each row times its group's tensor scale (`LowPrecision.payload`'s
    `t`, the group's `Encoded.tensor`)."""
    groups = s.groups
    assert groups is not None and groups.segments is not None
    dim, _ = groups.segments
    parts = s.parts
    stored = Encoded(parts.codes.reshape(groups.codes), parts.scales, None)
    like = jax.ShapeDtypeStruct(s.shape, _F32)
    value, _ = s.quantiser.payload(s.quantiser.restored(stored), like)
    value = jnp.moveaxis(_restore(value, s.restore), 0, dim)
    if parts.tensor is None:
        return Quantised(value, None, s.exact)
    rows = segments.group_of(jnp.cumsum(sizes), jnp.arange(value.shape[dim]))
    shape = (1,) * dim + (-1,) + (1,) * (value.ndim - dim - 1)
    return Quantised(value * parts.tensor[rows].reshape(shape), None, False)
