"""The draws of `check_unbiased`, made on the device in one scan over chunks of
draws, reduced to counts per element as they go: `_draw` against neighbours or a
range given, `_draw_seen` against the two values the draws themselves take."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp


def _keys(key, draws: int, chunk: int):
    """`jax.random.split(key, draws)` in `(chunks, chunk)`: draw i has key i whatever
    the chunk; the last chunk is padded with keys already used, whose draws are
    masked out."""
    chunks = -(-draws // chunk)
    keys = jax.random.split(key, draws)
    keys = jnp.concatenate([keys, keys[: chunks * chunk - draws]])
    return keys.reshape((chunks, chunk) + keys.shape[1:]), jnp.arange(chunks) * chunk


def _counts(up, stray, chunk: int):
    """Per element, the draws `up` and the draws `stray` of a chunk, in one pass
    (drawing dominates, and each pass re-reads the draws): a chunk has at most
    `chunk` of each, so both share an int32 (`chunk` is at most 2^15)."""
    code = jnp.sum(up + stray * jnp.int32(chunk + 1), 0, dtype=jnp.int32)
    return code % (chunk + 1), code // (chunk + 1)


def _record(q, x, stray, found, example, spill):
    """The largest stray draw of the chunk (where there is one) and the strays'
    sum of `q - x` added to `spill`. Only a failing rounding has stray draws:
    `jax.lax.cond` spares correct ones the passes."""

    def record(example, spill):
        seen = jnp.max(jnp.where(stray, q, -jnp.inf), 0)
        spill = spill + jnp.sum(jnp.where(stray, q - x, 0), 0)
        return jnp.where(found > 0, seen, example), spill

    return jax.lax.cond(jnp.any(found > 0), record, lambda *a: a, example, spill)


@eqx.filter_jit
def _draw(fn, x, lo, hi, key, draws: int, chunk: int, exact: bool):
    """One scan over chunks of `chunk` draws (the draws past `draws` in the last
    chunk masked out). Per element: the draws equal to `hi` (with `exact`, where
    `lo < hi`), the stray draws, the largest stray value and the sum of the stray
    draws' `q - x`; without `exact`, also each chunk's sum of `q - x`."""
    keys, starts = _keys(key, draws, chunk)

    def body(carry, inputs):
        ups, strays, example, spill = carry
        keys, start = inputs
        q = jax.vmap(fn, in_axes=(None, 0))(x, keys).astype(lo.dtype)
        valid = (start + jnp.arange(chunk) < draws).reshape((chunk,) + (1,) * x.ndim)
        sums = None
        if exact:
            stray = ~((q == hi) | (q == lo)) & valid
            up, found = _counts((q == hi) & (lo < hi) & valid, stray, chunk)
            ups = ups + up
        else:
            stray = ~((q >= lo) & (q <= hi)) & valid
            found = jnp.sum(stray, 0, dtype=jnp.int32)
            sums = jnp.sum(jnp.where(valid, q - x, 0), 0)
        example, spill = _record(q, x, stray, found, example, spill)
        return (ups, strays + found, example, spill), sums

    zeros = jnp.zeros(x.shape, jnp.int32)
    nothing = jnp.zeros(x.shape, lo.dtype)
    init = (zeros, zeros, jnp.full(x.shape, jnp.nan, lo.dtype), nothing)
    return jax.lax.scan(body, init, (keys, starts))


@eqx.filter_jit
def _draw_seen(fn, x, key, draws: int, chunk: int, dtype):
    """One scan like `_draw`'s, against the values drawn: per element, the least
    and the largest finite draw so far, `lo` and `hi`; the draws equal to `lo`
    (`downs`), those equal to `hi` where `hi > lo` (`ups`); and every other draw (a
    third value, or not finite) a stray, with the largest stray value and their
    sum of `q - x`. When `lo` or `hi` moves, the draws counted at the old one
    become strays unless it is still `lo` or `hi`: so at the end, `downs + ups +
    strays = draws`, and `strays = 0` exactly when at most two values were drawn.
    """
    keys, starts = _keys(key, draws, chunk)
    wide = x.astype(dtype)

    def body(carry, inputs):
        lo, hi, downs, ups, strays, example, spill = carry
        keys, start = inputs
        q = jax.vmap(fn, in_axes=(None, 0))(x, keys).astype(dtype)
        index = start + jnp.arange(chunk)
        valid = (index < draws).reshape((chunk,) + (1,) * x.ndim)
        ok = valid & jnp.isfinite(q)
        new_lo = jnp.minimum(lo, jnp.min(jnp.where(ok, q, jnp.inf), 0))
        new_hi = jnp.maximum(hi, jnp.max(jnp.where(ok, q, -jnp.inf), 0))
        two = new_lo < new_hi
        # The draws counted so far: at `lo` (all of them while `lo == hi`), and at
        # `hi > lo`. `lo` can become the new `hi` only from `lo == hi`.
        lo_stays, lo_rises = lo == new_lo, (lo == new_hi) & two
        hi_stays = hi == new_hi
        lost_lo = jnp.where(lo_stays | lo_rises, 0, downs)
        lost_hi = jnp.where(hi_stays, 0, ups)
        carried_down = jnp.where(lo_stays, downs, 0)
        carried_up = jnp.where(lo_rises, downs, 0) + jnp.where(hi_stays, ups, 0)
        at_hi = ok & (q == new_hi) & two
        stray = valid & ~(ok & (q == new_lo)) & ~at_hi
        up, found = _counts(at_hi, stray, chunk)
        counted = jnp.clip(draws - start, 0, chunk).astype(jnp.int32)
        example = jnp.where(lost_lo > 0, lo, jnp.where(lost_hi > 0, hi, example))
        spill = spill + jnp.where(lost_lo > 0, lost_lo * (lo - wide), 0)
        spill = spill + jnp.where(lost_hi > 0, lost_hi * (hi - wide), 0)
        example, spill = _record(q, wide, stray, found, example, spill)
        return (
            new_lo,
            new_hi,
            carried_down + counted - up - found,
            carried_up + up,
            strays + lost_lo + lost_hi + found,
            example,
            spill,
        ), None

    zeros = jnp.zeros(x.shape, jnp.int32)
    init = (
        jnp.full(x.shape, jnp.inf, dtype),
        jnp.full(x.shape, -jnp.inf, dtype),
        zeros,
        zeros,
        zeros,
        jnp.full(x.shape, jnp.nan, dtype),
        jnp.zeros(x.shape, dtype),
    )
    return jax.lax.scan(body, init, (keys, starts))[0]
