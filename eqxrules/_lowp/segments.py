r"""Segments of rows: a ragged product's groups (consecutive rows, of traced
sizes) laid out for quantising each as a tensor of its own, and put back in
place."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array


def group_of(ends: Array, positions: Array) -> Array:
    """The group of each of `positions` (rows, or entries) in consecutive groups
    ending at `ends` (`cumsum` of their sizes); positions past every group in the
    last. (`searchsorted` comparing each position with every end: one fused
    elementwise pass, where its default binary search is a `while` loop, a
    sequential launch per step on a GPU.)"""
    group = jnp.searchsorted(ends, positions, side="right", method="compare_all")
    return jnp.clip(group, 0, len(ends) - 1)


def segment(v: Array, dim: int, sizes: Array, multiple: int):
    """`v`'s segments of rows along `dim`, each laid out from row 0 and padded with
    zeros: `[groups, P, ...]` with the rows first (`P` the length of `dim` rounded
    up to `multiple`); and the function that puts such a layout back in place.
    (Rows past every segment come back as some row of the last: a ragged
    product reads none of them.)"""
    rows = jnp.moveaxis(v, dim, 0)
    m = rows.shape[0]
    length = -(-m // multiple) * multiple
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    local = jnp.arange(length)
    index = starts[:, None] + local[None, :]
    valid = local[None, :] < sizes[:, None]
    taken = jnp.take(rows, jnp.clip(index, 0, m - 1), axis=0)
    mask = valid.reshape(*valid.shape, *(1,) * (rows.ndim - 1))
    per = jnp.where(mask, taken, jnp.zeros((), taken.dtype))

    def back(layout: Array) -> Array:
        r = jnp.arange(m)
        group = group_of(ends, r)
        out = layout[group, jnp.clip(r - starts[group], 0, length - 1)]
        return jnp.moveaxis(out, 0, dim)

    return per, back


def packed(v: Array, dim: int, sizes: Array, multiple: int):
    r"""`v`'s segments of rows along `dim` packed one after another, each from a
    row that is a multiple of `multiple` (the rows before it zeros): `[L, ...]`
    with the rows first, $L = m + g(M - 1)$ rounded up to $M$ = `multiple`
    (enough for any sizes: $\sum_i \lceil s_i / M \rceil M \le m + g(M - 1)$);
    and the function that puts such a layout back in place. A block of `multiple`
    rows from a multiple of it then lies within one segment and its zeros, as in
    `segment`'s `[groups, P, ...]` layout, in `1 + g(M - 1)/m` of `v`'s bytes, not
    `g` times. (Rows past every segment come back as some row: a ragged product
    reads none of them.)"""
    rows = jnp.moveaxis(v, dim, 0)
    m, g = rows.shape[0], sizes.shape[0]
    length = -(-(m + g * (multiple - 1)) // multiple) * multiple
    padded = -(-sizes // multiple) * multiple
    offsets = jnp.cumsum(padded) - padded
    starts = jnp.cumsum(sizes) - sizes
    position = jnp.arange(length)
    group = jnp.searchsorted(
        jnp.cumsum(padded), position, side="right", method="compare_all"
    )
    clipped = jnp.clip(group, 0, g - 1)
    local = position - offsets[clipped]
    valid = (group < g) & (local < sizes[clipped])
    taken = jnp.take(rows, jnp.clip(starts[clipped] + local, 0, m - 1), axis=0)
    mask = valid.reshape(-1, *(1,) * (rows.ndim - 1))
    out = jnp.where(mask, taken, jnp.zeros((), taken.dtype))

    def back(layout: Array) -> Array:
        r = jnp.arange(m)
        own = group_of(jnp.cumsum(sizes), r)
        place = jnp.clip(offsets[own] + r - starts[own], 0, length - 1)
        return jnp.moveaxis(jnp.take(layout, place, axis=0), 0, dim)

    return out, back
