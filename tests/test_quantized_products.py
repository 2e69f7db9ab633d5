"""`quantized_dot_general`, `quantized_einsum` and `quantized_conv` against their
statements (issue 26 §1, §5).

- Each product (the value and both cotangents) equals an explicit reference built
  here from the public quantisers (`dataclasses.replace(q, axis=...)`) and the plain
  `lax` operation and its VJP, each operand blocked along the dimensions the table
  below lists for it (written out per case, not derived by the library's code),
  for the identity, `fp8()`, `mxfp8()` and `nvfp4()` recipes, eager and jitted, on
  random and adversarial data. The products agree within twice Higham's float32
  summation bound (two float32 sums of the same quantised terms, in whatever
  order), which any different quantised operand leaves far behind.
- With the identity recipe, value and cotangents equal `lax.dot_general`'s and
  `lax.conv_general_dilated`'s bit for bit.
- Under `vmap`, a mapped `lhs` joins the rows (the batch of a convolution).
- Planted defects beside the checks: blocks along the wrong dimension; the
  input-gradient product reusing the forward's blocking of the kernel; padding that
  is missing or non-zero; a convolution's weight gradient blocked with the batch
  dimension last.
- Bad input: clear errors naming the function.
"""

from __future__ import annotations

import dataclasses
import functools as ft
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lowp_helpers import data, gamma

import eqxrules
from eqxrules import recipes
from eqxrules._lowp import core
from eqxrules._lowp.recipes import reads_key

KEY = jax.random.key(11)
U32 = 2.0**-24
NO_RHT = dataclasses.replace(recipes.nvfp4(), hadamard=None)
RECIPES = {
    "identity": recipes.identity(),
    "fp8": recipes.fp8(),
    "mxfp8": recipes.mxfp8(),
    "nvfp4": recipes.nvfp4(),
}
CONV_RECIPES = {**RECIPES, "nvfp4": NO_RHT}

# (lhs shape, rhs shape, dimension numbers, {product: (lhs dims, rhs dims)}): the
# dimensions each product blocks, in the order they are flattened.
DOT_CASES = {
    "matmul": (
        (64, 64),
        (64, 32),
        (((1,), (0,)), ((), ())),
        {"fwd": ((1,), (0,)), "da": ((1,), (1,)), "db": ((0,), (0,))},
    ),
    # Attention's scores, q·kᵀ per batch: b q d, b k d -> b q k.
    "scores": (
        (2, 32, 64),
        (2, 32, 64),
        (((2,), (2,)), ((0,), (0,))),
        {"fwd": ((2,), (2,)), "da": ((2,), (1,)), "db": ((1,), (1,))},
    ),
    # p·v over a ragged 20 keys (padded): b q k, b k d -> b q d.
    "values": (
        (2, 20, 20),
        (2, 20, 32),
        (((2,), (1,)), ((0,), (0,))),
        {"fwd": ((2,), (1,)), "da": ((2,), (2,)), "db": ((1,), (1,))},
    ),
    # Heads in the middle of q and k, first in the scores (h q k), 16 tokens: the
    # gradient products of blocks of 32 pad, their batch dimension at another
    # position in each operand.
    "heads_middle": (
        (16, 2, 64),
        (16, 2, 64),
        (((2,), (2,)), ((1,), (1,))),
        {"fwd": ((2,), (2,)), "da": ((2,), (0,)), "db": ((0,), (1,))},
    ),
    # Two contracted dimensions, flattened as one; a free length of 4 (padded).
    "two_contracted": (
        (4, 2, 32),
        (2, 32, 32),
        (((1, 2), (0, 1)), ((), ())),
        {"fwd": ((1, 2), (0, 1)), "da": ((1,), (2,)), "db": ((0,), (0,))},
    ),
}

# The axes of `rhs` that square blocks (`recipes.nvfp4()`'s kernel) cover: its
# contracted and free dimension. The other cases (a ragged or flattened
# contraction) take 1x16 blocks (`square_weight_blocks=False`).
SQUARE = {"matmul": (0, 1), "scores": (1, 2), "heads_middle": (0, 2)}
NVFP4_1D = recipes.NVFP4(square_weight_blocks=False)

# (lhs shape, rhs shape, strides, padding, dilations, dimension numbers, groups,
# {product: (lhs dims, rhs dims)}).
CONV_CASES = {
    "2d": (
        (4, 32, 7, 7),
        (32, 32, 3, 3),
        (1, 1),
        "SAME",
        (None, None),
        None,
        1,
        {"fwd": ((1,), (1,)), "da": ((1,), (0,)), "db": ((0, 2, 3), (0, 2, 3))},
    ),
    "1d_nhc_strided": (
        (3, 9, 32),
        (3, 32, 64),
        (2,),
        ((1, 2),),
        ((1,), (2,)),
        ("NHC", "HIO", "NHC"),
        1,
        {"fwd": ((2,), (1,)), "da": ((2,), (2,)), "db": ((0, 1), (0, 1))},
    ),
    "3d_grouped": (
        (2, 64, 3, 4, 4),
        (32, 32, 2, 2, 2),
        (1, 1, 1),
        "VALID",
        (None, None),
        None,
        2,
        {"fwd": ((1,), (1,)), "da": ((1,), (0,)), "db": ((0, 2, 3, 4), (0, 2, 3, 4))},
    ),
}
KINDS = ("random", "zeros", "nan", "pow2")


# The reference, from the statement.


def _block(q) -> int:
    return q.block_size if isinstance(q, eqxrules.BlockQuantizer) else 1


def _flat(v, dims):
    moved = jnp.moveaxis(v, dims, tuple(range(len(dims))))
    return moved.reshape(-1, *moved.shape[len(dims) :]), moved.shape


def _restore(f, dims, moved_shape):
    return jnp.moveaxis(f.reshape(moved_shape), tuple(range(len(dims))), dims)


def _q(q, v, axis, key):
    if q is None:
        return v
    if isinstance(q, eqxrules.BlockQuantizer) and not isinstance(q.axis, tuple):
        q = dataclasses.replace(q, axis=axis)
    return q(v, key=key)


def _square(q, axes):
    return dataclasses.replace(q, axis=axes)


def _dot_operands(spec, lhs, rhs, dims, key, squares):
    """The two quantised operands of one product of a contraction: each padded with
    zeros at the end of its (single) blocked dimension to the product's multiple,
    or flattened along several, rotated if asked, quantised along it."""
    keys = [None] * 3 if key is None else list(jax.random.split(key, 3))
    multiple = math.lcm(spec.hadamard or 1, _block(spec.lhs), _block(spec.rhs))
    signs = None
    if spec.hadamard is not None:
        signs = jax.random.rademacher(keys[2], (spec.hadamard,), jnp.float32)
    out = []
    for q, v, d, k, square in zip(
        (spec.lhs, spec.rhs), (lhs, rhs), dims, keys[:2], squares
    ):
        if isinstance(q, eqxrules.BlockQuantizer) and isinstance(q.axis, tuple):
            out.append(_square(q, square)(v, key=k))
            continue
        if len(d) == 1:
            extra = -v.shape[d[0]] % multiple
            widths = [(0, 0)] * v.ndim
            widths[d[0]] = (0, extra)
            v = jnp.pad(v, widths)
            if signs is not None:
                v = _rotate_ref(v, d[0], signs)
            out.append(_q(q, v, d[0], k))
        else:
            f, shape = _flat(v, d)
            assert f.shape[0] % multiple == 0
            if signs is not None:
                f = _rotate_ref(f, 0, signs)
            out.append(_restore(_q(q, f, 0, k), d, shape))
    return out


def _rotate_ref(a, axis, signs):
    from lowp_helpers import rotate as written

    return written(a, axis, signs)


def _dot_reference(recipe, lhs, rhs, dy, dn, blocked, square, key):
    p = recipe.products()
    keys = [None] * 3 if key is None else list(jax.random.split(key, 3))

    def dot(a, b):
        return jax.lax.dot_general(a, b, dn, preferred_element_type=jnp.float32)

    sq = {"fwd": (None, square), "da": (None, square), "db": (None, None)}
    a, b = _dot_operands(p.fwd, lhs, rhs, blocked["fwd"], keys[0], sq["fwd"])
    y = dot(a, b)
    g, b = _dot_operands(p.dx, dy, rhs, blocked["da"], keys[1], sq["da"])
    da = jax.vjp(lambda t: dot(t, b), lhs)[1](g)[0]
    a, g = _dot_operands(p.dw, lhs, dy, blocked["db"], keys[2], sq["db"])
    db = jax.vjp(lambda t: dot(a, t), rhs)[1](g)[0]
    return y, (a, b), da, db


def _padded_operand(q, v, dims, key, square):
    """`v` quantised along `dims`: in place along one dimension its block divides,
    else flattened, padded with zeros at the end to the block, quantised, the
    padding sliced off."""
    if q is None:
        return v
    if isinstance(q, eqxrules.BlockQuantizer) and isinstance(q.axis, tuple):
        return _square(q, square)(v, key=key)
    if len(dims) == 1 and v.shape[dims[0]] % _block(q) == 0:
        return _q(q, v, dims[0], key)
    f, shape = _flat(v, dims)
    n = f.shape[0]
    f = jnp.pad(f, [(0, -n % _block(q))] + [(0, 0)] * (f.ndim - 1))
    return _restore(_q(q, f, 0, key)[:n], dims, shape)


def _conv_reference(recipe, lhs, rhs, dy, conv, blocked, square, key):
    p = recipe.products()
    keys = [None] * 3 if key is None else list(jax.random.split(key, 3))

    def operands(spec, a, b, dims, k, squares):
        ka = kb = None
        if k is not None:
            ka, kb, _ = jax.random.split(k, 3)
        return (
            _padded_operand(spec.lhs, a, dims[0], ka, squares[0]),
            _padded_operand(spec.rhs, b, dims[1], kb, squares[1]),
        )

    a, b = operands(p.fwd, lhs, rhs, blocked["fwd"], keys[0], (None, square))
    y = conv(a, b)
    g, b = operands(p.dx, dy, rhs, blocked["da"], keys[1], (None, square))
    da = jax.vjp(lambda t: conv(t, b), lhs)[1](g)[0]
    a, g = operands(p.dw, lhs, dy, blocked["db"], keys[2], (None, None))
    db = jax.vjp(lambda t: conv(a, t), rhs)[1](g)[0]
    return y, da, db


def _bound(f, lhs, rhs, dy):
    """Twice Higham's float32 bound on each product, from the absolute values of
    the operands' contraction (its length at most the operands' sizes)."""
    n = lhs.size + rhs.size + dy.size
    y = f(jnp.abs(lhs), jnp.abs(rhs))
    pull = jax.vjp(f, jnp.abs(lhs), jnp.abs(rhs))[1](jnp.abs(dy))
    # The bound of a float32 sum of n terms, applied to the sums of |terms|
    # (themselves float32 sums, hence the (1 + γ)).
    c = 2 * gamma(n, U32) * (1 + gamma(n, U32))
    return [c * np.asarray(v, np.float64) for v in (y, *pull)]


def _far(actual, expected, bound) -> int:
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    nan = np.isnan(expected)
    with np.errstate(invalid="ignore"):
        far = np.abs(actual - expected) > np.nan_to_num(bound, nan=np.inf)
    return int(np.sum(np.where(nan, ~np.isnan(actual), far | np.isnan(actual))))


def _data(shapes, kind):
    return [jnp.asarray(data(kind, s, i)) for i, s in enumerate(shapes)]


def _vjp(f, lhs, rhs, dy):
    y, pull = jax.vjp(f, lhs, rhs)
    return (y, *pull(dy))


def _dot_call(recipe, dn, key):
    return lambda a, b: eqxrules.quantized_dot_general(a, b, dn, recipe=recipe, key=key)


def _out_shape(f, lhs, rhs):
    return jax.eval_shape(f, lhs, rhs).shape


def _dot_failures(recipe, name, kind, *, jit, run=None):
    return _dot_failures_of(recipe, name, (kind,), jit=jit, run=run)[kind]


def _dot_failures_of(recipe, name, kinds, *, jit, run=None):
    """For each data kind, the elements of the value and both cotangents farther
    from the reference than the bound. Ours and the reference are each traced once
    per call, for every kind (the same shapes), and again at the next call, so that
    a planted defect (a patched helper of the core) is traced."""
    lhs_shape, rhs_shape, dn, blocked = DOT_CASES[name]
    if recipe is RECIPES["nvfp4"] and name not in SQUARE:
        recipe = NVFP4_1D
    key = KEY if reads_key(recipe.products()) else None
    plain = ft.partial(jax.lax.dot_general, dimension_numbers=dn)
    f = ft.partial(_vjp, _dot_call(run or recipe, dn, key))
    ours = jax.jit(f) if jit else f
    reference = eqx.filter_jit(ft.partial(_dot_reference, recipe))
    square = SQUARE.get(name)
    out = {}
    for kind in kinds:
        lhs, rhs = _data((lhs_shape, rhs_shape), kind)
        dy = _data([_out_shape(plain, lhs, rhs)], kind)[0]
        got = ours(lhs, rhs, dy)
        y, _, da, db = reference(lhs, rhs, dy, dn, blocked, square, key)
        out[kind] = _failures(got, (y, da, db), _bound(plain, lhs, rhs, dy))
    return out


def _failures(got, expected, bounds):
    names = ("y", "da", "db")
    return {
        n: _far(g, e, b)
        for n, g, e, b in zip(names, got, expected, bounds)
        if _far(g, e, b)
    }


def _conv(case):
    _, _, strides, padding, (ld, rd), dn, groups, _ = CONV_CASES[case]

    def conv(a, b):
        return jax.lax.conv_general_dilated(
            a,
            b,
            strides,
            padding,
            lhs_dilation=ld,
            rhs_dilation=rd,
            dimension_numbers=dn,
            feature_group_count=groups,
            preferred_element_type=jnp.float32,
        )

    def quantized(recipe, key):
        return lambda a, b: eqxrules.quantized_conv(
            a,
            b,
            strides,
            padding,
            lhs_dilation=ld,
            rhs_dilation=rd,
            dimension_numbers=dn,
            feature_group_count=groups,
            recipe=recipe,
            key=key,
        )

    return conv, quantized


def _conv_failures(recipe, name, kind, *, jit, run=None):
    return _conv_failures_of(recipe, name, (kind,), jit=jit, run=run)[kind]


def _conv_failures_of(recipe, name, kinds, *, jit, run=None):
    """`_dot_failures_of` for a convolution."""
    lhs_shape, rhs_shape, *_, blocked = CONV_CASES[name]
    conv, quantized = _conv(name)
    key = KEY if reads_key(recipe.products()) else None
    f = ft.partial(_vjp, quantized(run or recipe, key))
    ours = jax.jit(f) if jit else f
    reference = eqx.filter_jit(ft.partial(_conv_reference, recipe, conv=conv))
    out = {}
    for kind in kinds:
        lhs, rhs = _data((lhs_shape, rhs_shape), kind)
        dy = _data([_out_shape(conv, lhs, rhs)], kind)[0]
        got = ours(lhs, rhs, dy)
        spec = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, CONV_CASES[name][5])
        square = (spec.rhs_spec[0], spec.rhs_spec[1])
        expected = reference(lhs, rhs, dy, blocked=blocked, square=square, key=key)
        out[kind] = _failures(got, expected, _bound(conv, lhs, rhs, dy))
    return out


# Every case jitted; eagerly (op by op, one compiled program per product), the
# first case of each family, every recipe.
_DOT_RUNS = [
    (case, recipe, jit)
    for jit in (True, False)
    for case in (DOT_CASES if jit else ["matmul"])
    for recipe in [r for r in RECIPES if r != "identity"]
]
_CONV_RUNS = [
    (case, recipe, jit)
    for jit in (True, False)
    for case in (CONV_CASES if jit else ["2d"])
    for recipe in [r for r in CONV_RECIPES if r != "identity"]
]


@pytest.mark.first_case_quick
@pytest.mark.parametrize("case, recipe, jit", _DOT_RUNS)
def test_dot_general_products_equal_the_reference(case, recipe, jit):
    kinds = KINDS if jit else ("random",)
    failures = _dot_failures_of(RECIPES[recipe], case, kinds, jit=jit)
    assert failures == dict.fromkeys(kinds, {})


@pytest.mark.first_case_quick
@pytest.mark.parametrize("case, recipe, jit", _CONV_RUNS)
def test_conv_products_equal_the_reference(case, recipe, jit):
    kinds = KINDS if jit else ("random",)
    r = CONV_RECIPES[recipe]
    failures = _conv_failures_of(r, case, kinds, jit=jit)
    assert failures == dict.fromkeys(kinds, {})


def _in_float32(f):
    """`f` on float32 copies of its operands, rounded once to their dtype: for
    bfloat16, `lax`'s operation where XLA accumulates in float32, as the core
    does. (On the CPU, jaxlib 0.12 accumulates a bfloat16 `dot` whose operand it
    first transposes, a batch dimension not leading, in bfloat16, rounding after
    every term: issue 40. For float32 this is `f` itself.)"""

    def g(a, b):
        return f(a.astype(jnp.float32), b.astype(jnp.float32)).astype(a.dtype)

    return g


def _identity_mismatches(recipe, jit, conv=True):
    """The cases (and dtypes) where `recipe`'s products, value and cotangents, are
    not `lax`'s bit for bit (in float32; for bfloat16, as `_in_float32` says)."""
    run = jax.jit(_vjp, static_argnums=0) if jit else _vjp
    mismatched = []
    for name, (ls, rs, dn, _) in DOT_CASES.items():
        lhs, rhs = _data((ls, rs), "random")
        plain = ft.partial(jax.lax.dot_general, dimension_numbers=dn)
        dy = _data([_out_shape(plain, lhs, rhs)], "random")[0]
        for dtype in (jnp.float32, jnp.bfloat16):
            args = [v.astype(dtype) for v in (lhs, rhs, dy)]
            got = run(_dot_call(recipe, dn, None), *args)
            want = run(_in_float32(plain), *args)
            if not all(np.array_equal(g, w) for g, w in zip(got, want)):
                mismatched.append((name, dtype))
    for name in CONV_CASES if conv else ():
        conv_, quantized = _conv(name)
        lhs, rhs = _data(CONV_CASES[name][:2], "random")
        dy = _data([_out_shape(conv_, lhs, rhs)], "random")[0]
        got = run(quantized(recipe, None), lhs, rhs, dy)
        want = run(conv_, lhs, rhs, dy)
        if not all(np.array_equal(g, w) for g, w in zip(got, want)):
            mismatched.append(name)
    return mismatched


@pytest.mark.first_case_quick
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_the_identity_recipe_is_lax_bit_for_bit(jit):
    assert _identity_mismatches(recipes.identity(), jit) == []


def test_planted_rounding_in_the_identity_recipe_is_caught():
    """Planted: the weight gradient's cotangent rounded (to e5m2), in float32 and
    bfloat16 alike."""
    product = recipes.Product(rhs=eqxrules.FloatQuantize(format="e5m2"))
    planted = recipes.Custom(dw=product)
    dtypes = (jnp.float32, jnp.bfloat16)
    want = [(name, dtype) for name in DOT_CASES for dtype in dtypes]
    assert _identity_mismatches(planted, jit=True, conv=False) == want


def test_einsum_is_dot_general_transposed():
    q, k = _data(((2, 4, 16, 32), (2, 4, 16, 32)), "random")
    p, v = _data(((2, 4, 16, 16), (2, 4, 16, 32)), "random")
    r = recipes.mxfp8()
    scores = eqxrules.quantized_einsum("bhqd,bhkd->bhqk", q, k, recipe=r)
    general = eqxrules.quantized_dot_general(
        q, k, (((3,), (3,)), ((0, 1), (0, 1))), recipe=r
    )
    assert np.array_equal(scores, general)
    # The output in another order than dot_general's: a transpose of it.
    out = eqxrules.quantized_einsum("bhqk,bhkd->bdhq", p, v, recipe=r)
    general = eqxrules.quantized_dot_general(
        p, v, (((3,), (2,)), ((0, 1), (0, 1))), recipe=r
    )
    assert np.array_equal(out, jnp.transpose(general, (0, 3, 1, 2)))
    # The identity recipe: jnp.einsum within float32 summation bounds.
    ident = eqxrules.quantized_einsum(
        "bhqk,bhkd->bdhq", p, v, recipe=recipes.identity()
    )
    want = jnp.einsum("bhqk,bhkd->bdhq", p, v)
    bound = 2 * gamma(16, U32) * jnp.einsum("bhqk,bhkd->bdhq", jnp.abs(p), jnp.abs(v))
    assert bool(jnp.all(jnp.abs(ident - want) <= bound))


@pytest.mark.slow
def test_vmap_joins_the_rows():
    """A mapped `lhs` is one more free dimension of `lhs` (dot_general) or joins
    the batch (conv): gradients equal those of one call on the whole batch."""
    r = recipes.mxfp8()
    x, w = _data(((3, 5, 64), (64, 32)), "random")
    dn = (((1,), (0,)), ((), ()))
    one = jax.grad(
        lambda w: jax.vmap(
            lambda xi: eqxrules.quantized_dot_general(xi, w, dn, recipe=r)
        )(x).sum()
    )(w)
    whole = jax.grad(
        lambda w: eqxrules.quantized_dot_general(
            x, w, (((2,), (0,)), ((), ())), recipe=r
        ).sum()
    )(w)
    assert np.array_equal(one, whole)
    xs, k = _data(((3, 4, 32, 9), (32, 32, 3)), "random")

    def conv(x, k):
        return eqxrules.quantized_conv(x, k, (1,), "SAME", recipe=r)

    mapped = jax.vjp(lambda x, k: jax.vmap(lambda xi: conv(xi, k))(x), xs, k)
    batch = jax.vjp(lambda x, k: conv(x.reshape(12, 32, 9), k), xs, k)
    dy = _data([(3, 4, 32, 9)], "random")[0]
    got = (mapped[0], *mapped[1](dy))
    want = (batch[0].reshape(3, 4, 32, 9), *batch[1](dy.reshape(12, 32, 9)))
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


@pytest.mark.slow
def test_vmap_over_both_operands_is_one_batched_product():
    """Attention's q and k, both per example: the mapped axis is one more batch
    dimension, never blocked across; with block quantisers, each example's
    products are those of its own call."""
    r = recipes.mxfp8()
    q, k = _data(((5, 16, 2, 64), (5, 16, 2, 64)), "random")

    def f(a, b):
        return eqxrules.quantized_einsum("qhd,khd->hqk", a, b, recipe=r)

    dy = _data([(5, 2, 16, 16)], "random")[0]
    got = _vjp(jax.vmap(f), q, k, dy)
    each = [_vjp(f, q[i], k[i], dy[i]) for i in range(5)]
    assert all(
        np.array_equal(g, np.stack([e[j] for e in each])) for j, g in enumerate(got)
    )


# Planted defects: each must make the check above fail.


class _NextAxis(eqxrules.MXQuantize):
    """MX blocks along the axis after the one asked for (cyclically)."""

    def for_reduction_axis(self, axis, length, where):
        return dataclasses.replace(self, axis=axis - 1)


@pytest.mark.slow
def test_planted_blocks_along_the_wrong_dimension_are_caught():
    wrong = _NextAxis(format="e4m3", block_size=32)
    product = recipes.Product(wrong, wrong)
    planted = recipes.Custom(fwd=product, dx=product, dw=product)
    honest = recipes.mxfp8()
    assert set(_dot_failures(honest, "matmul", "random", jit=True, run=planted)) == {
        "y",
        "da",
        "db",
    }


@pytest.fixture
def planted(fresh_products):
    """`monkeypatch`, the core's products traced again (`fresh_products`)."""
    return fresh_products


@pytest.mark.slow
def test_planted_forward_blocking_in_the_input_gradient_is_caught(planted):
    """The input-gradient product's kernel blocked along the input features (as
    the forward's), where the recipe says along the output features."""
    honest = core.Conv.blocked

    def forward_kernel(self, role):
        lhs, rhs = honest(self, role)
        return (lhs, honest(self, "fwd")[1]) if role == "da" else (lhs, rhs)

    planted.setattr(core.Conv, "blocked", forward_kernel)
    failures = _conv_failures(recipes.mxfp8(), "2d", "random", jit=True)
    assert set(failures) == {"da"}


@pytest.mark.slow
def test_planted_batch_last_in_the_conv_weight_gradient_is_caught(planted):
    """The weight-gradient blocks with the batch flattened last, across the batch
    dimension numbers' order."""
    honest = core.Conv.blocked

    def batch_last(self, role):
        lhs, rhs = honest(self, role)
        if role == "db":
            return (*lhs[1:], lhs[0]), (*rhs[1:], rhs[0])
        return lhs, rhs

    planted.setattr(core.Conv, "blocked", batch_last)
    failures = _conv_failures(recipes.mxfp8(), "2d", "random", jit=True)
    assert set(failures) == {"db"}


@pytest.mark.slow
@pytest.mark.parametrize("fill", [1e3, None], ids=["non-zero", "missing"])
def test_planted_padding_is_caught(planted, fill):
    """The conv's weight-gradient product over 4·7·7 = 196 positions, in blocks of
    32: padded with a large value (the last block's scale changes), or not at all
    (the quantiser refuses the length)."""
    honest = core.pad

    def padding(v, multiple):
        if fill is None:
            return v
        rows = honest(v, multiple).shape[0] - v.shape[0]
        return jnp.pad(v, [(0, rows)] + [(0, 0)] * (v.ndim - 1), constant_values=fill)

    planted.setattr(core, "pad", padding)
    if fill is None:
        with pytest.raises(ValueError, match="must divide"):
            _conv_failures(recipes.mxfp8(), "2d", "random", jit=True)
    else:
        assert set(_conv_failures(recipes.mxfp8(), "2d", "random", jit=True)) == {"db"}


@pytest.mark.slow
def test_the_planted_fixture_alone_passes(planted):
    """The planted fixture with the honest helpers passes the cases the planted
    defects fail, so the failures are theirs."""
    assert _conv_failures(recipes.mxfp8(), "2d", "random", jit=True) == {}


# Bad input.


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda: eqxrules.quantized_dot_general(
                jnp.ones((4, 8)),
                jnp.ones((8, 2)),
                (((0,), (0,)), ((), ())),
                recipe=recipes.identity(),
            ),
            ValueError,
            r"`quantized_dot_general`: `dimension_numbers` \(=.*\) do not fit",
        ),
        (
            lambda: eqxrules.quantized_dot_general(
                jnp.ones((4, 8)), jnp.ones((8, 2)), "ij", recipe=recipes.identity()
            ),
            ValueError,
            r"`quantized_dot_general`: `dimension_numbers` \(='ij'\) must be",
        ),
        (
            lambda: eqxrules.quantized_einsum(
                "ij,jk", jnp.ones((4, 8)), jnp.ones((8,)), recipe=recipes.identity()
            ),
            ValueError,
            r"`quantized_einsum`: `subscripts` \(='ij,jk'\) gives `rhs` 2 axes",
        ),
        (
            lambda: eqxrules.quantized_einsum(
                "ii,ij->j",
                jnp.ones((4, 4)),
                jnp.ones((4, 2)),
                recipe=recipes.identity(),
            ),
            ValueError,
            r"repeats a label within `lhs`",
        ),
        (
            lambda: eqxrules.quantized_einsum(
                "ij,jk->k",
                jnp.ones((4, 8)),
                jnp.ones((8, 2)),
                recipe=recipes.identity(),
            ),
            ValueError,
            r"label 'i' is in one operand only",
        ),
        (
            lambda: eqxrules.quantized_einsum(
                "...j,jk", jnp.ones((4, 8)), jnp.ones((8, 2)), recipe=recipes.identity()
            ),
            ValueError,
            r"no ellipsis",
        ),
        (
            lambda: eqxrules.quantized_einsum(
                1, jnp.ones((4, 8)), jnp.ones((8, 2)), recipe=recipes.identity()
            ),
            TypeError,
            r"`quantized_einsum`: `subscripts` \(=1\) must be a string",
        ),
        (
            lambda: eqxrules.quantized_conv(
                jnp.ones((2, 32, 8, 8)),
                jnp.ones((16, 32, 3, 3)),
                (1, 1),
                "SAME",
                recipe=recipes.nvfp4(),
                key=KEY,
            ),
            ValueError,
            r"`quantized_conv`: the recipe's `dw` product asks for a random Hadamard",
        ),
        (
            lambda: eqxrules.quantized_conv(
                jnp.ones((2, 48, 8, 8)),
                jnp.ones((32, 48, 3, 3)),
                (1, 1),
                "SAME",
                recipe=recipes.mxfp8(),
            ),
            ValueError,
            r"`quantized_conv`: the forward product reduces the input features "
            r"\(=48\), which its `lhs` \(the input, in blocks of 32\) must divide",
        ),
        (
            lambda: eqxrules.quantized_conv(
                jnp.ones((2, 32, 8, 8)),
                jnp.ones((40, 32, 3, 3)),
                (1, 1),
                "SAME",
                recipe=recipes.mxfp8(),
            ),
            ValueError,
            r"`quantized_conv`: the input-gradient product reduces the output "
            r"features \(=40\)",
        ),
        (
            lambda: eqxrules.quantized_conv(
                jnp.ones((2, 32, 8, 8)),
                jnp.ones((32, 32, 3)),
                (1, 1),
                "SAME",
                recipe=recipes.mxfp8(),
            ),
            ValueError,
            r"`quantized_conv`: `lhs` \(shape \(2, 32, 8, 8\)\) and `rhs` \(shape "
            r"\(32, 32, 3\)\) must have the same rank",
        ),
        (
            lambda: eqxrules.quantized_conv(
                jnp.ones((2, 32, 8, 8)),
                jnp.ones((32, 32, 3, 3)),
                (1,),
                "SAME",
                recipe=recipes.mxfp8(),
            ),
            ValueError,
            r"`quantized_conv`: `window_strides` \(=\(1,\)\) must be 2 positive ints",
        ),
        (
            lambda: eqxrules.quantized_conv(
                jnp.ones((2, 32, 8, 8), jnp.int32),
                jnp.ones((32, 32, 3, 3)),
                (1, 1),
                "SAME",
                recipe=recipes.mxfp8(),
            ),
            TypeError,
            r"`quantized_conv` expects a floating-point array for `lhs`",
        ),
        (
            lambda: eqxrules.quantized_conv(
                jnp.ones((2, 32, 8, 8)),
                jnp.ones((32, 32, 3, 3)),
                (1, 1),
                "SAME",
                recipe=NO_RHT,
            ),
            TypeError,
            r"`quantized_conv`: `recipe` draws random numbers \(dx.lhs, dw.rhs\)",
        ),
    ],
)
def test_bad_input_is_a_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()
