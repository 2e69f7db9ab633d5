"""The static-grid quantisers against exact rational arithmetic.

For a grid of `n + 1 = 2**bits` levels `L_k = lo + k (hi - lo) / n` the exact index
of an input `x` is the `k` nearest `x`, ties to the even index: `#{j : T_j < x}`,
plus one at an exact tie `x == T_j` with `j` odd, where `T_j = (L_j + L_{j+1}) / 2`.
The reference below computes that in NumPy, vectorised, and exactly: the inputs
(bfloat16, float16, float32) are float64 numbers exactly, and each threshold `T_j`
(a `Fraction`, computed once) is replaced by `D_j`, the largest float64 `<= T_j`, with
a flag saying whether `D_j == T_j`. For a float64 `x`, `D_j < x` exactly when
`T_j < x` (nothing of float64 lies strictly between `D_j` and `T_j`), so
`np.searchsorted(D, x)` counts the thresholds below `x` with no rounding at all; a
tie is `x == D_j` where the flag is set. The values are then compared with the
exact levels (`Fraction`s) over the distinct (level, output) pairs only.

Inputs: every bfloat16 and float16 bit pattern, and in float32 every level, every
threshold and the float either side of each. Subnormal bfloat16 inputs (float32
subnormals, which XLA flushes) may act as zero; float16 subnormals are float32
normals and get no such leave.

The planted defect is the 0.1.0 formula, which computes `x - lo` first: it fails.
"""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import eqxrules
from eqxrules._rules._exact import grid, grid_index

GRIDS = [
    (8, -1.0, 1.0),
    (2, -1.0, 1.0),
    (8, 0.0, 1.0),
    (2, 0.0, 1.0),
    (3, -0.3, 0.7),  # asymmetric, neither end representable
    (8, -0.5, 1.5),
    (8, -127.5, 127.5),
]
IDS = [f"{b}bits[{lo},{hi}]" for b, lo, hi in GRIDS]


def _thresholds(bits, lo, hi):
    n = 2**bits - 1
    flo, step = Fraction(lo), (Fraction(hi) - Fraction(lo)) / n
    levels = [flo + k * step for k in range(n + 1)]
    ts = [flo + (j + Fraction(1, 2)) * step for j in range(n)]
    down = []
    for t in ts:
        d = float(t)
        if Fraction(d) > t:
            d = float(np.nextafter(d, -np.inf))
        down.append(d)
    exact = np.array([Fraction(d) == t for d, t in zip(down, ts)])
    return n, levels, ts, np.array(down), exact


def exact_index(x: np.ndarray, bits, lo, hi) -> np.ndarray:
    """The exact nearest index (ties to even) of each float64 `x`; -1 for NaN."""
    n, _, _, down, exact = _thresholds(bits, lo, hi)
    count = np.searchsorted(down, x, side="left")
    inner = np.minimum(count, n - 1)
    tie = (count < n) & exact[inner] & (down[inner] == x)
    k = np.where(tie & (count % 2 == 1), count + 1, count)
    return np.where(np.isnan(x), -1, k)


def _ulp(v: Fraction, dtype) -> Fraction:
    fi = ml_dtypes.finfo(dtype)
    a = abs(v)
    e = int(fi.minexp)
    if a >= Fraction(float(fi.tiny)):
        e = a.numerator.bit_length() - a.denominator.bit_length()
        while Fraction(2) ** e > a:
            e -= 1
        while Fraction(2) ** (e + 1) <= a:
            e += 1
    return Fraction(2) ** (e - int(fi.nmant))


def failures(x, out, bits, lo, hi, flushed_ok) -> dict[str, int]:
    """Counts of inputs whose output is not within one ulp (of the output dtype) of
    the exact nearest level: `index` where it is nearer another level's, `ulp`
    otherwise. NaN must give NaN. Where `flushed_ok`, the level of 0 also passes."""
    dtype = out.dtype
    xs = as_f64(x)
    k = exact_index(xs, bits, lo, hi)
    k0 = exact_index(np.zeros(1), bits, lo, hi)[0]
    _, levels, _, _, _ = _thresholds(bits, lo, hi)
    o = as_f64(out)
    bad = {"index": 0, "ulp": 0, "nan": int(np.sum(np.isnan(xs) != np.isnan(o)))}
    finite = ~np.isnan(xs)
    keys = np.stack([k[finite], o[finite], flushed_ok[finite]])
    triples, counts = np.unique(keys, axis=1, return_counts=True)

    def close(value, i):
        return abs(Fraction(value) - levels[i]) <= _ulp(levels[i], dtype)

    for (kk, oo, fl), c in zip(triples.T, counts):
        if close(oo, int(kk)) or (fl and close(oo, int(k0))):
            continue
        near = min(range(len(levels)), key=lambda i: abs(Fraction(oo) - levels[i]))
        bad["index" if near != kk else "ulp"] += int(c)
    return bad


def as_f64(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # NaN payloads of bfloat16
        return x.astype(np.float64)


def all_patterns(dtype) -> np.ndarray:
    return np.arange(2**16, dtype=np.uint16).view(dtype)


def f32_points(bits, lo, hi) -> np.ndarray:
    """Every level, every threshold, each rounded to float32, and one float32
    either side of each."""
    _, levels, ts, _, _ = _thresholds(bits, lo, hi)
    centre = np.array([float(v) for v in levels + ts], np.float32)
    return np.unique(
        np.concatenate(
            [
                centre,
                np.nextafter(centre, np.float32(-np.inf)),
                np.nextafter(centre, np.float32(np.inf)),
            ]
        )
    )


def _flushable(x: np.ndarray) -> np.ndarray:
    """Inputs that are float32 subnormals once widened: XLA may read them as 0."""
    with np.errstate(invalid="ignore"):
        w = x.astype(np.float32)
    return (w != 0) & (np.abs(w) < np.finfo(np.float32).tiny)


def old_quantize(x, bits, lo, hi):
    """The 0.1.0 formula, the planted defect: the index from `x - lo`, the level
    from `lo + (hi - lo) k / n`."""
    n = 2**bits - 1
    w = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    k = jnp.round((jnp.clip(w, lo, hi) - lo) * (n / (hi - lo)))
    return (lo + (hi - lo) * (k / n)).astype(x.dtype)


def new_quantize(x, bits, lo, hi):
    return eqxrules.ste_quantize(x, bits=bits, lo=lo, hi=hi)


def run(f, x, bits, lo, hi):
    return np.asarray(jax.jit(lambda x: f(x, bits, lo, hi))(jnp.asarray(x)))


INPUTS = {
    "bfloat16": lambda b, lo, hi: all_patterns(ml_dtypes.bfloat16),
    "float16": lambda b, lo, hi: all_patterns(np.float16),
    "float32": f32_points,
}


@pytest.mark.parametrize("inputs", list(INPUTS))
@pytest.mark.parametrize("bits,lo,hi", GRIDS, ids=IDS)
def test_ste_quantize_is_exact(inputs, bits, lo, hi):
    x = INPUTS[inputs](bits, lo, hi)
    out = run(new_quantize, x, bits, lo, hi)
    assert out.dtype == x.dtype
    bad = failures(x, out, bits, lo, hi, _flushable(x))
    assert bad == {"index": 0, "ulp": 0, "nan": 0}


@pytest.mark.parametrize("inputs", list(INPUTS))
@pytest.mark.parametrize("bits", [1, 2, 8])
def test_dorefa_is_exact(inputs, bits):
    x = INPUTS[inputs](bits, 0.0, 1.0)
    out = run(lambda x, b, lo, hi: eqxrules.dorefa_quantize(x, bits=b), x, bits, 0, 1)
    bad = failures(x, out, bits, 0.0, 1.0, _flushable(x))
    assert bad == {"index": 0, "ulp": 0, "nan": 0}


@pytest.mark.parametrize("inputs", ["bfloat16", "float32"])
@pytest.mark.parametrize("bits,lo,hi", GRIDS, ids=IDS)
def test_the_index_itself_is_exact(inputs, bits, lo, hi):
    """`grid_index` gives the exact index (ties to even) for every input, not only a
    value within an ulp of the right level."""
    x = INPUTS[inputs](bits, lo, hi)
    w = jnp.asarray(x).astype(jnp.float32)
    g = grid(bits, lo, hi, jnp.float32, jnp.float32)
    k = np.asarray(jax.jit(lambda w: grid_index(w, g, 2**bits - 1))(w))
    want = exact_index(as_f64(x), bits, lo, hi)
    flushed = _flushable(x)
    k0 = exact_index(np.zeros(1), bits, lo, hi)[0]
    ok = (k == want) | np.isnan(as_f64(x)) | (flushed & (k == k0))
    assert ok.all(), x[~ok][:8]


@pytest.mark.parametrize(
    "inputs,bits,lo,hi",
    [
        ("bfloat16", 8, -1.0, 1.0),
        ("float32", 8, -1.0, 1.0),
        ("float32", 8, -127.5, 127.5),
    ],
)
def test_the_old_formula_fails(inputs, bits, lo, hi):
    x = INPUTS[inputs](bits, lo, hi)
    bad = failures(x, run(old_quantize, x, bits, lo, hi), bits, lo, hi, _flushable(x))
    print(inputs, bits, lo, hi, len(x), bad)
    assert bad["index"] + bad["ulp"] > 0


def test_zero_and_the_sign_near_it():
    """The default grid (8 bits on [-1, 1]) has no zero level: 0 is the tie between
    -1/255 and +1/255 and goes to the even index, +1/255; every negative normal
    input goes to -1/255."""
    x = jnp.array([-1e-8, -0.0, 0.0, 1e-8, -6e-8], jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(eqxrules.ste_quantize(x)) * 255, [-1, 1, 1, 1, -1]
    )
    assert (
        float(eqxrules.ste_quantize(jnp.float32(1.0000001), lo=-127.5, hi=127.5)) == 1.5
    )


def test_quantized_layer_weights_are_the_exact_levels():
    """Through `Quantized`, the weight is the exact grid too: bfloat16 weights near
    zero keep their sign (the 0.1.0 formula sent them to +1/255)."""
    import equinox as eqx

    layer = eqx.nn.Linear(256, 1, key=jax.random.key(0), dtype=jnp.bfloat16)
    w = jnp.linspace(-1e-6, 1e-6, 256, dtype=jnp.float32).astype(jnp.bfloat16)
    layer = eqx.tree_at(lambda lay: lay.weight, layer, w[None])
    q = eqxrules.Quantized(layer, kernel_quantizer=eqxrules.SteQuantize())
    got = np.asarray(q.quantized_layer.weight, np.float32)[0]
    x = np.asarray(w)
    bad = failures(x, got.astype(x.dtype), 8, -1.0, 1.0, _flushable(x))
    assert bad == {"index": 0, "ulp": 0, "nan": 0}
    old = run(old_quantize, x, 8, -1.0, 1.0)
    assert failures(x, old, 8, -1.0, 1.0, _flushable(x))["index"] > 0
