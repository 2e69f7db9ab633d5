"""`quantized_ragged_dot` against its statement (issue 38 §4): the loop over groups
of quantised products, each group's rows and matrix tensors of their own.

The reference is written out here, group by group, with the public quantisers and
`lax.dot_general`: group `i`'s rows, laid out from row 0 and padded with zeros to
a multiple of the block where blocks run along them (the weight gradient), each
operand quantised as the recipe says along what its product contracts, with keys
`fold_in(k, i)` of the product's operand keys; `rhs[i]` likewise. The products
agree within twice Higham's float32 bound. With the identity recipe the value and
cotangents are `lax.ragged_dot`'s and its VJP's bit for bit; traced group sizes
(empty groups included) run in one compiled program.

Planted beside them: blocks straddling two groups (the weight gradient's rows
blocked across the whole `lhs`), a per-tensor scale shared by all groups, and
group offsets off by one; each caught.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lowp_helpers import gamma

import eqxrules
from eqxrules import recipes
from eqxrules._lowp import quantise, segments

KEY = jax.random.key(3)
HIGHEST = jax.lax.Precision.HIGHEST
U32 = 2.0**-24
M, K, N, G = 64, 32, 32, 4
RECIPES = {
    "fp8": recipes.fp8(),
    "mxfp8": recipes.mxfp8(),
    "nvfp4": recipes.nvfp4(),
}
SIZES = {"uneven": (20, 0, 30, 10), "one": (0, 64, 0, 0), "short": (5, 7, 0, 3)}


def _data(seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(k[0], (M, K))
    rhs = jax.random.normal(k[1], (G, K, N)) / 6
    dy = jax.random.normal(k[2], (M, N))
    return lhs, rhs, dy


def _vjp(recipe, lhs, rhs, sizes, dy, key):
    def f(a, b):
        return eqxrules.quantized_ragged_dot(a, b, sizes, recipe=recipe, key=key)

    y, pull = jax.vjp(f, lhs, rhs)
    return (y, *pull(dy))


# The reference.


def _q(q, v, axis, key):
    """`v` quantised by `q`, a block quantiser's blocks along `axis`, `v` padded
    with zeros along it to the block first (and the padding sliced off)."""
    if q is None:
        return v
    if isinstance(q, eqxrules.BlockQuantizer):
        if isinstance(q.axis, tuple):  # square blocks over the matrix
            return q(v, key=key)
        n = v.shape[axis]
        widths = [(0, 0)] * v.ndim
        widths[axis] = (0, -n % q.block_size)
        padded = dataclasses.replace(q, axis=axis)(jnp.pad(v, widths), key=key)
        return jax.lax.slice_in_dim(padded, 0, n, axis=axis)
    return q(v, key=key)


def _keys(key):
    """A product's operand keys, per group `fold_in(k, i)`."""
    if key is None:
        return lambda i: (None, None, None)
    k = jax.random.split(key, 3)
    return lambda i: tuple(jax.random.fold_in(kk, i) for kk in k)


def _rotate(v, axis, signs):
    from lowp_helpers import rotate

    return rotate(v, axis, signs)


def reference(recipe, lhs, rhs, sizes, dy, key):
    """`(y, dlhs, drhs)` by the loop over groups."""
    p = recipe.products()
    product_keys = [None] * 3 if key is None else list(jax.random.split(key, 3))
    y = jnp.zeros((M, N))
    da = jnp.zeros((M, K))
    db = []
    start = 0
    for i, size in enumerate(sizes):
        rows = slice(start, start + size)
        a, g = lhs[rows], dy[rows]
        k_fwd, k_dx, k_dw = (_keys(k)(i) for k in product_keys)
        # Forward: along k.
        qa = _q(p.fwd.lhs, a, 1, k_fwd[0])
        qb = _q(p.fwd.rhs, rhs[i], 0, k_fwd[1])
        y = y.at[rows].set(qa @ qb)
        # Input gradient: along n.
        qg = _q(p.dx.lhs, g, 1, k_dx[0])
        qb = _q(p.dx.rhs, rhs[i], 1, k_dx[1])
        da = da.at[rows].set(qg @ qb.T)
        # Weight gradient: along the group's rows, padded to the block.
        multiple = quantise.multiple_of(p.dw)
        padded = -(-max(size, 1) // multiple) * multiple
        a_p = jnp.zeros((padded, K)).at[:size].set(a)
        g_p = jnp.zeros((padded, N)).at[:size].set(g)
        if p.dw.hadamard is not None:
            signs = jax.random.rademacher(k_dw[2], (p.dw.hadamard,), jnp.float32)
            a_p, g_p = _rotate(a_p, 0, signs), _rotate(g_p, 0, signs)
        qa = _q(p.dw.lhs, a_p, 0, k_dw[0])
        qg = _q(p.dw.rhs, g_p, 0, k_dw[1])
        db.append(qa.T @ qg)
        start += size
    return y, da, jnp.stack(db)


def _bound(lhs, rhs, sizes, dy):
    """Twice Higham's bound on each output: two float32 sums of the same quantised
    terms differ by at most `2γ_n Σ|terms|`. A quantiser keeps each element within
    twice its tensor's largest magnitude, so `Σ|terms| <= 4 n A B` with `A`, `B`
    the operands' largest magnitudes: 4 times the product of constant operands
    `A` and `B` (computed in float32, so within `1 + γ` of it)."""
    n = M + K + N
    c = 2 * gamma(n, U32) * (1 + gamma(n, U32)) * 4
    big = [jnp.max(jnp.abs(v)) for v in (lhs, rhs, dy)]
    ones = [jnp.ones_like(v) * b for v, b in zip((lhs, rhs, dy), big)]
    plain = _vjp(recipes.identity(), *ones[:2], jnp.asarray(sizes), ones[2], None)
    return [c * np.asarray(v, np.float64) for v in plain]


def _failures(recipe, sizes, seed=0) -> dict[str, int]:
    lhs, rhs, dy = _data(seed)
    key = KEY
    gs = jnp.asarray(sizes, jnp.int32)
    # A new function each call: traced again, so that a planted defect is.
    got = jax.jit(lambda *args: _vjp(recipe, *args))(lhs, rhs, gs, dy, key)
    want = reference(recipe, lhs, rhs, sizes, dy, key)
    out = {}
    for name, g, w, b in zip(
        ("y", "dlhs", "drhs"), got, want, _bound(lhs, rhs, sizes, dy)
    ):
        far = int(np.sum(np.abs(np.asarray(g, np.float64) - np.asarray(w)) > b))
        if far:
            out[name] = far
    return out


@pytest.mark.first_case_quick
@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_products_are_the_loop_over_groups(recipe, sizes):
    assert _failures(RECIPES[recipe], SIZES[sizes]) == {}


def test_the_identity_recipe_is_lax_ragged_dot_bit_for_bit():
    lhs, rhs, dy = _data()
    for sizes in SIZES.values():
        gs = jnp.asarray(sizes, jnp.int32)
        got = _vjp(recipes.identity(), lhs, rhs, gs, dy, None)
        # At the precision the products name for float32 operands (a GPU's
        # default is TF32).
        y, pull = jax.vjp(
            lambda a, b: jax.lax.ragged_dot(a, b, gs, precision=HIGHEST), lhs, rhs
        )
        for a, b in zip(got, (y, *pull(dy))):
            assert np.array_equal(a, b), sizes


def test_traced_group_sizes_run_in_one_program():
    lhs, rhs, dy = _data()
    run = jax.jit(lambda gs: _vjp(recipes.mxfp8(), lhs, rhs, gs, dy, None))
    outs = [run(jnp.asarray(s, jnp.int32)) for s in SIZES.values()]
    assert run._cache_size() == 1
    assert all(np.isfinite(np.asarray(v)).all() for out in outs for v in out)


def test_nvfp4_draws_from_its_key():
    lhs, rhs, dy = _data()
    gs = jnp.asarray(SIZES["uneven"], jnp.int32)
    run = jax.jit(_vjp, static_argnums=0)
    one, two = (
        run(recipes.nvfp4(), lhs, rhs, gs, dy, k) for k in (KEY, jax.random.key(4))
    )
    assert np.array_equal(one[0], two[0])  # the forward product draws nothing
    assert not np.array_equal(one[1], two[1]) and not np.array_equal(one[2], two[2])


# Planted defects.


@pytest.fixture
def planted(fresh_products):
    return fresh_products


@pytest.mark.slow
def test_planted_packed_segments_off_their_blocks_are_caught(planted):
    """The packed layout of the weight gradient's rows (`segments.packed`, a block
    quantiser keeping nothing per tensor) with each group from any row, not from
    a multiple of the block: a block then straddles two groups."""
    honest = segments.packed
    planted.setattr(
        segments, "packed", lambda v, dim, sizes, multiple: honest(v, dim, sizes, 1)
    )
    floor = recipes.MXFP8(scale_rounding="floor")
    assert "drhs" in _failures(floor, SIZES["uneven"])


@pytest.mark.slow
def test_planted_blocks_straddling_two_groups_are_caught(planted):
    """The weight gradient's rows blocked along the whole `lhs` (groups not laid
    out each from row 0)."""
    honest = segments.segment

    def straddling(v, dim, sizes, multiple):
        per, back = honest(v, dim, sizes, multiple)
        whole = jnp.moveaxis(v, dim, 0)
        length = per.shape[1]
        flat = jnp.pad(
            whole, [(0, length - whole.shape[0])] + [(0, 0)] * (whole.ndim - 1)
        )
        mask = jnp.arange(per.shape[0])[:, None] == 0
        shifted = jnp.where(mask.reshape(-1, 1, *(1,) * (v.ndim - 1)), flat[None], per)
        return shifted, back

    planted.setattr(segments, "segment", straddling)
    # The OCP floor rule: mxfp8()'s scales, rounded up, saturate nothing, so which
    # block a row lands in hardly moves its value (the defect went unseen).
    floor = recipes.MXFP8(scale_rounding="floor")
    assert "drhs" in _failures(floor, SIZES["uneven"])


@pytest.mark.slow
def test_planted_scale_shared_by_all_groups_is_caught(planted):
    """Each group's rows quantised as one tensor with the others (`fp8()`'s one
    scale per tensor then spans every group)."""
    planted.setattr(
        quantise,
        "_segments",
        lambda q, v, operand, key, sizes, where: quantise.along(
            q, v, operand._replace(segmented=None), key, where
        ),
    )
    assert _failures(RECIPES["fp8"], SIZES["uneven"]) != {}


@pytest.mark.slow
def test_planted_group_offsets_off_by_one_are_caught(planted):
    honest = segments.segment

    def shifted(v, dim, sizes, multiple):
        return honest(v, dim, jnp.maximum(sizes - 1, 0).at[0].add(1), multiple)

    planted.setattr(segments, "segment", shifted)
    assert _failures(RECIPES["mxfp8"], SIZES["uneven"]) != {}


@pytest.mark.slow  # beside the planted defects it clears (12 s of compiling)
def test_the_planted_fixture_alone_passes(planted):
    assert _failures(RECIPES["mxfp8"], SIZES["uneven"]) == {}


# Bad input.


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        (
            (jnp.ones((8, 4)), jnp.ones((2, 4, 3)), jnp.ones(2)),
            {},
            TypeError,
            r"`quantized_ragged_dot`: `group_sizes` \(=.*\) must be an array of integers",
        ),
        (
            (jnp.ones((8, 4)), jnp.ones((4, 3)), jnp.ones(2, jnp.int32)),
            {},
            ValueError,
            r"`rhs` \(shape \(4, 3\)\) must be 3-D",
        ),
        (
            (jnp.ones((8, 4)), jnp.ones((2, 4, 3)), jnp.ones(3, jnp.int32)),
            {},
            ValueError,
            r"`group_sizes` \(shape \(3,\)\) must have one entry per group",
        ),
        (
            (jnp.ones((8, 5)), jnp.ones((2, 4, 3)), jnp.ones(2, jnp.int32)),
            {},
            ValueError,
            r"`lhs` \(shape \(8, 5\)\) must be `\[m, k\]` with k = 4",
        ),
        (
            (jnp.ones((8, 16)), jnp.ones((2, 16, 16)), jnp.ones(2, jnp.int32)),
            {"recipe": recipes.nvfp4()},
            TypeError,
            r"`quantized_ragged_dot`: `recipe` draws random numbers .* pass `key=`",
        ),
    ],
)
def test_bad_input_is_a_clear_error(args, kwargs, error, match):
    kwargs = {"recipe": recipes.identity(), **kwargs}
    with pytest.raises(error, match=match):
        eqxrules.quantized_ragged_dot(*args, **kwargs)
