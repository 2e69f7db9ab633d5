"""The NaN-safe rules as users write them today, without eqxrules: the "double
where" of JAX's FAQ (select a harmless input where the function is singular, then
select the value), differentiated by plain autodiff. The `trick` baseline of the
seven NaN-safe rules (issue 27: their flops and temp bytes at most these).

Each is the textbook version, not the rule's full specification: `norm` squares
without scaling (so it overflows for float32 entries near 1e19, where
`SafeNorm` scales), and `arccos`/`arcsin` take only ±1 exactly as the singular
points (where the rules also take ±1 within 4 ulps)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import eqxrules


def _norm(x: jax.Array, axis: Any, keepdims: bool) -> jax.Array:
    s = jnp.sum(x * x, axis=axis, keepdims=keepdims)
    zero = s == 0
    return jnp.where(zero, 0, jnp.sqrt(jnp.where(zero, 1, s)))


def _safe_norm(rule: Any) -> Callable:
    return lambda dyn, x: _norm(x, rule.axis, rule.keepdims)


def _safe_normalize(rule: Any) -> Callable:
    def fn(dyn: Any, x: jax.Array) -> jax.Array:
        n = _norm(x, rule.axis, True)
        zero = n == 0
        return jnp.where(zero, 0, x / jnp.where(zero, 1, n))

    return fn


def _safe_sqrt(rule: Any) -> Callable:
    def fn(dyn: Any, x: jax.Array) -> jax.Array:
        zero = x == 0
        return jnp.where(zero, 0, jnp.sqrt(jnp.where(zero, 1, x)))

    return fn


def _arc(plain: Callable, ends: Callable) -> Callable:
    def build(rule: Any) -> Callable:
        def fn(dyn: Any, x: jax.Array) -> jax.Array:
            edge = jnp.abs(x) == 1
            return jnp.where(edge, ends(x), plain(jnp.where(edge, 0, x)))

        return fn

    return build


def _safe_divide(rule: Any) -> Callable:
    def fn(dyn: Any, args: Any) -> jax.Array:
        a, b = args
        zero = b == 0
        return jnp.where(zero, 0, a / jnp.where(zero, 1, b))

    return fn


def _safe_where(rule: Any) -> Callable:
    _, static = eqx.partition(rule, eqx.is_inexact_array)

    def fn(dyn: Any, args: Any) -> jax.Array:
        mask, x, otherwise = args
        f = eqx.combine(dyn, static).fn  # its parameters (if any) differentiated
        return jnp.where(mask, f(jnp.where(mask, x, rule.fill)), otherwise)

    return fn


DOUBLE_WHERE: dict[type, Callable[[Any], Callable]] = {
    eqxrules.SafeNorm: _safe_norm,
    eqxrules.SafeNormalize: _safe_normalize,
    eqxrules.SafeSqrt: _safe_sqrt,
    eqxrules.SafeArccos: _arc(jnp.arccos, lambda x: jnp.where(x > 0, 0, jnp.pi)),
    eqxrules.SafeArcsin: _arc(jnp.arcsin, lambda x: jnp.sign(x) * (jnp.pi / 2)),
    eqxrules.SafeDivide: _safe_divide,
    eqxrules.SafeWhere: _safe_where,
}
