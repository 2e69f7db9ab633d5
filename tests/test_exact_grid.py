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

Every grid is listed with the path it takes (`_paths`: dyadic, the proved float32
formula, or the table), so that each path meets these inputs; float32 inputs are
also run eagerly (one rounding per operation, where jitted XLA fuses multiply-adds).

Planted defects: the 0.1.0 formula, which computes `x - lo` first; formulas the
proof rejects (the split step dropped, a tie sent the wrong way) and the dyadic path
on an odd `lo/step`, each forced and caught; a multiply-add model that leaves out
fusion, which misses what XLA computes; and a sum rounded twice.
"""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import eqxrules
from eqxrules._rules import _paths
from eqxrules._rules._exact import grid, grid_index, round_to
from eqxrules._rules._paths import Dyadic, Formula, dyadic, formula, proved

# Each grid with the path it takes (see `eqxrules._rules._paths`) in float32.
PATHS = {
    (8, -1.0, 1.0): "formula",  # the default; one tie, at 0
    (2, -1.0, 1.0): "formula",
    (4, -1.0, 1.0): "formula",
    (8, 0.0, 1.0): "formula",  # DoReFa; one tie, at 1/2
    (2, 0.0, 1.0): "formula",
    (4, 0.0, 1.0): "formula",
    (3, -0.3, 0.7): "formula",  # asymmetric, neither end representable
    (6, -0.7, 0.2): "formula",
    (8, -0.5, 1.5): "formula",
    (8, -127.5, 127.5): "formula",  # a tie at every threshold
    (8, 0.0, 6.0): "formula",  # three ties, of both parities
    (4, -7.0, 8.0): "formula",  # a power-of-two step, but lo/step odd
    (8, -128.0, 127.0): "dyadic",
    (4, 0.0, 15.0): "dyadic",
    (13, 0.0, 1.0): "table",
}
GRIDS = list(PATHS)
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


@pytest.mark.first_case_quick
@pytest.mark.parametrize("inputs", list(INPUTS))
@pytest.mark.parametrize("bits,lo,hi", GRIDS, ids=IDS)
def test_ste_quantize_is_exact(inputs, bits, lo, hi):
    x = INPUTS[inputs](bits, lo, hi)
    out = run(new_quantize, x, bits, lo, hi)
    assert out.dtype == x.dtype
    bad = failures(x, out, bits, lo, hi, _flushable(x))
    assert bad == {"index": 0, "ulp": 0, "nan": 0}


@pytest.mark.first_case_quick
@pytest.mark.parametrize("inputs", list(INPUTS))
@pytest.mark.parametrize("bits", [1, 2, 8])
def test_dorefa_is_exact(inputs, bits):
    x = INPUTS[inputs](bits, 0.0, 1.0)
    out = run(lambda x, b, lo, hi: eqxrules.dorefa_quantize(x, bits=b), x, bits, 0, 1)
    bad = failures(x, out, bits, 0.0, 1.0, _flushable(x))
    assert bad == {"index": 0, "ulp": 0, "nan": 0}


@pytest.mark.first_case_quick
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.parametrize("out", [jnp.float32, jnp.bfloat16])
def test_each_grid_takes_the_path_stated(out):
    names = {Dyadic: "dyadic", Formula: "formula", type(None): "table"}
    taken = {g: names[type(_paths.plan(*g, jnp.float32, out))] for g in PATHS}
    assert taken == PATHS
    assert _paths.plan(8, -1.0, 1.0, jnp.float64, jnp.float64) is None
    ties = {g: formula(*g, out).tie for g, p in PATHS.items() if p == "formula"}
    assert (ties[8, -1.0, 1.0], ties[8, 0.0, 1.0], ties[3, -0.3, 0.7]) == (
        "up",
        "up",
        "down",
    )
    assert ties[8, -127.5, 127.5] == ties[8, 0.0, 6.0] == "even"


QUANTISERS = {
    "ste_quantize": lambda x, b, lo, hi: eqxrules.ste_quantize(x, bits=b, lo=lo, hi=hi),
    "dorefa_quantize": lambda x, b, lo, hi: eqxrules.dorefa_quantize(x, bits=b),
}
F32_CASES = [("dorefa_quantize", b, 0.0, 1.0) for b in (2, 4, 8)] + [
    ("ste_quantize", *g) for g in GRIDS
]


@pytest.mark.first_case_quick
@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize("name,bits,lo,hi", F32_CASES, ids=str)
def test_float32_at_every_threshold_and_level_jitted_and_eager(
    name, bits, lo, hi, mode
):
    """Every level and threshold, and the float32 either side of each: jitted (XLA
    fuses multiply-adds on this CPU) and eager (one rounding per operation)."""
    x = f32_points(bits, lo, hi)
    f = QUANTISERS[name]
    if mode == "jit":
        out = run(f, x, bits, lo, hi)
    else:
        out = np.asarray(f(jnp.asarray(x), bits, lo, hi))
    assert failures(x, out, bits, lo, hi, _flushable(x)) == {
        "index": 0,
        "ulp": 0,
        "nan": 0,
    }


@pytest.mark.first_case_quick
@pytest.mark.parametrize("inputs", ["bfloat16", "float32"])
@pytest.mark.parametrize(
    "bits,lo,hi", [g for g, p in PATHS.items() if p == "formula"], ids=str
)
def test_the_formula_index_is_exact(inputs, bits, lo, hi):
    """The formula path's index, not only its value, over every input in range."""
    x = INPUTS[inputs](bits, lo, hi)
    xs = as_f64(x)
    keep = (xs >= lo) & (xs <= hi) & ~_flushable(x)
    w = jnp.asarray(x[keep]).astype(jnp.float32)
    f = formula(bits, lo, hi, jnp.float32)
    k = np.asarray(jax.jit(lambda w: _paths.formula_value(w, f)[0])(w))
    np.testing.assert_array_equal(k, exact_index(xs[keep], bits, lo, hi))


def _forced(path, name, x, bits, lo, hi, monkeypatch):
    """The quantiser's output with `plan` forced to give `path`."""
    with monkeypatch.context() as m:
        m.setattr(_paths, "plan", lambda *args: path)
        return run(QUANTISERS[name], x, bits, lo, hi)


def test_the_proof_rejects_wrong_formulas_that_are_wrong(monkeypatch):
    """Planted defects: DoReFa's 8-bit formula with the step, threshold and level
    each one float32 (the split dropped), and with the tie at 1/2 sent down. The
    proof rejects both, and each gives wrong levels where the test looks."""
    f = formula(8, 0.0, 1.0, jnp.float32)
    assert proved(f, 8, 0.0, 1.0, jnp.float32)
    zero = np.float32(0)
    unsplit = f._replace(
        step_hi=np.float32(1 / 255),
        step_lo=zero,
        threshold_hi=np.float32(f.threshold_hi + f.threshold_lo),
        threshold_lo=zero,
        level_hi=np.float32(f.level_hi + f.level_lo),
        level_lo=zero,
    )
    x = f32_points(8, 0.0, 1.0)
    for wrong in (unsplit, f._replace(tie="down")):
        assert not proved(wrong, 8, 0.0, 1.0, jnp.float32)
        out = _forced(wrong, "dorefa_quantize", x, 8, 0.0, 1.0, monkeypatch)
        bad = failures(x, out, 8, 0.0, 1.0, _flushable(x))
        assert bad["index"] + bad["ulp"] > 0, wrong


def test_the_dyadic_path_needs_an_even_lo(monkeypatch):
    """`round(x / 2^e) * 2^e` sends ties to the even multiple of the step: the
    even index only if `lo / 2^e` is even. `dyadic` takes only such grids, and the
    planted defect, the dyadic path forced on `[-7, 8]`, sends ties to odd
    indices."""
    assert dyadic(8, -128.0, 127.0, jnp.float32) == Dyadic(-128.0, 127.0, 1.0, 1.0)
    assert dyadic(2, 0.0, 0.375, jnp.float32) == Dyadic(0.0, 0.375, 8.0, 0.125)
    for g in [(4, -7.0, 8.0), (8, -127.5, 127.5), (2, 0.0, 1.0), (8, -1.0, 1.0)]:
        assert dyadic(*g, jnp.float32) is None, g
    x = f32_points(4, -7.0, 8.0)
    out = _forced(
        Dyadic(-7.0, 8.0, 1.0, 1.0), "ste_quantize", x, 4, -7.0, 8.0, monkeypatch
    )
    assert failures(x, out, 4, -7.0, 8.0, _flushable(x))["index"] > 0


def _pairs(seed: int):
    """Integers `m` and float32 constants, drawn, for the multiply-add models."""
    rng = np.random.default_rng(seed)
    m = rng.integers(-300, 300, 4096).astype(np.float32)
    c = rng.standard_normal(4).astype(np.float32)
    return m, c


def test_the_models_cover_what_xla_computes():
    """Every value XLA gives `_pair` and a sum of two `_pair`s, jitted (fused on
    this CPU) and eager (rounded each), is one the proof models; the planted defect,
    the rounded-each model alone, misses jitted values."""
    m, (a, b, c, _) = _pairs(0)
    m64 = m.astype(np.float64)
    for lo in (b, np.float32(0)):

        def pair(m, a=a, lo=lo):
            return _paths._pair(m, a, lo)

        def total(m, lo=lo):
            return _paths._pair(m, a, lo) + _paths._pair(m, c, lo)

        for f, models in (
            (pair, _paths._models(m64, a, lo)),
            (total, _paths._sums(m64, (a, lo), (c, lo))),
        ):
            for got in (
                np.asarray(jax.jit(f)(jnp.asarray(m))),
                np.asarray(f(jnp.asarray(m))),
            ):
                assert np.any([got == v for v in models], axis=0).all()
    fused = np.asarray(jax.jit(lambda m: _paths._pair(m, a, b))(jnp.asarray(m)))
    rounded_each = ((m64 * a).astype(np.float32) + b).astype(np.float32)
    assert (fused != rounded_each).any()


def test_add32_rounds_once():
    """`_add32` against `Fraction` arithmetic, on drawn sums and on a sum one float64
    rounding puts on a float32 tie (the planted defect, rounding twice, fails it)."""
    m, (a, b, _, _) = _pairs(1)
    x, y = m.astype(np.float64) * np.float64(a), np.full(m.shape, np.float64(b))
    x, y = np.append(x, 1 + 2.0**-24), np.append(y, 2.0**-80)
    want = [
        round_to(Fraction(float(p)) + Fraction(float(q)), jnp.float32)
        for p, q in zip(x, y)
    ]
    np.testing.assert_array_equal(_paths._add32(x, y), np.asarray(want, np.float32))
    assert (x + y).astype(np.float32)[-1] != want[-1]


_SHARDED = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import eqxrules
from eqxrules._rules import _exact
assert eqxrules.__file__.startswith(sys.argv[2])  # this checkout's
if sys.argv[1] == "plain":  # the planted defect: no `out_sharding`
    _exact._lookup = lambda t, i: jnp.asarray(t).at[i].get(mode="clip")
x = np.linspace(-0.5, 1.5, 64, dtype=np.float32).reshape(2, 32)
step = jax.jit(jax.value_and_grad(
    lambda x: eqxrules.ste_quantize(x, bits=13, lo=0.0, hi=1.0).sum()
))
mesh = jax.make_mesh((2,), ("batch",))
got = step(jax.device_put(x, NamedSharding(mesh, P("batch"))))
for a, b in zip(step(x), got):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
"""


@pytest.mark.slow
def test_the_table_path_under_sharding_in_types():
    """No catalogue example takes the table path any more, so `test_sharding.py`
    does not meet its gather: a 13-bit grid on 2 simulated devices, the batch
    sharded, equals one device; without `out_sharding` (the planted defect) the
    gather raises."""
    import os
    import pathlib
    import subprocess
    import sys

    root = str(pathlib.Path(__file__).resolve().parent.parent)
    path = [root, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}

    def run_script(mode):
        return subprocess.run(
            [sys.executable, "-c", _SHARDED, mode, root],
            capture_output=True,
            text=True,
            env=env,
        )

    ok = run_script("out_sharding")
    assert ok.returncode == 0, ok.stderr[-2000:]
    plain = run_script("plain")
    assert plain.returncode != 0 and "is not found in mesh" in plain.stderr
