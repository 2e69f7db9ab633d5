"""`quantized_dot` against its statement (issue 19 §4).

- Each of the three products, rounding to nearest, against the explicit reference of
  `lowp_helpers` (public quantisers along the stated axis, then the product),
  within the float32 summation bound, on random and adversarial data, eager and
  jitted; the identity recipe equals `jnp.dot` and its VJP bit for bit.
- Under `vmap` (nested, under `jit`, `checkpoint`, `lax.scan`), the result of one
  call on the whole batch.
- The random Hadamard transform leaves an unquantised product alone.
- Planted defects beside the checks: operands blocked along the wrong axis, the
  input-gradient product reusing the forward's quantised weight, the rotation of
  one operand only.
- Bad input: clear errors naming `quantized_dot`.
"""

from __future__ import annotations

import dataclasses
import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lowp_helpers import U32, data, gamma, mismatches, reference, vjp

import eqxrules
from eqxrules import recipes
from eqxrules._lowp import quantise
from eqxrules._lowp.recipes import reads_key as _reads_key

SHAPES = {"x": (2, 32, 64), "w": (64, 32), "dy": (2, 32, 32)}  # M=64, K=64, N=32
KEY = jax.random.key(7)
E4M3, E5M2 = eqxrules.FloatQuantize(format="e4m3"), eqxrules.FloatQuantize("e5m2")
NV = eqxrules.NVFP4Quantize()
NEAREST = {
    "mxfp8": recipes.mxfp8(),
    "mxfp8_hybrid_16": recipes.MXFP8(gradient_format="e5m2", block_size=16),
    "fp8": recipes.fp8(),
    "nvfp4_nearest": recipes.NVFP4(gradient_rounding="nearest"),
    "nvfp4_1d_nearest_rht": recipes.NVFP4(
        square_weight_blocks=False, gradient_rounding="nearest"
    ),
    "mixed": recipes.Custom(
        fwd=recipes.Product(E4M3, eqxrules.MXQuantize(format="e2m1")),
        dx=recipes.Product(E5M2, None, hadamard=16),
        dw=recipes.Product(None, NV, hadamard=8),
    ),
}
KINDS = ("random", "zeros", "nan", "pow2", "below_pow2")


def _data(kind: str) -> tuple[np.ndarray, ...]:
    return tuple(data(kind, SHAPES[n], seed) for seed, n in enumerate(SHAPES))


def _failures(recipe, x, w, dy, *, jit: bool, run=None) -> dict[str, int]:
    """The products of `quantized_dot` with `recipe` (or with `run`, a planted
    recipe) that differ from `recipe`'s reference, and in how many elements."""
    key = KEY if _reads_key(recipe.products()) else None
    got = dict(zip(("y", "dx", "dw"), vjp(run or recipe, x, w, dy, key, jit=jit)))
    ref = reference(recipe, x, w, dy, key)
    return {n: mismatches(got[n], *ref[n]) for n in ref if mismatches(got[n], *ref[n])}


@pytest.mark.first_case_quick
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", NEAREST)
def test_products_equal_the_reference(name, jit):
    recipe = NEAREST[name]
    failures = {k: _failures(recipe, *_data(k), jit=jit) for k in KINDS}
    assert failures == dict.fromkeys(KINDS, {})


@pytest.mark.slow
def test_stochastic_products_equal_the_reference_with_the_same_key():
    # NVFP4 as Transformer Engine has it: the draws are those of the public
    # quantisers with the keys `quantized_dot` documents, so a key gives one answer.
    recipe = recipes.nvfp4()
    for kind in ("random", "pow2"):
        assert _failures(recipe, *_data(kind), jit=True) == {}
    x, w, dy = _data("random")
    a, b = (vjp(recipe, x, w, dy, k, jit=True) for k in jax.random.split(KEY))
    assert not np.array_equal(a[2], b[2])  # another key, other draws


def test_adversarial_data_is_adversarial():
    # The data the reference runs on: every block of 16 or 32 along either axis of
    # `pow2` has its largest magnitude exactly 4, one ulp lower in `below_pow2`; the
    # MX scale of the two differs (2^-6 and 2^-7 for E4M3).
    for kind, top in (("pow2", 4.0), ("below_pow2", np.nextafter(np.float32(4), 0))):
        m = data(kind, (64, 64), 0)
        for blocks in (m.reshape(64, 2, 32), m.T.reshape(64, 4, 16)):
            assert np.all(np.abs(blocks).max(-1) == top)
    assert np.isnan(data("nan", (4, 4), 0)).sum() == 1


@pytest.mark.slow
def test_identity_recipe_is_jnp_dot_bit_for_bit():
    for dtype in (jnp.float32, jnp.bfloat16):
        x, w, dy = (jnp.asarray(a, dtype) for a in _data("random"))
        for jit in (False, True):
            got = vjp(recipes.identity(), x, w, dy, jit=jit)
            y, pull = jax.vjp(jnp.dot, x, w)
            for a, b in zip(got, (y, *pull(dy))):
                assert a.dtype == b.dtype and np.array_equal(a, b)
    x, w, dy = _data("random")
    # Under `vmap`, example by example, as a layer sees it, with `axis_name`
    # naming the `vmap`: one product on the batch, as `jnp.dot` under `vmap` is.
    xs = x.reshape(64, 64)

    def loss(f, w):
        mapped = jax.vmap(lambda xi: f(xi, w), axis_name="batch")(xs)
        return jnp.sum(mapped * dy.reshape(64, 32))

    ident = ft_dot(recipes.identity(), axis_name="batch")
    for a, b in zip(jax.grad(loss, 1)(ident, w), jax.grad(loss, 1)(jnp.dot, w)):
        assert np.array_equal(a, b)


def _vjp(f, x, w, dy):
    y, pull = jax.vjp(f, x, w)
    return y, pull(dy)


def ft_dot(recipe, key=None, axis_name=None):
    return lambda x, w: eqxrules.quantized_dot(
        x, w, recipe=recipe, key=key, axis_name=axis_name
    )


def test_cotangents_have_their_primals_dtypes():
    x, w, dy = _data("random")
    x16 = jnp.asarray(x, jnp.bfloat16)
    y, dx, dw = vjp(recipes.mxfp8(), x16, w, jnp.asarray(dy, jnp.float32))
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.float32, jnp.bfloat16, jnp.float32)


@pytest.mark.slow
@pytest.mark.first_case_quick
@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_a_named_vmap_over_examples_is_one_call_on_the_batch(name):
    """Value and gradients, bit for bit: nested `vmap` over batch and positions,
    both named in `axis_name`, under `jit`, `jax.checkpoint` and within a
    `lax.scan`, against one call on the whole batch."""
    recipe = {**NEAREST, "nvfp4": recipes.nvfp4()}[name]
    x, w, dy = _data("random")
    f = ft_dot(recipe, KEY, axis_name=("batch", "position"))

    def by_example(x, w):
        inner = jax.vmap(lambda xi: f(xi, w), axis_name="position")
        return jax.vmap(inner, axis_name="batch")(x)

    # Compared in the same mode: XLA may sum a fused product in another order.
    for g, jit in (
        (by_example, False),
        (by_example, True),
        (jax.checkpoint(by_example), True),
    ):
        whole = vjp(recipe, x, w, dy, KEY, jit=jit)
        run = ft.partial(_vjp, g)
        y, pull = (jax.jit(run) if jit else run)(x, w, dy)
        for a, b in zip((y, *pull), whole):
            assert np.array_equal(a, b)

    def scanned(x, w):
        # Each step of the scan is a whole batch: two batches, one call each.
        def step(c, xb):
            one = ft_dot(recipe, KEY, axis_name="batch")
            return c, jax.vmap(lambda xi: one(xi, w), axis_name="batch")(xb)

        return jax.lax.scan(step, 0.0, x)[1]

    y, (_, dw) = jax.jit(ft.partial(_vjp, scanned))(x, w, dy)
    halves = [reference(recipe, x[i], w, dy[i], KEY) for i in range(2)]
    for i, ref in enumerate(halves):
        assert mismatches(y[i], *ref["y"]) == 0
    # The sum of the two steps' weight gradients, each within its bound, and
    # rounded once more.
    (v0, b0), (v1, b1) = (h["dw"] for h in halves)
    assert mismatches(dw, v0 + v1, b0 + b1 + U32 * np.abs(v0 + v1)) == 0


@pytest.mark.slow
def test_vmap_over_weights_maps_the_products():
    # An ensemble: each member its own product (to float32 summation order: the
    # members run in a loop).
    recipe = recipes.mxfp8()
    x, _, dy = _data("random")
    ws = np.stack([data("random", SHAPES["w"], s) for s in (5, 6)])
    got = jax.vmap(lambda w: vjp(recipe, x, w, dy))(ws)
    for i, w in enumerate(ws):
        ref = reference(recipe, x, w, dy)
        for n, value in zip(("y", "dx", "dw"), got):
            assert mismatches(value[i], *ref[n]) == 0


@pytest.mark.slow
def test_a_mapped_key_under_a_named_vmap_is_an_error():
    """The whole batch's products take one key."""
    recipe = NEAREST["nvfp4_1d_nearest_rht"]
    x, w, _ = _data("random")
    keys = jax.random.split(KEY, 64)
    with pytest.raises(ValueError, match=r"`quantized_dot`: under `jax.vmap` with"):
        jax.vmap(
            lambda xi, k: ft_dot(recipe, k, axis_name="batch")(xi, w),
            axis_name="batch",
        )(x.reshape(64, 64), keys)


def _rht_bound(a: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
    """The bound on `|fl(rotated product) - a·b|`: each rotated operand is off by at
    most `γ_n √n ‖a‖` (a sum of `n` terms, `|H| = J` of norm `n`, scaled by
    `1/√n`), and the float32 product adds `γ_K ‖a'‖‖b'‖`; `‖a'‖ = ‖a‖`."""
    k = a.shape[0]
    e = gamma(n, U32) * np.sqrt(n)
    norms = np.sqrt(np.sum(a.astype(np.float64) ** 2, 0))[:, None] * np.sqrt(
        np.sum(b.astype(np.float64) ** 2, 0)
    )
    return ((1 + e) ** 2 * (1 + gamma(k, U32)) - 1) * norms


RHT_ONLY = recipes.Custom(
    fwd=recipes.Product(hadamard=16),
    dx=recipes.Product(hadamard=32),
    dw=recipes.Product(hadamard=16),
)


def _rht_failures() -> dict[str, int]:
    x, w, dy = _data("random")
    y, dx, dw = vjp(RHT_ONLY, x, w, dy, KEY)
    x2, dy2 = x.reshape(64, 64), dy.reshape(64, 32)
    out = {}
    for n, got, a, b, size in (
        ("y", y.reshape(64, 32), x2.T, w, 16),
        ("dx", dx.reshape(64, 64), dy2.T, w.T, 32),
        ("dw", dw, x2, dy2, 16),
    ):
        exact = a.T.astype(np.float64) @ b.astype(np.float64)
        far = np.abs(np.asarray(got, np.float64) - exact) > _rht_bound(a, b, size)
        if far.any():
            out[n] = int(far.sum())
    return out


def test_the_hadamard_transform_leaves_the_product_unchanged():
    assert _rht_failures() == {}


# Planted defects. Where a public seam reaches the defect, it is planted through
# it: a recipe (`recipes.Custom`) of user quantisers (subclasses of the public
# `MXQuantize`) that `quantized_dot` runs, checked against the honest recipe's
# reference. The rotation of one operand has no such seam (`quantized_dot` rotates
# both operands itself; no recipe or quantiser sees the signs), so it is patched.


class _WrongAxis(eqxrules.MXQuantize):
    """MX blocks along the axis the product does not reduce, whatever
    `quantized_dot` asks for."""

    def for_reduction_axis(self, axis, length, where):
        return dataclasses.replace(self, axis=1 - axis)


class _AlongK(eqxrules.MXQuantize):
    """MX blocks along axis 0 of its operand, whatever `quantized_dot` asks for:
    for `w` [K, N], the forward product's blocks along K."""

    def for_reduction_axis(self, axis, length, where):
        return dataclasses.replace(self, axis=0)


def test_planted_blocks_along_the_wrong_axis_are_caught():
    wrong = _WrongAxis(format="e4m3", block_size=32)
    product = recipes.Product(wrong, wrong)
    planted = recipes.Custom(fwd=product, dx=product, dw=product)
    failures = _failures(recipes.mxfp8(), *_data("random"), jit=False, run=planted)
    assert set(failures) == {"y", "dx", "dw"}


def test_planted_forward_operand_in_the_backward_is_caught():
    """The input-gradient product with the forward's quantised weight (blocked
    along K), where the recipe says to quantise `w` along N."""
    honest = recipes.mxfp8().products()
    along_k = _AlongK(format="e4m3", block_size=32)
    planted = dataclasses.replace(honest, dx=recipes.Product(honest.dx.lhs, along_k))
    failures = _failures(recipes.mxfp8(), *_data("random"), jit=False, run=planted)
    assert set(failures) == {"dx"}


@pytest.fixture
def planted(fresh_products):
    """`monkeypatch`, the core's products traced again (`fresh_products`)."""
    return fresh_products


@pytest.mark.slow
def test_planted_rotation_of_one_operand_is_caught(planted):
    calls = []

    def lhs_only(a, axis, signs):
        calls.append(axis)
        return dot_rotate(a, axis, signs) if len(calls) % 2 else a

    dot_rotate = quantise.rotate
    planted.setattr(quantise, "rotate", lhs_only)
    assert set(_rht_failures()) == {"y", "dx", "dw"}
    recipe = NEAREST["nvfp4_1d_nearest_rht"]
    assert set(_failures(recipe, *_data("random"), jit=False)) == {"dw"}


# Bad input.


def _call(x, w, recipe=None, **kwargs):
    return eqxrules.quantized_dot(x, w, recipe=recipe or recipes.mxfp8(), **kwargs)


@pytest.mark.parametrize(
    "x, w, recipe, error, match",
    [
        (
            np.ones((4, 64), np.float32),
            np.ones((32, 8), np.float32),
            None,
            ValueError,
            r"last axis of `x` \(shape \(4, 64\)\) must have the length of the first "
            r"axis of `w` \(shape \(32, 8\)\)",
        ),
        (
            np.ones((4, 64), np.float32),
            np.ones(64, np.float32),
            None,
            ValueError,
            r"`w` \(shape \(64,\)\) must be a matrix",
        ),
        (
            np.ones((4, 48), np.float32),
            np.ones((48, 32), np.float32),
            None,
            ValueError,
            r"forward product reduces K, .* \(=48\), which its `lhs` \(`x`, in blocks "
            r"of 32\)",
        ),
        (
            np.ones((4, 64), np.float32),
            np.ones((64, 40), np.float32),
            None,
            ValueError,
            r"input-gradient product reduces N, .* \(=40\), which its `lhs` \(the "
            r"output's cotangent, in blocks of 32\)",
        ),
        (
            np.ones((4, 64), np.int32),
            np.ones((64, 32), np.float32),
            None,
            TypeError,
            r"`quantized_dot` expects a floating-point array for `x`, got dtype int32",
        ),
        (
            np.ones((4, 64), np.float32),
            [[1.0]],
            None,
            TypeError,
            r"`quantized_dot` expects a floating-point array for `w`, got a list",
        ),
        (
            np.ones((4, 64), np.float32),
            np.ones((64, 32), np.float32),
            "mxfp8",
            TypeError,
            r"`quantized_dot`: `recipe` \(='mxfp8'\) must be an "
            r"`eqxrules.recipes.Recipe`",
        ),
    ],
)
def test_bad_input_is_a_clear_error(x, w, recipe, error, match):
    with pytest.raises(error, match=match):
        _call(x, w, recipe)


def test_a_batch_the_blocks_do_not_divide_is_padded_when_differentiated():
    """No error for the batch M (=40, blocks of 32): the weight-gradient product
    pads it with zero rows (tests/test_ragged.py checks the values)."""
    x, w = np.ones((40, 64), np.float32), np.ones((64, 32), np.float32)
    assert _call(x, w).shape == (40, 32)  # the forward product does not block M
    padded = np.concatenate([x, np.zeros((24, 64), np.float32)])
    want = jax.grad(lambda w: jnp.sum(_call(padded, w)[:40]))(w)
    for transform in (lambda f: f, jax.jit):
        got = transform(jax.grad(lambda w: jnp.sum(_call(x, w))))(w)
        assert np.array_equal(got, want)


def test_a_recipe_that_draws_needs_a_key():
    x, w = np.ones((64, 64), np.float32), np.ones((64, 32), np.float32)
    with pytest.raises(TypeError, match=r"draws random numbers \(dw.hadamard\)"):
        _call(x, w, NEAREST["nvfp4_1d_nearest_rht"])


def test_forward_mode_and_second_derivatives_are_clear_errors():
    x, w = _data("random")[:2]

    def f(w):
        return jnp.sum(_call(x, w) ** 2)

    with pytest.raises(TypeError, match="`quantized_dot` supports reverse mode only"):
        jax.jvp(f, (w,), (w,))
    with pytest.raises(TypeError, match="`quantized_dot` has no second derivative"):
        jax.grad(lambda w: jnp.sum(jax.grad(f)(w) ** 2))(w)
