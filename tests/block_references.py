"""The block quantisers the field's recipes use, written out in NumPy from their
statements, tile by tile (each tile or block cut out of the matrix by slicing, not
by a reshape): float32 arithmetic where the statement rounds to float32, casts by
`ml_dtypes` for the element and scale formats, logarithms in float64 for the
power-of-two exponents. Where the backend flushes float32 subnormals to zero
(XLA's CPU, inputs and results) so do these, at both ends; and a quotient that is
not by a power of two is the backend's (`backend.quotient`: correctly rounded on
the CPU, within 2 ulps on a GPU). For matrices (two axes), as the tests use
them."""

from __future__ import annotations

import math
from collections.abc import Iterator

import ml_dtypes
import numpy as np
from backend import ftz, quotient

F32 = np.float32
MAX = {"e4m3": 448.0, "e5m2": 57344.0, "e2m1": 6.0}
EMAX = {"e4m3": 8, "e5m2": 15, "e2m1": 2}
_DTYPE = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e2m1": ml_dtypes.float4_e2m1fn,
}


def cast(fmt: str, y) -> np.ndarray:
    """`y` (float32, within ±max) rounded by `ml_dtypes`' cast to the format; NaN
    stays NaN."""
    y = np.asarray(y, F32)
    with np.errstate(invalid="ignore", over="ignore"):
        r = y.astype(_DTYPE[fmt]).astype(F32)
    return np.where(np.isnan(y), F32(np.nan), r)


def tiles(shape: tuple[int, int], axis, size: int) -> Iterator[tuple[slice, slice]]:
    """The slices of each tile of a matrix: `size` consecutive elements along
    `axis` (0 or 1, or -1), or `size` x `size` squares for `axis=(0, 1)`."""
    rows, cols = shape
    if isinstance(axis, tuple):
        for i in range(0, rows, size):
            for j in range(0, cols, size):
                yield slice(i, i + size), slice(j, j + size)
    elif axis % 2 == 1:
        for i in range(rows):
            for j in range(0, cols, size):
                yield slice(i, i + 1), slice(j, j + size)
    else:
        for j in range(cols):
            for i in range(0, rows, size):
                yield slice(i, i + size), slice(j, j + 1)


def _spread(shape, tiles_: list, values) -> np.ndarray:
    """A float32 matrix of `shape` holding each tile's value over the tile."""
    out = np.empty(shape, F32)
    for t, v in zip(tiles_, values):
        out[t] = v
    return out


def block_float(x, fmt: str, size: int, axis) -> np.ndarray:
    """DeepSeek-V3's tiles: per tile, s = max(a/M, 2^-126) in float32,
    q = cast(clip(x/s, ±M))·s; a tile holding a NaN or an inf is NaN. (The
    quotients of every tile at once: two calls to the backend.)"""
    x = ftz(np.asarray(x, F32))
    M = F32(MAX[fmt])
    ts = list(tiles(x.shape, axis, size))
    a = np.array([np.max(np.abs(x[t])) for t in ts], F32)
    s = _spread(x.shape, ts, np.maximum(quotient(a, M), F32(2.0**-126)))
    with np.errstate(over="ignore", invalid="ignore"):
        out = cast(fmt, np.clip(quotient(x, s), -M, M)) * s
    for t, top in zip(ts, a):
        if not np.isfinite(top):
            out[t] = np.nan
    return ftz(out)


def pow2(x, fmt: str, size: int, axis, rule: str) -> np.ndarray:
    """Power-of-two scales per tile: X = 2^k, k = floor(log2 a) - emax (`"floor"`,
    OCP MX) or ceil(log2(a / M)) (`"ceil"`), clipped to [-127, 127];
    q = cast(clip(x/X, ±M))·X; a tile holding a NaN or an inf is NaN. A row (row-
    wise scaling) is a tile of the whole axis."""
    x = ftz(np.asarray(x, F32))
    out = np.empty_like(x)
    M = MAX[fmt]
    for t in tiles(x.shape, axis, size):
        b = x[t]
        a = float(np.max(np.abs(b)))
        if not math.isfinite(a):
            out[t] = np.nan
            continue
        if a == 0:
            k = -127
        elif rule == "floor":
            k = math.floor(math.log2(a)) - EMAX[fmt]
        else:
            k = math.ceil(math.log2(a / M))
        X = np.ldexp(F32(1), min(max(k, -127), 127)).astype(F32)
        with np.errstate(over="ignore"):
            out[t] = cast(fmt, np.clip(b / X, -M, M)) * X
    return ftz(out)


def nvfp4(x, axis, four_over_six: bool) -> np.ndarray:
    """NVFP4: t = A/(R·6) over the matrix, R = 448 (256 with Four Over Six); per
    block of 16 (or 16x16), s_m = cast_e4m3(clip(a/m/t, 0, 448)) and
    q_m = cast_e2m1(clip(x/(t·s_m), ±6))·(t·s_m), zeros where s_m is 0; m = 6,
    or with Four Over Six whichever of 4 and 6 gives the lower sum of squared
    errors (in float64; 6 on a tie); a NaN or inf anywhere makes everything NaN.
    (The quotients of every block at once, per m.)"""
    x = ftz(np.asarray(x, F32))
    A = np.max(np.abs(x))
    if not np.isfinite(A):
        return np.full_like(x, np.nan)
    t = quotient(F32(A), F32((256 if four_over_six else 448) * 6))
    ts = list(tiles(x.shape, axis, 16))
    a = np.array([np.max(np.abs(x[tile])) for tile in ts], F32)
    candidates = []
    for m in (6, 4) if four_over_six else (6,):
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            s = cast("e4m3", np.clip(quotient(quotient(a, F32(m)), t), 0, 448))
            d = (t * s).astype(F32)
            q = cast("e2m1", np.clip(quotient(x, _spread(x.shape, ts, d)), -6, 6))
            q = q * _spread(x.shape, ts, d)
        candidates.append((s, q))
    out = np.empty_like(x)
    for i, tile in enumerate(ts):
        b = x[tile]
        best = None
        for s, q in candidates:
            qb = q[tile] if s[i] > 0 else b * F32(0)
            error = np.sum((qb.astype(np.float64) - b) ** 2)
            if best is None or error < best[0]:  # the first (6) on a tie
                best = (error, qb)
        assert best is not None
        out[tile] = best[1]
    return ftz(out)


def cases(size: int, rows: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    """Matrices of `rows` x 4 tiles of `size` along their rows (and 4·`size`
    rows): random; heavy-tailed; random with tiles of very different scales;
    signed zeros; tiny (near the bottom of float32); each tile's amax exactly a
    power of two or one ulp below; a NaN; an inf."""
    rng = np.random.default_rng(seed)
    shape = (4 * size, 4 * size)
    base = rng.standard_normal(shape).astype(F32)
    out = {"random": base, "heavy": rng.standard_t(2, shape).astype(F32)}
    scales = 10.0 ** rng.integers(-6, 6, (4, 4))
    out["scales"] = (base * np.kron(scales, np.ones((size, size)))).astype(F32)
    zeros = np.zeros(shape, F32)
    zeros[::2] = -0.0
    out["zeros"] = zeros
    out["tiny"] = (np.abs(base) * F32(2.0**-120)).astype(F32)
    for name, top in (("pow2", F32(4)), ("below_pow2", np.nextafter(F32(4), F32(0)))):
        m = np.clip(base, -3.9, 3.9).astype(F32)
        m[np.arange(shape[0]), np.arange(shape[1])] = -top  # one in every tile
        m[:, ::size] = top
        out[name] = m
    nan, inf = base.copy(), base.copy()
    nan[1, 2] = np.nan
    inf[5, 3] = np.inf
    out["nan"], out["inf"] = nan, inf
    return out


def mismatches(got, want) -> int:
    """Elements that differ in their bits (NaN matching NaN)."""
    got, want = np.asarray(got, F32), np.asarray(want, F32)
    nan = np.isnan(want)
    bits = got.view(np.uint32) != want.view(np.uint32)
    return int(np.sum(np.isnan(got) != nan) + np.sum(bits[~nan]))
