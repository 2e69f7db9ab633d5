"""Shared by the tests of `eqxrules.testing.check_unbiased`: the problems (a
correct rounding onto a grid, its inputs and their neighbours) and the planted
defects, each modelled on a real bug. The roundings are written here and in
`benchmarks/sections/unbiased.py`, not with any eqxrules rule."""

from __future__ import annotations

import functools as ft
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from benchmarks.sections.unbiased import (
    format_values,
    grid_sr,
    integer_sr,
    neighbours,
)

DRAWS = 100_000  # the budget: at most this many draws
RATE = 1e-6  # the false-fail rate of every check of a correct rounding here
KEY = jax.random.key(19)
FORMATS = ("integers", "float8_e4m3fn", "float4_e2m1fn")


def _binomial_tail(n: int, p: float, k: int) -> float:
    """`P(Binomial(n, p) >= k)`, exactly (in float64)."""
    return sum(math.comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(k, n + 1))


def _most(n: int, p: float, rate: float = RATE) -> int:
    """The smallest count `k` above which a count has probability at most `rate`
    (`P(Binomial(n, p) > k) <= rate`), when each of `n` independent runs succeeds
    with probability at most `p`."""
    return next(k for k in range(n + 2) if _binomial_tail(n, p, k + 1) <= rate)


@ft.cache
def _format(name: str):
    """`(values, dtype)` of a grid: its sorted values and the rounding's output dtype."""
    if name == "integers":
        return np.arange(-64.0, 65.0), jnp.float32
    return format_values(getattr(ml_dtypes, name)), getattr(jnp, name)


@ft.cache
def _problem(name: str, size: int = 1024, p_range: tuple[float, float] = (0, 1)):
    """A correct rounding onto `name`; `x`: `size` values with `P(up)` uniform in
    `p_range`, in random gaps of the grid, then 64 representable values; and the
    neighbours of `x`."""
    values, dtype = _format(name)
    k1, k2, k3 = jax.random.split(jax.random.fold_in(KEY, len(name)), 3)
    # Gaps weighted by 1 / magnitude, so that small values and subnormals are
    # well represented.
    scale = np.abs(values[1:]) + np.abs(values[:-1]) + 1e-3
    weights = 1 / scale / np.sum(1 / scale)
    gap = np.asarray(jax.random.choice(k1, len(values) - 1, (size,), p=weights))
    p = np.asarray(
        jax.random.uniform(k2, (size,), minval=p_range[0], maxval=p_range[1])
    )
    inside = values[gap] + p * (values[gap + 1] - values[gap])
    exact = values[np.asarray(jax.random.choice(k3, len(values), (64,)))]
    x = jnp.asarray(np.concatenate([inside, exact]), jnp.float32)
    fn = integer_sr if name == "integers" else grid_sr(values, dtype)
    return fn, x, neighbours(values, x)


# ---------------------------------------------------------------------------
# Planted defects, each modelled on a real bug. `fn` is a correct rounding and
# `pair` its neighbours of `x`; each returns a rounding with the bug.


def _nearest(fn, pair):
    """qwix: "stochastic" rounding that silently rounds to nearest."""
    lower, upper = (jnp.asarray(v, jnp.float32) for v in pair)
    return lambda x, key: jnp.where(x - lower < upper - x, lower, upper)


def _always_down(fn, pair):
    """oneDNN #2903: stochastic rounding that (almost) always rounds down."""
    lower = jnp.asarray(pair[0], jnp.float32)
    return lambda x, key: lower


def _biased(fn, pair, factor=1.03):
    """gfloat #36: rounds up with probability `1.03 p` instead of `p`."""
    lower, upper = (jnp.asarray(v, jnp.float32) for v in pair)
    gap = jnp.where(upper > lower, upper - lower, 1)

    def biased(x, key):
        p = jnp.clip((x - lower) / gap * factor, 0, 1)
        return jnp.where(jax.random.uniform(key, x.shape) < p, upper, lower)

    return biased


def _fixed_key(fn, pair):
    """Primus-Turbo #365: the key is ignored (a fixed seed), so every draw is the
    same."""
    return lambda x, key: fn(x, jax.random.key(0))


def _zeros(fn, pair):
    """Transformer Engine #3281: stochastic rounding that returns all zeros."""
    return lambda x, key: jnp.zeros_like(x)


def _moves_representable(fn, pair):
    """A representable `x` moved up by one once in a thousand draws (an off-by-one
    that treats a level as lying between levels): it must stay `x` always."""
    lower, upper = (jnp.asarray(v, jnp.float32) for v in pair)

    def moved(x, key):
        drift = (lower == upper) & (jax.random.uniform(key, x.shape) < 1e-3)
        return jnp.where(drift, x + 1, fn(x, key).astype(jnp.float32))

    return moved


DEFECTS = {
    "nearest": _nearest,
    "always_down": _always_down,
    "fixed_key": _fixed_key,
    "zeros": _zeros,
    "moves_representable": _moves_representable,
}
