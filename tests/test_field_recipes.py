"""The field's recipes (issue 41 §3): `fp8_blockwise()`, `fp8_rowwise()`,
`mxfp8()` with its scales rounded up, `mxfp4()` and `NVFP4(four_over_six=True)`.

- Each holds the quantisers its docstring states, each technique a field.
- Each one's three products (`quantized_dot`'s value and both cotangents) equal
  NumPy written from the recipe's statement (`block_references.py`: each operand
  quantised tile by tile along the axes the statement gives, the product in
  float64), within Higham's float32 summation bound. The stochastic parts
  (`mxfp4()`'s and `nvfp4()`'s gradient rounding and Hadamard transform) are
  turned off for this; they are checked where the core's are
  (`test_quantized_products.py`, `test_quantized_dot_sr.py`).
- Planted beside the check: a recipe whose quantiser blocks along the wrong axis,
  and scales rounded the other way (the OCP floor rule where the recipe rounds up).

Leaks between tokens: `test_token_leaks.py`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from block_references import block_float, nvfp4, pow2
from lowp_helpers import U32, U64, gamma

import eqxrules
from eqxrules import recipes

NEAREST_MXFP4 = recipes.MXFP4(gradient_rounding="nearest", hadamard=None)
NEAREST_46 = recipes.NVFP4(
    gradient_rounding="nearest", hadamard=None, four_over_six=True
)


def test_the_recipes_hold_their_quantisers():
    tile = eqxrules.BlockFloatQuantize(format="e4m3", block_size=128)
    block = dataclasses.replace(tile, axis=(0, 1))
    p = recipes.fp8_blockwise().products()
    assert [(q.lhs, q.rhs, q.hadamard) for q in (p.fwd, p.dx, p.dw)] == [
        (tile, block, None),
        (tile, block, None),
        (tile, tile, None),
    ]
    flat = recipes.FP8Blockwise(square_weight_blocks=False).products()
    assert flat.fwd.rhs == flat.dx.rhs == tile
    row = eqxrules.RowFloatQuantize(format="e4m3")
    p = recipes.fp8_rowwise().products()
    assert {q for s in (p.fwd, p.dx, p.dw) for q in (s.lhs, s.rhs)} == {row}
    mx = eqxrules.MXQuantize(format="e4m3", scale_rounding="ceil")
    p = recipes.mxfp8().products()
    assert {q for s in (p.fwd, p.dx, p.dw) for q in (s.lhs, s.rhs)} == {mx}
    floor = recipes.MXFP8(scale_rounding="floor").products().fwd.lhs
    assert floor == dataclasses.replace(mx, scale_rounding="floor")
    fp4 = eqxrules.MXQuantize(format="e2m1", block_size=32, scale_rounding="ceil")
    sr = dataclasses.replace(fp4, rounding="stochastic")
    p = recipes.mxfp4().products()
    assert [(q.lhs, q.rhs, q.hadamard) for q in (p.fwd, p.dx, p.dw)] == [
        (fp4, fp4, None),
        (sr, fp4, None),
        (fp4, sr, 32),
    ]
    p = recipes.NVFP4(four_over_six=True).products()
    assert all(q.four_over_six for s in (p.fwd, p.dx, p.dw) for q in (s.lhs, s.rhs))
    assert not recipes.nvfp4().products().fwd.lhs.four_over_six


def _numpy_operands(name: str, x, w, dy) -> dict[str, tuple]:
    """Each product's two quantised operands, as the recipe `name` states them:
    `y = qa @ qb`, `dx = qa @ qb.T`, `dw = qa.T @ qb`."""
    if name.startswith("fp8_blockwise"):
        b = int(name.split("_")[-1])

        def tile(v, axis):
            return block_float(v, "e4m3", b, axis)

        qw = block_float(w, "e4m3", b, (0, 1))
        return {
            "y": (tile(x, 1), qw),
            "dx": (tile(dy, 1), qw),
            "dw": (tile(x, 0), tile(dy, 0)),
        }
    if name == "fp8_rowwise":

        def row(v, axis):
            return pow2(v, "e4m3", v.shape[axis], axis, "ceil")

        return {
            "y": (row(x, 1), row(w, 0)),
            "dx": (row(dy, 1), row(w, 1)),
            "dw": (row(x, 0), row(dy, 0)),
        }
    if name in ("mxfp8", "mxfp4 nearest"):
        fmt = "e4m3" if name == "mxfp8" else "e2m1"

        def mx(v, axis):
            return pow2(v, fmt, 32, axis, "ceil")

        return {
            "y": (mx(x, 1), mx(w, 0)),
            "dx": (mx(dy, 1), mx(w, 1)),
            "dw": (mx(x, 0), mx(dy, 0)),
        }
    assert name == "nvfp4 4/6 nearest"
    qw = nvfp4(w, (0, 1), True)
    return {
        "y": (nvfp4(x, 1, True), qw),
        "dx": (nvfp4(dy, 1, True), qw),
        "dw": (nvfp4(x, 0, True), nvfp4(dy, 0, True)),
    }


RECIPES = {
    "fp8_blockwise_128": recipes.fp8_blockwise(),
    "fp8_blockwise_32": recipes.FP8Blockwise(block_size=32),
    "fp8_rowwise": recipes.fp8_rowwise(),
    "mxfp8": recipes.mxfp8(),
    "mxfp4 nearest": NEAREST_MXFP4,
    "nvfp4 4/6 nearest": NEAREST_46,
}


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [256, 128], w [128, 128], dy [256, 128]: heavy-tailed, with tokens and
    features of different scales, so that each tile's scale is its own."""
    rng = np.random.default_rng(seed)

    def heavy(shape, spread):
        scale = 10.0 ** rng.uniform(-spread, spread, (shape[0], 1))
        return (rng.standard_t(3, shape) * scale).astype(np.float32)

    return heavy((256, 128), 2), heavy((128, 128), 1) / 10, heavy((256, 128), 2)


def failures(recipe, name: str, x, w, dy) -> dict[str, int]:
    """For each product, the elements further from NumPy's than the float32
    summation bound (twice Higham's)."""

    def f(x, w):
        return eqxrules.quantized_dot(x, w, recipe=recipe, key=jax.random.key(0))

    y, pull = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
    got = dict(zip(("y", "dx", "dw"), (y, *pull(jnp.asarray(dy)))))
    ops = _numpy_operands(name, x, w, dy)
    out = {}
    for product, (a, b) in ops.items():
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if product == "dx":
            b = b.T
        if product == "dw":
            a = a.T
        value, scale = a @ b, np.abs(a) @ np.abs(b)
        bound = 2 * (gamma(a.shape[1], U32) + gamma(a.shape[1], U64)) * scale
        far = np.abs(np.asarray(got[product], np.float64) - value) > bound
        if far.any():
            out[product] = int(far.sum())
    return out


@pytest.mark.first_case_quick
@pytest.mark.parametrize("name", list(RECIPES))
def test_each_recipe_is_its_numpy_statement(name):
    assert failures(RECIPES[name], name, *_data()) == {}


class _AcrossTheOther(eqxrules.BlockFloatQuantize):
    """Tiles along the axis the product does not contract, whatever the core asks
    for (for a matrix: the other one)."""

    def for_reduction_axis(self, axis, length, where):
        return dataclasses.replace(self, axis=1 - axis % 2)


def test_planted_recipe_blocked_along_the_wrong_axis_is_caught():
    wrong = _AcrossTheOther(format="e4m3", block_size=32)
    honest = recipes.FP8Blockwise(block_size=32).products()
    planted = recipes.Custom(
        fwd=recipes.Product(wrong, honest.fwd.rhs),
        dx=recipes.Product(wrong, honest.dx.rhs),
        dw=recipes.Product(wrong, wrong),
    )
    found = failures(planted, "fp8_blockwise_32", *_data())
    assert set(found) == {"y", "dx", "dw"}, found


def test_planted_scales_rounded_down_are_caught():
    """The OCP floor rule where the recipes round up: MXFP8 and MXFP4 (their
    E2M1 blocks saturate more often)."""
    floor8 = recipes.MXFP8(scale_rounding="floor")
    assert failures(floor8, "mxfp8", *_data()) != {}
    floor4 = dataclasses.replace(NEAREST_MXFP4, scale_rounding="floor")
    assert failures(floor4, "mxfp4 nearest", *_data()) != {}


def test_bad_field_values_are_clear_errors():
    from eqxrules._hyper import invalid_constructions

    for valid in (recipes.fp8_blockwise(), recipes.fp8_rowwise(), recipes.mxfp4()):
        rows = invalid_constructions(valid)
        assert rows
        name = type(valid).__name__
        for row in rows:
            with pytest.raises(row.error) as info:
                type(valid)(**row.kwargs)
            assert f"`{name}`: `{row.argument}` (={row.value!r})" in str(info.value)


def _general_failures(recipe, quantise_x, quantise_w) -> int:
    """`quantized_dot_general` contracting two dimensions of 4 and 5 (a length of
    20, which a tile of 16 does not divide), against NumPy: `x` [3, 4, 5] and `w`
    [4, 5, 6] flattened to [3, 20] and [20, 6], quantised by the given NumPy
    rules (the rows of the contraction), then multiplied."""
    rng = np.random.default_rng(1)
    # Each run of 5 at its own scale, 1e-4 to 1e4: a row's scale is then another
    # than a run's, and its small elements fall below E4M3's subnormals.
    x = rng.standard_t(3, (3, 4, 5)) * 10.0 ** rng.uniform(-4, 4, (3, 4, 1))
    w = rng.standard_t(3, (4, 5, 6)) * 10.0 ** rng.uniform(-4, 4, (4, 1, 6))
    x, w = x.astype(np.float32), w.astype(np.float32)
    dn = (((1, 2), (0, 1)), ((), ()))
    got = eqxrules.quantized_dot_general(
        jnp.asarray(x), jnp.asarray(w), dn, recipe=recipe
    )
    a = np.asarray(quantise_x(x.reshape(3, 20)), np.float64)
    b = np.asarray(quantise_w(w.reshape(20, 6)), np.float64)
    bound = 2 * (gamma(20, U32) + gamma(20, U64)) * (np.abs(a) @ np.abs(b))
    return int(np.sum(np.abs(np.asarray(got, np.float64) - a @ b) > bound))


def _padded(rule, size):
    """`rule` on a matrix whose contraction (axis 0 of `w`, 1 of `x`) is padded
    with zeros to a multiple of `size`, the padding sliced off."""

    def quantise(v, axis):
        n = v.shape[axis]
        widths = [(0, 0), (0, 0)]
        widths[axis] = (0, -n % size)
        out = rule(np.pad(v, widths), axis)
        return out[:, :n] if axis == 1 else out[:n]

    return quantise


def test_rows_and_tiles_of_a_flattened_contraction():
    """Several contracted dimensions are one row (`fp8_rowwise()`: one scale over
    all 20) or one run of tiles padded with zeros (`FP8Blockwise(block_size=16,
    square_weight_blocks=False)`); planted: rows of the last contracted dimension
    alone (5), which is another scale."""
    row = recipes.fp8_rowwise()

    def whole(v, axis):
        return pow2(v, "e4m3", v.shape[axis], axis, "ceil")

    def fives(v, axis):
        return pow2(v, "e4m3", 5, axis, "ceil")

    assert _general_failures(row, lambda x: whole(x, 1), lambda w: whole(w, 0)) == 0
    assert _general_failures(row, lambda x: fives(x, 1), lambda w: fives(w, 0)) > 0
    tiles = recipes.FP8Blockwise(block_size=16, square_weight_blocks=False)
    tile = _padded(lambda v, axis: block_float(v, "e4m3", 16, axis), 16)
    assert _general_failures(tiles, lambda x: tile(x, 1), lambda w: tile(w, 0)) == 0
