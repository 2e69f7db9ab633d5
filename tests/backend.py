"""What the backend's float32 arithmetic does, for references written in NumPy that
must agree with it bit for bit (`block_references.py`, the block formats of
`test_float_formats.py` and `test_recipe_formats.py`).

Two things differ between backends, both measured by `benchmarks/gpu.py` on an H200
(`benchmarks/GPU.md`):

- **Subnormals.** XLA's CPU flushes float32 subnormals to zero, inputs and results
  alike; the H200 flushes neither. `flushes_subnormals()` asks the backend, and
  `ftz` flushes exactly when it does.
- **Division.** XLA's CPU divides correctly rounded; the H200's float32 division is
  within 2 ulps (CUDA's `div.full.f32`: 30% of quotients of random operands not
  correctly rounded, none beyond 1.99 ulps). A scale `amax / M` one ulp off moves
  every element of its block by an ulp, so a reference takes the backend's quotient
  of the same float32 operands (`quotient`), after checking it: equal to NumPy's
  correctly rounded one on the CPU, within 2 ulps of it elsewhere. Everything else
  in a reference (the format's rounding, clipping, the scale rules) stays NumPy's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from eqxrules._rules._formats import divide

F32 = np.float32
TINY = np.finfo(F32).tiny
# The most a backend's float32 quotient may be from the correctly rounded one, in
# units in the last place: exact on the CPU; CUDA's `div.full.f32` elsewhere.
DIVISION_ULPS = {"cpu": 0.0}
OTHER_DIVISION_ULPS = 2.0


@functools.cache
def flushes_subnormals() -> bool:
    """Whether the backend flushes float32 subnormals to zero: a subnormal input
    (2^-127 · 2, flushed first, is 0 where 2^-126 is expected) and a subnormal
    result (2^-120 · 2^-10). A backend that flushes one and not the other would
    need references that tell them apart: an error here."""
    double = jax.jit(jnp.multiply)
    inputs = float(double(F32(2.0**-127), F32(2.0))) == 0.0
    results = float(double(F32(2.0**-120), F32(2.0**-10))) == 0.0
    assert inputs == results, (jax.default_backend(), inputs, results)
    return inputs


def ftz(a) -> np.ndarray:
    """`a` (float32) with subnormals as zeros of their sign where the backend
    flushes them; as it is elsewhere."""
    a = np.asarray(a, F32)
    if not flushes_subnormals():
        return a
    with np.errstate(invalid="ignore"):  # inf · 0, not selected
        return np.where(np.abs(a) < TINY, a * F32(0), a).astype(F32)


# The rules' own division (`_formats.divide`: its divisor depends on `a`, so XLA
# divides and does not multiply by a reciprocal).
_divide = jax.jit(divide)


def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want| in units of float32's spacing at `want` (0 where both are
    equal, NaN where both are NaN; inf where one is not finite and they differ)."""
    got, want = got.astype(np.float64), want.astype(np.float64)
    spacing = np.spacing(np.abs(want).astype(F32)).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        e = np.abs(got - want) / np.maximum(spacing, float(np.spacing(F32(0))))
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    return np.where(same, 0.0, np.where(np.isfinite(e), e, np.inf))


def quotient(a, b) -> np.ndarray:
    """`a / b` in float32 as the backend divides, which the rules do
    (`_formats.divide`), checked against NumPy's correctly rounded quotient:
    equal on the CPU, within `OTHER_DIVISION_ULPS` elsewhere (each after `ftz`: a
    flushed quotient is 0 on both sides)."""
    a, b = np.broadcast_arrays(np.asarray(a, F32), np.asarray(b, F32))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        exact = ftz(a / b)
    got = ftz(np.asarray(_divide(jnp.asarray(a), jnp.asarray(b)), F32))
    limit = DIVISION_ULPS.get(jax.default_backend(), OTHER_DIVISION_ULPS)
    worst = float(np.max(_ulps(got, exact), initial=0.0))
    assert worst <= limit, (jax.default_backend(), "division ulps", worst)
    return got if got.ndim else F32(got)
