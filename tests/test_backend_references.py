"""The references' view of the backend (`backend.py`): the backend's quotient is
taken only after it is checked, and subnormals are flushed exactly where the
backend flushes them."""

from __future__ import annotations

import backend
import jax
import jax.numpy as jnp
import numpy as np
import pytest

F32 = np.float32


def _operands() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (
        rng.uniform(1, 2, 4096).astype(F32),
        rng.uniform(1, 4, 4096).astype(F32),
    )


def test_the_backends_quotient_is_within_its_limit():
    a, b = _operands()
    q = backend.quotient(a, b)
    assert q.dtype == F32
    ulps = backend._ulps(q, (a / b).astype(F32))
    limit = backend.DIVISION_ULPS.get(jax.default_backend(), 2.0)
    assert np.max(ulps) <= limit


def test_a_quotient_beyond_its_limit_is_refused(monkeypatch):
    """Planted: a division 3 ulps off (beyond any backend's limit)."""
    a, b = _operands()
    monkeypatch.setattr(
        backend,
        "_divide",
        lambda x, y: jnp.asarray(
            np.nextafter(np.nextafter(np.nextafter(x / y, F32(9)), F32(9)), F32(9))
        ),
    )
    with pytest.raises(AssertionError, match="division ulps"):
        backend.quotient(a, b)


def test_ftz_flushes_as_the_backend_does():
    """A subnormal result of the backend's own product is what `ftz` makes of the
    exact one."""
    tiny = F32(2.0**-120) * F32(2.0**-10)  # 2^-130 in NumPy: subnormal, kept
    got = np.asarray(jax.jit(jnp.multiply)(F32(2.0**-120), F32(2.0**-10)))
    assert backend.ftz(np.asarray([tiny]))[0] == got
    assert (got == 0) == backend.flushes_subnormals()
