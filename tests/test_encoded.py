"""Low-precision arrays (issue 41 §1, §2): every quantiser of the float formats
gives its value in parts (`encode`), element codes times block and tensor scales,
such that

- `decode(encode(x))` is its value, bit for bit (one definition: its value is
  computed so);
- the parts survive their storage dtypes exactly (`stored`, `restored`): FP8
  codes in a byte, FP4 codes in half of one, MX exponents in an `int8`, NVFP4's
  scales in E4M3;
- `payload` is exactly representable in bfloat16 (so in TF32), and times the
  tensor scale (`e.tensor`, which the payload itself does not read: a ragged
  product's residuals take every group's payload at once) it is the value within
  one more rounding; or, for a quantiser
  whose scales are float32 per block (`exact_payload` false: `BlockFloatQuantize`),
  the value itself, bit for bit, with no tensor scale.

On every example of `FloatQuantize`, `MXQuantize`, `NVFP4Quantize`,
`BlockFloatQuantize` and `RowFloatQuantize` in the catalogue, on random data, a
NaN, zeros and bfloat16 input. Planted beside them: a payload with the tensor scale
left in (not exact in bfloat16, and reading it), a storage dtype too narrow for the
codes, and a quantiser with float32 block scales that claims an exact payload.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxrules
from eqxrules._rules._encoded import Encoded, LowPrecision

KEY = jax.random.key(2)
QUANTIZERS = [
    q
    for cls in (
        eqxrules.FloatQuantize,
        eqxrules.MXQuantize,
        eqxrules.NVFP4Quantize,
        eqxrules.BlockFloatQuantize,
        eqxrules.RowFloatQuantize,
    )
    for q in cls.examples(KEY)
]


def _inputs(q):
    shape = (32, 64)
    x = jax.random.normal(jax.random.key(1), shape) * 3
    return {
        "random": x,
        "nan": x.at[3, 5].set(jnp.nan),
        "zeros": jnp.zeros(shape),
        "bfloat16": x.astype(jnp.bfloat16),
    }


def _key(q):
    return KEY if q.needs_key() else None


def _problems(q, payload=None, storage=None, exact=None) -> list[str]:
    """What fails of the statements above for `q` (`exact`: whether it claims an
    exact payload, `q.exact_payload` unless given), on every input."""
    out = []
    payload = payload or q.payload
    exact = q.exact_payload if exact is None else exact
    for name, x in _inputs(q).items():
        e = q.encode(x, key=_key(q))
        value = q(x, key=_key(q))
        if not np.array_equal(q.decode(e, x), value, equal_nan=True):
            out.append(f"{name}: decode(encode(x)) is not the value")
        kept = q.restored(_stored(q, e, storage))
        if not all(
            np.array_equal(a, b, equal_nan=True)
            for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(e))
        ):
            out.append(f"{name}: the stored parts are not the parts")
        p, t = payload(e, x)
        if t is not e.tensor:
            out.append(f"{name}: the payload's tensor scale is not `e.tensor`")
        alone, _ = payload(e._replace(tensor=None), x)
        if not np.array_equal(alone, p, equal_nan=True):
            out.append(f"{name}: the payload reads the tensor scale")
        p = np.asarray(p, np.float32)
        # The value before its cast to the input's dtype.
        v = np.asarray(q.decode(e, jax.ShapeDtypeStruct(x.shape, jnp.float32)))
        if not exact:
            if t is not None or not np.array_equal(p, v, equal_nan=True):
                out.append(f"{name}: the payload is not the value")
            continue
        if not np.array_equal(
            np.asarray(jnp.asarray(p, jnp.bfloat16), np.float32), p, equal_nan=True
        ):
            out.append(f"{name}: the payload is not exact in bfloat16")
        scaled = p if t is None else p * np.float32(t)
        finite = np.isfinite(v)
        if not np.all(
            np.abs(scaled[finite] - v[finite]) <= 2.0**-22 * np.abs(v[finite])
        ):
            out.append(f"{name}: the payload times the tensor scale is not the value")
    return out


def _stored(q, e: Encoded, storage=None) -> Encoded:
    if storage is None:
        return q.stored(e)
    codes, scales = storage
    return Encoded(
        e.codes.astype(codes),
        None if e.scales is None else e.scales.astype(scales),
        e.tensor,
    )


@pytest.mark.first_case_quick
@pytest.mark.parametrize("q", QUANTIZERS, ids=repr)
def test_a_quantisers_value_is_its_codes_times_its_scales(q):
    assert isinstance(q, LowPrecision)
    assert _problems(q) == []


def test_the_storage_is_a_quarter_of_float32_or_an_eighth():
    """XLA's own count of the stored parts' bytes (it packs FP4 two to a byte)."""
    x = jax.random.normal(KEY, (64, 64))
    for q, fraction in (
        (eqxrules.FloatQuantize(format="e4m3", scale="amax"), 1 / 4),
        (eqxrules.MXQuantize(format="e4m3"), 1 / 4 + 1 / 128),
        (eqxrules.NVFP4Quantize(), 1 / 8 + 1 / 64),
    ):
        compiled = jax.jit(lambda x, q=q: q.stored(q.encode(x))).lower(x).compile()
        held = compiled.memory_analysis().output_size_in_bytes
        assert held <= fraction * x.nbytes + 64, (q, held / x.nbytes)  # + scalars


def test_planted_payload_with_its_tensor_scale_is_caught():
    q = eqxrules.FloatQuantize(scale="amax")

    def scaled(e, like):
        return e.codes * (1.0 if e.tensor is None else e.tensor), None

    problems = _problems(q, payload=scaled)
    assert any("not exact in bfloat16" in p for p in problems)
    assert any("reads the tensor scale" in p for p in problems)
    assert any("tensor scale is not `e.tensor`" in p for p in problems)


def test_planted_storage_too_narrow_is_caught():
    q = eqxrules.FloatQuantize(format="e4m3", scale="amax")
    narrow = (jnp.float4_e2m1fn, None)
    assert any("stored parts" in p for p in _problems(q, storage=narrow))


def test_planted_float32_block_scales_claiming_an_exact_payload_are_caught():
    q = eqxrules.BlockFloatQuantize(block_size=16)
    assert not q.exact_payload
    assert any("not exact in bfloat16" in p for p in _problems(q, exact=True))


def test_planted_payload_other_than_the_value_is_caught():
    """Planted: float32 block scales, the value's payload rounded to bfloat16."""
    q = eqxrules.BlockFloatQuantize(block_size=16)

    def rounded(e, like):
        value = q.decode(e, jax.ShapeDtypeStruct(like.shape, jnp.float32))
        return value.astype(jnp.bfloat16).astype(jnp.float32), None

    assert any("not the value" in p for p in _problems(q, payload=rounded))
