"""The random bits stochastic rounding reads, computed independently of eqxrules: the
counter-based generator that `FloatQuantize`'s docstring documents, in NumPy with
uint64 arithmetic (every product exact, then reduced mod 2^32), from Wellons'
published `lowbias32` constants. Only the two seed words come from JAX (they are
`jax.random.bits(key, (2,), jnp.uint32)` by definition)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

_MASK = np.uint64(0xFFFFFFFF)


def lowbias32(x: np.ndarray) -> np.ndarray:
    """Wellons' `lowbias32` on uint64 `x` holding 32-bit words."""
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & _MASK
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & _MASK
    return x ^ (x >> np.uint64(16))


def numpy_bits(key, shape: tuple[int, ...]) -> np.ndarray:
    """`w_i = h(h(i ^ s0) ^ s1)` for the flat row-major index `i`, as uint32."""
    s0, s1 = (np.uint64(s) for s in np.asarray(jax.random.bits(key, (2,), jnp.uint32)))
    i = np.arange(math.prod(shape), dtype=np.uint64)
    return lowbias32(lowbias32(i ^ s0) ^ s1).astype(np.uint32).reshape(shape)
