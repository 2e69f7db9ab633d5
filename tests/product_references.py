"""The explicit references of the quantised products (`tests/test_quantized_products.py`):
each operand blocked along the dimensions the case tables list for it (written
out per case, not derived by the library's code), quantised by the public
quantisers (`dataclasses.replace(q, axis=...)`), and the plain `lax` operation and
its VJP; the float32 summation bound within which two sums of the same quantised
terms agree; and the cases.
"""

from __future__ import annotations

import dataclasses
import functools as ft
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from lowp_helpers import data, gamma

import eqxrules
from eqxrules import recipes
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
        {"fwd": ((1,), (0,)), "dx": ((1,), (1,)), "dw": ((0,), (0,))},
    ),
    # Attention's scores, q·kᵀ per batch: b q d, b k d -> b q k.
    "scores": (
        (2, 32, 64),
        (2, 32, 64),
        (((2,), (2,)), ((0,), (0,))),
        {"fwd": ((2,), (2,)), "dx": ((2,), (1,)), "dw": ((1,), (1,))},
    ),
    # p·v over a ragged 20 keys (padded): b q k, b k d -> b q d.
    "values": (
        (2, 20, 20),
        (2, 20, 32),
        (((2,), (1,)), ((0,), (0,))),
        {"fwd": ((2,), (1,)), "dx": ((2,), (2,)), "dw": ((1,), (1,))},
    ),
    # Heads in the middle of q and k, first in the scores (h q k), 16 tokens: the
    # gradient products of blocks of 32 pad, their batch dimension at another
    # position in each operand.
    "heads_middle": (
        (16, 2, 64),
        (16, 2, 64),
        (((2,), (2,)), ((1,), (1,))),
        {"fwd": ((2,), (2,)), "dx": ((2,), (0,)), "dw": ((0,), (1,))},
    ),
    # Two contracted dimensions, flattened as one; a free length of 4 (padded).
    "two_contracted": (
        (4, 2, 32),
        (2, 32, 32),
        (((1, 2), (0, 1)), ((), ())),
        {"fwd": ((1, 2), (0, 1)), "dx": ((1,), (2,)), "dw": ((0,), (0,))},
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
        {"fwd": ((1,), (1,)), "dx": ((1,), (0,)), "dw": ((0, 2, 3), (0, 2, 3))},
    ),
    "1d_nhc_strided": (
        (3, 9, 32),
        (3, 32, 64),
        (2,),
        ((1, 2),),
        ((1,), (2,)),
        ("NHC", "HIO", "NHC"),
        1,
        {"fwd": ((2,), (1,)), "dx": ((2,), (2,)), "dw": ((0, 1), (0, 1))},
    ),
    "3d_grouped": (
        (2, 64, 3, 4, 4),
        (32, 32, 2, 2, 2),
        (1, 1, 1),
        "VALID",
        (None, None),
        None,
        2,
        {"fwd": ((1,), (1,)), "dx": ((1,), (0,)), "dw": ((0, 2, 3, 4), (0, 2, 3, 4))},
    ),
}
KINDS = ("random", "zeros", "nan", "pow2")


# The reference, from the statement.


def block(q) -> int:
    return q.block_size if isinstance(q, eqxrules.BlockQuantizer) else 1


def flat(v, dims):
    moved = jnp.moveaxis(v, dims, tuple(range(len(dims))))
    return moved.reshape(-1, *moved.shape[len(dims) :]), moved.shape


def restore(f, dims, moved_shape):
    return jnp.moveaxis(f.reshape(moved_shape), tuple(range(len(dims))), dims)


def quantise_axis(q, v, axis, key):
    if q is None:
        return v
    if isinstance(q, eqxrules.BlockQuantizer) and not isinstance(q.axis, tuple):
        q = dataclasses.replace(q, axis=axis)
    return q(v, key=key)


def square_blocks(q, axes):
    return dataclasses.replace(q, axis=axes)


def dot_operands(spec, lhs, rhs, dims, key, squares):
    """The two quantised operands of one product of a contraction: each padded with
    zeros at the end of its (single) blocked dimension to the product's multiple,
    or flattened along several, rotated if asked, quantised along it."""
    keys = [None] * 3 if key is None else list(jax.random.split(key, 3))
    multiple = math.lcm(spec.hadamard or 1, block(spec.lhs), block(spec.rhs))
    signs = None
    if spec.hadamard is not None:
        signs = jax.random.rademacher(keys[2], (spec.hadamard,), jnp.float32)
    out = []
    for q, v, d, k, square in zip(
        (spec.lhs, spec.rhs), (lhs, rhs), dims, keys[:2], squares
    ):
        if isinstance(q, eqxrules.BlockQuantizer) and isinstance(q.axis, tuple):
            out.append(square_blocks(q, square)(v, key=k))
            continue
        if len(d) == 1:
            extra = -v.shape[d[0]] % multiple
            widths = [(0, 0)] * v.ndim
            widths[d[0]] = (0, extra)
            v = jnp.pad(v, widths)
            if signs is not None:
                v = rotate_reference(v, d[0], signs)
            out.append(quantise_axis(q, v, d[0], k))
        else:
            f, shape = flat(v, d)
            assert f.shape[0] % multiple == 0
            if signs is not None:
                f = rotate_reference(f, 0, signs)
            out.append(restore(quantise_axis(q, f, 0, k), d, shape))
    return out


def rotate_reference(a, axis, signs):
    from lowp_helpers import rotate as written

    return written(a, axis, signs)


def dot_reference(recipe, lhs, rhs, dy, dn, blocked, square, key):
    p = recipe.products()
    keys = [None] * 3 if key is None else list(jax.random.split(key, 3))

    def dot(a, b):
        return jax.lax.dot_general(a, b, dn, preferred_element_type=jnp.float32)

    sq = {"fwd": (None, square), "dx": (None, square), "dw": (None, None)}
    a, b = dot_operands(p.fwd, lhs, rhs, blocked["fwd"], keys[0], sq["fwd"])
    y = dot(a, b)
    g, b = dot_operands(p.dx, dy, rhs, blocked["dx"], keys[1], sq["dx"])
    da = jax.vjp(lambda t: dot(t, b), lhs)[1](g)[0]
    a, g = dot_operands(p.dw, lhs, dy, blocked["dw"], keys[2], sq["dw"])
    db = jax.vjp(lambda t: dot(a, t), rhs)[1](g)[0]
    return y, (a, b), da, db


def padded_operand(q, v, dims, key, square):
    """`v` quantised along `dims`: in place along one dimension its block divides,
    else flattened, padded with zeros at the end to the block, quantised, the
    padding sliced off."""
    if q is None:
        return v
    if isinstance(q, eqxrules.BlockQuantizer) and isinstance(q.axis, tuple):
        return square_blocks(q, square)(v, key=key)
    if len(dims) == 1 and v.shape[dims[0]] % block(q) == 0:
        return quantise_axis(q, v, dims[0], key)
    f, shape = flat(v, dims)
    n = f.shape[0]
    f = jnp.pad(f, [(0, -n % block(q))] + [(0, 0)] * (f.ndim - 1))
    return restore(quantise_axis(q, f, 0, key)[:n], dims, shape)


def conv_reference(recipe, lhs, rhs, dy, conv, blocked, square, key):
    p = recipe.products()
    keys = [None] * 3 if key is None else list(jax.random.split(key, 3))

    def operands(spec, a, b, dims, k, squares):
        ka = kb = None
        if k is not None:
            ka, kb, _ = jax.random.split(k, 3)
        return (
            padded_operand(spec.lhs, a, dims[0], ka, squares[0]),
            padded_operand(spec.rhs, b, dims[1], kb, squares[1]),
        )

    a, b = operands(p.fwd, lhs, rhs, blocked["fwd"], keys[0], (None, square))
    y = conv(a, b)
    g, b = operands(p.dx, dy, rhs, blocked["dx"], keys[1], (None, square))
    da = jax.vjp(lambda t: conv(t, b), lhs)[1](g)[0]
    a, g = operands(p.dw, lhs, dy, blocked["dw"], keys[2], (None, None))
    db = jax.vjp(lambda t: conv(a, t), rhs)[1](g)[0]
    return y, da, db


def bound(f, lhs, rhs, dy):
    """Twice Higham's float32 bound on each product, from the absolute values of
    the operands' contraction (its length at most the operands' sizes)."""
    n = lhs.size + rhs.size + dy.size
    y = f(jnp.abs(lhs), jnp.abs(rhs))
    pull = jax.vjp(f, jnp.abs(lhs), jnp.abs(rhs))[1](jnp.abs(dy))
    # The bound of a float32 sum of n terms, applied to the sums of |terms|
    # (themselves float32 sums, hence the (1 + γ)).
    c = 2 * gamma(n, U32) * (1 + gamma(n, U32))
    return [c * np.asarray(v, np.float64) for v in (y, *pull)]


def far(actual, expected, bound) -> int:
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    nan = np.isnan(expected)
    with np.errstate(invalid="ignore"):
        far = np.abs(actual - expected) > np.nan_to_num(bound, nan=np.inf)
    return int(np.sum(np.where(nan, ~np.isnan(actual), far | np.isnan(actual))))


def data_of(shapes, kind):
    return [jnp.asarray(data(kind, s, i)) for i, s in enumerate(shapes)]


def vjp(f, lhs, rhs, dy):
    y, pull = jax.vjp(f, lhs, rhs)
    return (y, *pull(dy))


def dot_call(recipe, dn, key):
    return lambda a, b: eqxrules.quantized_dot_general(a, b, dn, recipe=recipe, key=key)


def out_shape(f, lhs, rhs):
    return jax.eval_shape(f, lhs, rhs).shape


def dot_failures(recipe, name, kind, *, jit, run=None):
    return dot_failures_of(recipe, name, (kind,), jit=jit, run=run)[kind]


def dot_failures_of(recipe, name, kinds, *, jit, run=None):
    """For each data kind, the elements of the value and both cotangents farther
    from the reference than the bound. Ours and the reference are each traced once
    per call, for every kind (the same shapes), and again at the next call, so that
    a planted defect (a patched helper of the core) is traced."""
    lhs_shape, rhs_shape, dn, blocked = DOT_CASES[name]
    if recipe is RECIPES["nvfp4"] and name not in SQUARE:
        recipe = NVFP4_1D
    key = KEY if reads_key(recipe.products()) else None
    plain = ft.partial(jax.lax.dot_general, dimension_numbers=dn)
    f = ft.partial(vjp, dot_call(run or recipe, dn, key))
    ours = jax.jit(f) if jit else f
    reference = eqx.filter_jit(ft.partial(dot_reference, recipe))
    square = SQUARE.get(name)
    out = {}
    for kind in kinds:
        lhs, rhs = data_of((lhs_shape, rhs_shape), kind)
        dy = data_of([out_shape(plain, lhs, rhs)], kind)[0]
        got = ours(lhs, rhs, dy)
        y, _, da, db = reference(lhs, rhs, dy, dn, blocked, square, key)
        out[kind] = failures(got, (y, da, db), bound(plain, lhs, rhs, dy))
    return out


def failures(got, expected, bounds):
    names = ("y", "dx", "dw")
    return {
        n: far(g, e, b)
        for n, g, e, b in zip(names, got, expected, bounds)
        if far(g, e, b)
    }


def conv_of(case):
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
            # Named, as the quantised products name theirs: a GPU's default is
            # TF32 (the CPU's is float32 itself).
            precision=jax.lax.Precision.HIGHEST,
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


def conv_failures(recipe, name, kind, *, jit, run=None):
    return conv_failures_of(recipe, name, (kind,), jit=jit, run=run)[kind]


def conv_failures_of(recipe, name, kinds, *, jit, run=None):
    """`dot_failures_of` for a convolution."""
    lhs_shape, rhs_shape, *_, blocked = CONV_CASES[name]
    conv, quantized = conv_of(name)
    key = KEY if reads_key(recipe.products()) else None
    f = ft.partial(vjp, quantized(run or recipe, key))
    ours = jax.jit(f) if jit else f
    reference = eqx.filter_jit(ft.partial(conv_reference, recipe, conv=conv))
    out = {}
    for kind in kinds:
        lhs, rhs = data_of((lhs_shape, rhs_shape), kind)
        dy = data_of([out_shape(conv, lhs, rhs)], kind)[0]
        got = ours(lhs, rhs, dy)
        spec = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, CONV_CASES[name][5])
        square = (spec.rhs_spec[0], spec.rhs_spec[1])
        expected = reference(lhs, rhs, dy, blocked=blocked, square=square, key=key)
        out[kind] = failures(got, expected, bound(conv, lhs, rhs, dy))
    return out
