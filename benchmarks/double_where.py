"""The NaN-safe rules as users write them today, without eqxrules: the "double
where" of JAX's FAQ (select a harmless input where the function is singular, then
select the value), differentiated by plain autodiff. The `trick` baseline of the
NaN-safe rules (issues 27 and 42: their flops and temp bytes at most these).

Each is the textbook version, not the rule's full specification: `norm` squares
without scaling (so it overflows for float32 entries near 1e19, where
`SafeNorm` scales), `arccos`/`arcsin` take only ±1 exactly as the singular
points (where the rules also take ±1 within 4 ulps), and `atan2` divides by
`x² + y²` unscaled (0 or inf for points near 1e-20 or 1e20, where `SafeAtan2`
scales). `softmax` and `logsumexp` are `jax.nn.softmax` and `jax.nn.logsumexp`
with the empty rows fed 0 and selected away.

`eigh` has no double where (the degenerate terms are inside `jnp.linalg.eigh`'s
derivative): its baseline is the plain `jnp.linalg.eigh`, differentiated by JAX
(NaN at a degenerate spectrum), which `SafeEigh` must cost at most 1.05 times."""

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


def _safe_atan2(rule: Any) -> Callable:
    def fn(dyn: Any, args: Any) -> jax.Array:
        y, x = args
        origin = (x == 0) & (y == 0)
        angle = jnp.arctan2(jnp.where(origin, 0, y), jnp.where(origin, 1, x))
        return jnp.where(origin, 0, angle)

    return fn


def _safe_xlogy(rule: Any) -> Callable:
    def fn(dyn: Any, args: Any) -> jax.Array:
        x, y = args
        both = (x == 0) & (y == 0)
        return jnp.where(both, 0, x * jnp.log(jnp.where(both, 1, y)))

    return fn


def _rows(args: Any, axis: Any) -> tuple[jax.Array, Any, jax.Array]:
    """`x`, its mask (`None` for a rule called on `x` alone, as in the MLP), and
    the rows with no unmasked entry above -inf."""
    x, where = args if isinstance(args, eqxrules.Args) else (args, None)
    live = x != -jnp.inf
    live = live if where is None else where & live
    return x, where, ~jnp.any(live, axis=axis, keepdims=True)


def _safe_softmax(rule: Any) -> Callable:
    def fn(dyn: Any, args: Any) -> jax.Array:
        x, where, empty = _rows(args, rule.axis)
        fed = jnp.where(empty, 0, x)
        taken = None if where is None else where | empty
        y = jax.nn.softmax(fed, axis=rule.axis, where=taken)
        return jnp.where(empty, 0, y)

    return fn


def _safe_logsumexp(rule: Any) -> Callable:
    def fn(dyn: Any, args: Any) -> jax.Array:
        x, where, empty = _rows(args, rule.axis)
        fed = jnp.where(empty, 0, x)
        taken = None if where is None else where | empty
        lse = jax.nn.logsumexp(fed, axis=rule.axis, where=taken, keepdims=True)
        return jnp.reshape(jnp.where(empty, -jnp.inf, lse), jnp.sum(x, rule.axis).shape)

    return fn


def _plain_eigh(rule: Any) -> Callable:
    return lambda dyn, a: tuple(jnp.linalg.eigh(a))


DOUBLE_WHERE: dict[type, Callable[[Any], Callable]] = {
    eqxrules.SafeNorm: _safe_norm,
    eqxrules.SafeNormalize: _safe_normalize,
    eqxrules.SafeSqrt: _safe_sqrt,
    eqxrules.SafeArccos: _arc(jnp.arccos, lambda x: jnp.where(x > 0, 0, jnp.pi)),
    eqxrules.SafeArcsin: _arc(jnp.arcsin, lambda x: jnp.sign(x) * (jnp.pi / 2)),
    eqxrules.SafeAtan2: _safe_atan2,
    eqxrules.SafeDivide: _safe_divide,
    eqxrules.SafeWhere: _safe_where,
    eqxrules.SafeXlogy: _safe_xlogy,
    eqxrules.SafeSoftmax: _safe_softmax,
    eqxrules.SafeLogsumexp: _safe_logsumexp,
    eqxrules.SafeEigh: _plain_eigh,
}
