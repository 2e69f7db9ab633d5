"""The float quantisers against independent truths (issue 14, sections 2 to 4):

- each element format, bit for bit against `ml_dtypes`' cast, over every bfloat16
  and float16 bit pattern, at scale 1 and at two others;
- MX and NVFP4 against their rules written out in NumPy (float32 arithmetic,
  `ml_dtypes` casts for the element and scale formats), on blocks that are all
  zero, tiny, hold a NaN or an inf, or have their largest magnitude exactly at or
  just below a power of two;
- planted defects beside the checks: a rounding that goes half away from zero, an
  MX scale that uses `ceil` instead of `floor`;
- the block quantisers in layers: blocks along the reduction dimension, a clear
  error naming the layer, and an MXFP4/MXFP8 MLP that trains.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import ml_dtypes
import numpy as np
import pytest
from backend import ftz, quotient

import eqxrules
from eqxrules._rules import _formats, blocks
from eqxrules._rules._formats import FORMATS

F32 = np.float32
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
MAX = {"e4m3": 448.0, "e5m2": 57344.0, "e3m2": 28.0, "e2m3": 7.5, "e2m1": 6.0}
DTYPE = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e3m2": ml_dtypes.float6_e3m2fn,
    "e2m3": ml_dtypes.float6_e2m3fn,
    "e2m1": ml_dtypes.float4_e2m1fn,
}
EMAX = {"e4m3": 8, "e5m2": 15, "e3m2": 4, "e2m3": 2, "e2m1": 2}


def _cast(fmt: str, y: np.ndarray) -> np.ndarray:
    """`y` (float32, within ±max) rounded by `ml_dtypes`' cast to the format; NaN
    stays NaN (FP6 and FP4 have no NaN to cast to)."""
    with np.errstate(invalid="ignore"):
        r = y.astype(DTYPE[fmt]).astype(F32)
    return np.where(np.isnan(y), F32(np.nan), r)


def _every(dtype_name: str) -> np.ndarray:
    return np.arange(2**16, dtype=np.uint16).view(DTYPES[dtype_name])


def _bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _element_mismatches(fmt: str, dtype_name: str, scale: float) -> int:
    """Inputs (of the 65,536) where `float_quantize` differs from
    `scale·cast(clip(x/scale, ±max))`, NaN where the input is NaN."""
    x = _every(dtype_name)
    got = np.asarray(
        jax.jit(lambda x: eqxrules.float_quantize(x, format=fmt, scale=scale))(x)
    )
    with np.errstate(all="ignore"):  # NaN and inf inputs, overflow to inf
        u = x.astype(F32) / F32(scale)
        want = _cast(fmt, np.clip(u, -MAX[fmt], MAX[fmt])) * F32(scale)
        want = want.astype(x.dtype)
    assert got.dtype == x.dtype
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    return int(np.sum(_bits(got)[~nan] != _bits(want)[~nan]))


@pytest.mark.first_case_quick
@pytest.mark.parametrize("scale", [1.0, 3.0, 0.0625])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("fmt", list(MAX))
def test_element_format_equals_ml_dtypes_on_every_input(fmt, dtype_name, scale):
    assert _element_mismatches(fmt, dtype_name, scale) == 0


def _half_away_from_zero(fmt, y):
    k = jnp.maximum(_formats.exponent(y), fmt.emin) - fmt.mbits
    v = y * blocks.pow2(-k)
    return jnp.sign(v) * jnp.floor(jnp.abs(v) + 0.5) * blocks.pow2(k)


def test_planted_half_away_from_zero_rounding_is_caught(monkeypatch):
    # Where the element rounding lives (`round_with` calls it).
    monkeypatch.setattr(_formats, "round_to", _half_away_from_zero)
    assert _element_mismatches("e2m1", "bfloat16", 1.0) > 0
    assert _element_mismatches("e4m3", "float16", 3.0) > 0


@pytest.mark.first_case_quick
@pytest.mark.parametrize("fmt", list(MAX))
def test_element_format_derivative_is_the_selected_range(fmt):
    """`t` where `|x/scale| <= max`, exactly 0 elsewhere (NaN and inf inputs, and
    an inf or NaN cotangent, included): selected, not multiplied."""
    x = _every("float16")
    _, pull = jax.vjp(lambda x: eqxrules.float_quantize(x, format=fmt, scale=3.0), x)
    with np.errstate(invalid="ignore"):
        inside = np.abs(x.astype(F32) / F32(3.0)) <= MAX[fmt]
    for ct in (np.float16(1.0), np.float16(np.inf), np.float16(np.nan)):
        (g,) = pull(jnp.full(x.shape, ct, x.dtype))
        g = np.asarray(g)
        assert g.dtype == x.dtype
        np.testing.assert_array_equal(g[~inside], 0)
        np.testing.assert_array_equal(_bits(g[inside]), _bits(np.full(1, ct))[0])


# -- block formats, written out in NumPy --------------------------------------------


def _blocks(x: np.ndarray, axis: int, size: int) -> np.ndarray:
    m = np.moveaxis(x, axis, -1)
    return m.reshape(*m.shape[:-1], m.shape[-1] // size, size)


def _unblocks(b: np.ndarray, axis: int, x: np.ndarray) -> np.ndarray:
    return np.moveaxis(b.reshape(np.moveaxis(x, axis, -1).shape), -1, axis)


def numpy_mx(x, fmt, size, axis, *, rounding=np.floor):
    """OCP MX v1.0: shared scale 2^(floor(log2 amax) - emax), clamped to E8M0's
    [2^-127, 2^127]; elements cast(clip(x / X, ±max)) · X; an all-zero block is
    zero, a block holding NaN or inf is NaN."""
    b = _blocks(np.asarray(x, F32), axis, size)
    amax = np.max(np.abs(b), axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = rounding(np.log2(amax.astype(np.float64)))
        e = np.where(np.isfinite(e), e, 0)
    X = np.ldexp(F32(1), np.clip(e - EMAX[fmt], -127, 127).astype(np.int32))
    X = X.astype(F32)
    with np.errstate(invalid="ignore", over="ignore"):
        q = _cast(fmt, np.clip(b / X, -MAX[fmt], MAX[fmt])) * X
    q = np.where(np.isfinite(amax), q, F32(np.nan))
    return ftz(_unblocks(q, axis, x))


def numpy_nvfp4(x, axis):
    """NVFP4: t = amax/(448·6) over the array; per block of 16, s =
    cast_e4m3(clip(amax_block/6/t, 0, 448)), d = t·s, q = cast_e2m1(clip(x/d, ±6))·d;
    a zero scale gives zeros; a NaN or inf anywhere makes everything NaN."""
    x = np.asarray(x, F32)
    A = np.max(np.abs(x)) if x.size else F32(0)
    if not np.isfinite(A):
        return np.full_like(x, np.nan)
    t = quotient(F32(A), F32(448 * 6))
    b = _blocks(x, axis, 16)
    a = np.max(np.abs(b), axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = _cast("e4m3", np.clip(quotient(quotient(a, F32(6)), t), 0, 448))
        d = (t * s).astype(F32)
        q = _cast("e2m1", np.clip(quotient(b, d), -6, 6).astype(F32)) * d
    q = np.where(s > 0, q, b * F32(0))
    return ftz(_unblocks(q, axis, x))


def _block_cases(size: int, scale: float = 1.0) -> np.ndarray:
    """Rows of two blocks each: random; ties of MXFP4's grid; all zero (signed zeros); tiny (near the
    bottom of float32, the scale clamped at 2^-127); a NaN; an inf; amax exactly a
    power of two; amax just below one."""
    rng = np.random.default_rng(size)
    rows = []

    def row(*blocks):
        rows.append(np.concatenate(blocks).astype(F32))

    def rand(s=1.0):
        return (rng.standard_normal(size) * s).astype(F32)

    below = np.nextafter(F32(4), F32(0))
    halves = np.resize(
        np.array([4, 0.25, -0.75, 1.25, 1.75, -2.5, 3.5, 4.5], F32), size
    )
    row(halves, (halves * F32(2.0**-30)).astype(F32))
    for s in (1.0, 1e-3, 300.0):
        row(rand(s), rand(s))
    zeros = np.zeros(size, F32)
    zeros[::2] = -0.0
    row(zeros, rand())
    tiny = (1 + rng.uniform(0, 0.5, size)).astype(F32) * F32(2.0**-126)
    row(tiny, (rand() * F32(2.0**-100)).astype(F32))
    for bad in (np.nan, np.inf, -np.inf):
        b = rand()
        b[size // 2] = bad
        row(b, rand())
    for top in (F32(4), below, F32(2.0**-20), np.nextafter(F32(2.0**-20), F32(0))):
        b = np.clip(rand(), -top, top)
        b[-1] = -top
        row(b, (b * F32(0.5)).astype(F32))
    return np.stack(rows) * F32(scale)


def _mx_mismatches(fmt, size, axis, dtype: Any = np.float32, **kw) -> int:
    x = _block_cases(size)
    if axis == 0:
        x = x.T.copy()
    x = x.astype(dtype)
    got = np.asarray(
        jax.jit(
            lambda x: eqxrules.mx_quantize(x, format=fmt, block_size=size, axis=axis)
        )(x)
    )
    assert got.dtype == x.dtype
    want = numpy_mx(x.astype(F32), fmt, size, axis, **kw).astype(dtype)
    nan = np.isnan(want)
    return int(
        np.sum(np.isnan(got) != nan) + np.sum(_bits(got)[~nan] != _bits(want)[~nan])
    )


@pytest.mark.first_case_quick
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("size", [32, 4])
@pytest.mark.parametrize("fmt", list(MAX))
def test_mx_equals_the_numpy_rule(fmt, size, axis):
    assert _mx_mismatches(fmt, size, axis) == 0


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
def test_mx_in_bfloat16_equals_the_numpy_rule(fmt):
    assert _mx_mismatches(fmt, 32, -1, dtype=ml_dtypes.bfloat16) == 0


def test_planted_ceil_scale_is_caught(monkeypatch):
    """The defect: `ceil(log2 amax)` for the shared exponent. The NumPy rule with
    `ceil` agrees with it (so the check can tell the two apart), the true rule
    does not."""

    def ceil(top, fmt, rounding):
        k = jnp.ceil(jnp.log2(top)).astype(jnp.int32) - FORMATS[fmt].emax
        return jnp.clip(k, -127, 127)

    monkeypatch.setattr(blocks, "_scale_exponent", ceil)
    assert _mx_mismatches("e2m1", 32, -1) > 0
    assert _mx_mismatches("e4m3", 4, 0) > 0


@pytest.mark.first_case_quick
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("scale", [1.0, 2.0**-60, 1e10])
def test_nvfp4_equals_the_numpy_rule(scale, axis):
    x = _block_cases(16, scale)
    finite = np.all(np.isfinite(x), axis=1)
    for rows in (x[finite], x[~finite][:1], np.zeros((2, 32), F32)):
        rows = rows.T.copy() if axis == 0 else rows
        got = np.asarray(jax.jit(lambda x: eqxrules.nvfp4_quantize(x, axis=axis))(rows))
        want = numpy_nvfp4(rows, axis)
        assert np.array_equal(np.isnan(got), np.isnan(want))
        ok = ~np.isnan(want)
        np.testing.assert_array_equal(_bits(got)[ok], _bits(want)[ok])


@pytest.mark.slow
def test_block_rules_are_straight_through_with_the_scales_fixed():
    x = jnp.asarray(_block_cases(16)[:3])
    ct = jnp.asarray(np.random.default_rng(1).standard_normal(x.shape), jnp.float32)
    for f in (eqxrules.mx_quantize, eqxrules.nvfp4_quantize):
        _, pull = jax.vjp(f, x)
        np.testing.assert_array_equal(pull(ct)[0], ct)
    xb = x.astype(jnp.bfloat16)
    (g,) = jax.vjp(eqxrules.mx_quantize, xb)[1](ct.astype(jnp.bfloat16))
    assert g.dtype == jnp.bfloat16


# -- misuse --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, named",
    [
        (lambda x: eqxrules.mx_quantize(x), "`block_size` (=32)"),
        (lambda x: eqxrules.MXQuantize(block_size=4, axis=0)(x), "`block_size` (=4)"),
        (lambda x: eqxrules.nvfp4_quantize(x), "`block_size` (=16)"),
    ],
    ids=["mx", "mx-axis-0", "nvfp4"],
)
def test_block_must_divide_the_axis(call, named):
    """A `ValueError` naming the rule, the block, the axis and its length."""
    x = jnp.ones((6, 20))
    with pytest.raises(ValueError) as info:
        call(x)
    message = str(info.value)
    assert named in message and "axis" in message, message
    assert "whose length is 20" in message or "whose length is 6" in message


@pytest.mark.slow
def test_a_layer_whose_dimension_the_block_does_not_divide():
    """`quantize` an MLP 64 → 20 → 10 with MX weights: the second Linear's 20
    inputs are not a multiple of 32; the error names the layer by its path in the
    model (0.2.0 said only "`Quantized`'s layer"), its weight shape and the
    length."""
    mlp = eqx.nn.MLP(64, 10, 20, 1, key=jax.random.key(0))
    with pytest.raises(ValueError) as info:
        eqxrules.quantize(mlp, kernel_quantizer=eqxrules.MXQuantize())
    message = str(info.value)
    for part in (
        "`mx_quantize`",
        "`block_size` (=32)",
        "the layer at `model.layers[1]`, a Linear",
        "(10, 20)",
        "20.",
    ):
        assert part in message, (part, message)
    nested = {
        "encoder": eqx.nn.Sequential([eqx.nn.Linear(24, 8, key=jax.random.key(0))])
    }
    with pytest.raises(ValueError, match=r"input of the layer at `model\['encoder'\]"):
        eqxrules.quantize(nested, input_quantizer=eqxrules.NVFP4Quantize())
    conv = eqx.nn.Conv2d(8, 4, 3, key=jax.random.key(0))
    with pytest.raises(ValueError, match="input of `Quantized`'s layer, a Conv2d"):
        eqxrules.Quantized(conv, input_quantizer=eqxrules.NVFP4Quantize())


@pytest.mark.parametrize(
    "make",
    [
        lambda: eqxrules.NVFP4Quantize(block_size=32),
        lambda: eqxrules.nvfp4_quantize(jnp.ones((2, 32)), block_size=32),
    ],
    ids=["class", "function"],
)
def test_nvfp4_block_size_is_fixed_at_16(make):
    """A `ValueError` that says NVFP4's block is 16, naming the rule, the argument
    and the value (0.2.0: Python's "unexpected keyword argument"). 16 is accepted,
    so that NVFP4 is built like MX."""
    with pytest.raises(ValueError) as info:
        make()
    message = str(info.value)
    assert "`nvfp4_quantize`: `block_size` (=32) must be 16" in message, message
    assert "NVFP4" in message, message
    assert eqxrules.NVFP4Quantize(block_size=16) == eqxrules.NVFP4Quantize()


# -- in layers -----------------------------------------------------------------------


@pytest.mark.slow
def test_blocks_run_along_the_reduction_dimension():
    """Whatever the quantiser's own `axis`: a Linear's weight along its input
    axis and the input along its features; a Conv's weight along its input
    channels and the input along its channels."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    mx = eqxrules.MXQuantize(format="e4m3", block_size=8, axis=0)
    lin = eqx.nn.Linear(16, 8, key=k1)
    x = jax.random.normal(k2, (16,))
    got = eqxrules.Quantized(lin, kernel_quantizer=mx, input_quantizer=mx)(x)
    along = eqxrules.MXQuantize(format="e4m3", block_size=8, axis=1)
    by_hand = eqx.tree_at(lambda m: m.weight, lin, along(lin.weight))
    np.testing.assert_array_equal(got, by_hand(along(x[None])[0]))

    conv = eqx.nn.Conv2d(16, 4, 3, padding=1, key=k3)
    img = jax.random.normal(k2, (16, 5, 5))
    got = eqxrules.Quantized(conv, kernel_quantizer=mx, input_quantizer=mx)(img)
    w = eqxrules.mx_quantize(conv.weight, format="e4m3", block_size=8, axis=1)
    by_hand = eqx.tree_at(lambda m: m.weight, conv, w)
    q_img = eqxrules.mx_quantize(img, format="e4m3", block_size=8, axis=0)
    np.testing.assert_array_equal(got, by_hand(q_img))


@pytest.mark.slow
def test_mxfp4_weights_and_mxfp8_activations_train():
    """An MLP 64 → 32 → 10 under `quantize`, MXFP4 weights and MXFP8 (e4m3)
    activations: a few SGD steps with finite gradients reaching every latent
    weight, and a lower loss at the end."""
    key = jax.random.key(0)
    mlp = eqx.nn.MLP(64, 10, 32, 1, activation=jax.nn.relu, key=key)
    model = eqxrules.quantize(
        mlp,
        kernel_quantizer=eqxrules.MXQuantize(format="e2m1"),
        input_quantizer=eqxrules.MXQuantize(format="e4m3"),
    )
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, 64))

    def loss(m):
        logits = jax.vmap(m)(x)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    @eqx.filter_jit
    def step(m):
        value, grads = eqx.filter_value_and_grad(loss)(m)
        m = eqx.apply_updates(m, jtu.tree_map(lambda g: -0.1 * g, grads))
        return m, value, grads

    losses = []
    for _ in range(8):
        model, value, grads = step(model)
        losses.append(float(value))
        for g in jtu.tree_leaves(eqx.filter(grads, eqx.is_inexact_array)):
            assert np.all(np.isfinite(np.asarray(g)))
        for layer in grads.layers:
            assert np.any(np.asarray(layer.layer.weight) != 0)
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
    assert FORMATS["e2m1"].emax == EMAX["e2m1"]
