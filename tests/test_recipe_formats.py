"""The two quantiser options the recipes need, against NumPy written from their
statements (casts by `ml_dtypes`), with planted defects beside the checks:

- `NVFP4Quantize(axis=(0, 1))`: 16x16 blocks over both axes, each with its E4M3
  scale under the tensor's float32 scale (Transformer Engine's 2-D weights): tile
  by tile in a loop; the quantised transpose is the transpose quantised.
- `FloatQuantize(scale="amax")`: one scale per tensor from its current amax,
  $s = \\max(A/M, 2^{-126})$; the derivative is straight through.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from backend import ftz, quotient

import eqxrules
from eqxrules._rules import blocks, floats, nvfp4

F32 = np.float32
CAST = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e2m1": ml_dtypes.float4_e2m1fn,
}
MAX = {"e4m3": 448.0, "e5m2": 57344.0, "e2m1": 6.0}


def _cast(fmt: str, y: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        r = np.asarray(y, F32).astype(CAST[fmt]).astype(F32)
    return np.where(np.isnan(y), F32(np.nan), r)


def numpy_nvfp4_2d(x: np.ndarray) -> np.ndarray:
    """Tile by tile: t = A/2688 over the matrix; per 16x16 tile, s =
    cast_e4m3(clip(a/6/t, 0, 448)), d = t·s, q = cast_e2m1(clip(x/d, ±6))·d; a zero
    scale gives zeros; a NaN or inf anywhere makes everything NaN."""
    x = np.asarray(x, F32)
    A = np.max(np.abs(x))
    if not np.isfinite(A):
        return np.full_like(x, np.nan)
    t = quotient(F32(A), F32(2688))
    out = np.empty_like(x)
    for i in range(0, x.shape[0], 16):
        for j in range(0, x.shape[1], 16):
            b = x[i : i + 16, j : j + 16]
            with np.errstate(divide="ignore", invalid="ignore"):
                a = quotient(np.max(np.abs(b)), F32(6))
                s = _cast("e4m3", np.clip(quotient(a, t), 0, 448))
                d = F32(t * s)
                q = _cast("e2m1", np.clip(quotient(b, d), -6, 6)) * d
            out[i : i + 16, j : j + 16] = q if s > 0 else b * F32(0)
    return ftz(out)


def _matrices() -> dict[str, np.ndarray]:
    """32x48 matrices: random; every tile's amax exactly 4 or one ulp below (on a
    diagonal every tile crosses); tiles of very different sizes; zeros; a NaN."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal((32, 48)).astype(F32)
    out = {"random": base}
    for name, top in (("pow2", F32(4)), ("below_pow2", np.nextafter(F32(4), F32(0)))):
        m = np.clip(base / 4, -0.99, 0.99).astype(F32)
        i, j = np.indices(m.shape)
        m[(i - j) % 16 == 0] = -top
        out[name] = m
    out["scales"] = (
        base
        * np.repeat(np.repeat(F32(10.0) ** rng.integers(-6, 4, (2, 3)), 16, 0), 16, 1)
    ).astype(F32)
    out["zeros"] = np.zeros((32, 48), F32)
    nan = base.copy()
    nan[5, 7] = np.nan
    out["nan"] = nan
    return out


def _nvfp4_2d_mismatches() -> dict[str, int]:
    q = eqxrules.NVFP4Quantize(axis=(0, 1))
    run = jax.jit(q)
    out = {}
    for name, m in _matrices().items():
        got, want = np.asarray(run(m)), numpy_nvfp4_2d(m)
        bad = int(np.sum(~((got == want) | (np.isnan(got) & np.isnan(want)))))
        if bad:
            out[name] = bad
    return out


def test_square_nvfp4_blocks_equal_the_tile_by_tile_rule():
    assert _nvfp4_2d_mismatches() == {}


def test_square_blocks_serve_both_products():
    # One quantised weight whichever axis a product reduces: Q(wᵀ) = Q(w)ᵀ.
    q = jax.jit(eqxrules.NVFP4Quantize(axis=(0, 1)))
    for m in _matrices().values():
        np.testing.assert_array_equal(np.asarray(q(m.T)), np.asarray(q(m)).T)


def test_planted_blocks_of_the_wrong_shape_are_caught(monkeypatch):
    # The defect: each block gathered as 16 consecutive elements of the rows of
    # 16 tiles side by side (the split in place done without the transposition
    # that makes a tile), so that a "block" spans several tiles.
    def unswapped(x, axis, size):
        if isinstance(axis, int):
            return honest(x, axis, size)
        split = honest(x, axis, size)
        return split.transpose(0, 2, 1, 3).reshape(split.shape)

    honest = blocks._to_blocks
    monkeypatch.setattr(blocks, "_to_blocks", unswapped)
    monkeypatch.setattr(nvfp4, "_to_blocks", unswapped)
    assert _nvfp4_2d_mismatches() != {}


def numpy_amax(x: np.ndarray, fmt: str) -> np.ndarray:
    """s = max(A/M, 2^-126) in float32, q = cast(clip(x/s, ±M))·s; NaN everywhere if
    A is not finite."""
    x = np.asarray(x, F32)
    A = np.max(np.abs(x))
    if not np.isfinite(A):
        return np.full_like(x, np.nan)
    s = max(quotient(F32(A), F32(MAX[fmt])), F32(2.0**-126))
    y = quotient(x, s)
    return (_cast(fmt, np.clip(y, -MAX[fmt], MAX[fmt])) * s).astype(F32)


def _amax_cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    cases = {"random": rng.standard_normal(256).astype(F32)}
    for s in (1e-30, 1e30):
        cases[f"scaled {s}"] = (cases["random"] * F32(s)).astype(F32)
    cases["amax exact"] = np.array([448.0, 1.0, -3.5, 0.1], F32)
    cases["tiny"] = np.array([2.0**-125, -(2.0**-126), 0.0], F32)
    cases["zeros"] = np.zeros(8, F32)
    cases["inf"] = np.array([1.0, np.inf], F32)
    cases["nan"] = np.array([1.0, np.nan], F32)
    return cases


def _amax_mismatches(fmt: str) -> dict[str, int]:
    q = jax.jit(eqxrules.FloatQuantize(format=fmt, scale="amax"))
    out = {}
    for name, x in _amax_cases().items():
        got, want = np.asarray(q(x)), numpy_amax(x, fmt)
        bad = int(np.sum(~((got == want) | (np.isnan(got) & np.isnan(want)))))
        if bad:
            out[name] = bad
    return out


@pytest.mark.first_case_quick
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_amax_scale_equals_the_numpy_rule(fmt):
    assert _amax_mismatches(fmt) == {}


@pytest.mark.slow
def test_amax_scale_sends_the_largest_element_to_the_formats_largest():
    x = jnp.asarray(_amax_cases()["random"])
    q = eqxrules.float_quantize(x, format="e4m3", scale="amax")
    i = int(jnp.argmax(jnp.abs(x)))
    s = float(jnp.max(jnp.abs(x))) / 448
    assert abs(float(q[i]) / s) == pytest.approx(448, rel=2**-20)


def test_planted_per_row_amax_is_caught(monkeypatch):
    # The defect: the scale from each row's amax instead of the tensor's.
    def per_row(self, w):
        a = jnp.max(jnp.abs(w), axis=-1, keepdims=True)
        return jnp.maximum(a / floats.FORMATS[self.format].max, 2.0**-126)

    monkeypatch.setattr(floats.FloatQuantize, "_scale", per_row)
    m = _matrices()["scales"]
    q = jax.jit(eqxrules.FloatQuantize(format="e4m3", scale="amax"))
    assert not np.array_equal(np.asarray(q(m)), numpy_amax(m, "e4m3"))


def test_amax_scale_is_straight_through():
    x = jnp.asarray(_amax_cases()["random"])
    ct = jnp.asarray(np.random.default_rng(2).standard_normal(x.shape), jnp.float32)
    _, pull = jax.vjp(lambda x: eqxrules.float_quantize(x, scale="amax"), x)
    np.testing.assert_array_equal(pull(ct)[0], ct)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (
            lambda: eqxrules.FloatQuantize(scale="max"),
            TypeError,
            r"`float_quantize`: `scale` \(='max'\) must be a real number or \"amax\"",
        ),
        (
            lambda: eqxrules.FloatQuantize(scale=-1.0),
            ValueError,
            r"`scale` \(=-1.0\) must be finite and positive, or \"amax\"",
        ),
        (
            lambda: eqxrules.NVFP4Quantize(axis=(0, 1, 2)),
            TypeError,
            r"`nvfp4_quantize`: `axis` \(=\(0, 1, 2\)\) must be an int, or a pair",
        ),
        (
            lambda: eqxrules.NVFP4Quantize(axis=(0, -2))(jnp.ones((16, 16))),
            ValueError,
            r"`axis` \(=\(0, -2\)\) must name two different axes",
        ),
        (
            lambda: eqxrules.NVFP4Quantize(axis=(0, 1))(jnp.ones((16, 24))),
            ValueError,
            r"`block_size` \(=16\) must divide .* axis 1 .* length is 24",
        ),
    ],
)
def test_bad_options_are_clear_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


# Square weight blocks on an operand whose dimensions no block divides (issue 40
# §3): attention's `q · kᵀ` over 24 tokens under nvfp4(), whose 16x16 blocks land
# on `k`'s tokens x features in the input-gradient product. Each quantiser pads
# with zeros, which change no scale, and slices back: the value and both
# gradients equal those of the same call on inputs padded with zero tokens to 32
# (nearest rounding and no Hadamard transform, so that no draw depends on the
# shapes).
_ATTENTION = "qhd,khd->hqk"


def _attention_vjp(q: jax.Array, k: jax.Array) -> tuple[np.ndarray, ...]:
    import dataclasses

    from eqxrules import recipes

    recipe = dataclasses.replace(
        recipes.nvfp4(), gradient_rounding="nearest", hadamard=None
    )

    def f(q, k):
        return eqxrules.quantized_einsum(_ATTENTION, q, k, recipe=recipe)

    y, vjp = jax.vjp(f, q, k)
    # The same cotangent at each (head, query, key) whatever the padding, 0 on the
    # padded tokens.
    h, i, j = jnp.meshgrid(*(jnp.arange(n) for n in y.shape), indexing="ij")
    dy = jnp.where((i < 24) & (j < 24), jnp.cos(100.0 * h + 7.0 * i + j), 0.0)
    return (np.asarray(y), *map(np.asarray, vjp(dy)))


def _attention_mismatches() -> list[str]:
    q = jax.random.normal(jax.random.key(0), (24, 4, 16))
    k = jax.random.normal(jax.random.key(1), (24, 4, 16))
    y, dq, dk = _attention_vjp(q, k)
    pad = ((0, 8), (0, 0), (0, 0))
    y32, dq32, dk32 = _attention_vjp(jnp.pad(q, pad), jnp.pad(k, pad))
    pairs = {"y": (y, y32[:, :24, :24]), "dq": (dq, dq32[:24]), "dk": (dk, dk32[:24])}
    return [n for n, (a, b) in pairs.items() if not np.array_equal(a, b)]


def test_square_blocks_pad_a_dimension_no_block_divides():
    assert _attention_mismatches() == []


def test_square_blocks_padded_with_large_values_are_caught(fresh_products):
    """Planted: the padding of square blocks' axes is 1e3, not zeros (it takes
    the blocks' scales)."""
    from eqxrules._lowp import ops

    def large(v, axis, multiple):
        n = -v.shape[axis] % multiple
        widths = [(0, 0)] * v.ndim
        widths[axis] = (0, n)
        return jnp.pad(v, widths, constant_values=1e3)

    fresh_products.setattr(ops, "pad_axis", large)
    assert "dq" in _attention_mismatches()
