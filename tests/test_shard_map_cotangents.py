"""A `VJPRule` under `jax.shard_map`, where JAX types every value with the mesh axes
it varies over (from JAX 0.7) and asks a custom VJP's backward pass for cotangents of
its arguments' types. The rule's cotangents are matched to them, as JAX's own
transpose would: summed over the devices for a replicated argument whose cotangent
varies (a weight's gradient from a sharded batch: `quantized_dot`), made varying for
a sharded argument whose cotangent does not (a constant one).

One device is enough to see the types (a one-device mesh still has its axis); the
values on eight devices are checked in `sharding_qdot.py`. Planted beside it: the
cotangents matched in dtype only, as before, whose weight cotangent still varies
(JAX 0.10 refuses it in the backward pass; JAX 0.7 at the replicated
`out_specs`)."""

from __future__ import annotations

import functools as ft
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxrules
from eqxrules import _tangents

if hasattr(jax, "shard_map"):  # public, with varying-axis types, from jax 0.7
    shard_map = jax.shard_map
    VARYING_TYPES = True
else:
    from jax.experimental.shard_map import shard_map as _old

    shard_map = ft.partial(_old, check_rep=False)
    VARYING_TYPES = False


class Times(eqxrules.VJPRule):
    """`x * w`, `w` a scalar: `w`'s cotangent is a sum over `x`, so it varies
    wherever `x` does."""

    elementwise = False  # two inputs

    def primal(self, x: jax.Array, w: jax.Array) -> jax.Array:
        return x * w

    def bwd(self, residuals: Any, ct: jax.Array, args: tuple[Any, ...]) -> Any:
        x, w = args
        return ct * w, jnp.sum(ct * x)


class Constant(eqxrules.VJPRule):
    """The identity with a cotangent of ones, whatever the incoming one: a constant,
    which varies over no axis."""

    def primal(self, x: jax.Array) -> jax.Array:
        return x

    def bwd(self, residuals: Any, ct: jax.Array, args: tuple[Any, ...]) -> Any:
        (x,) = args
        return (jnp.ones(x.shape, x.dtype),)


def _grads(rule: eqxrules.VJPRule, x: jax.Array, w: jax.Array | None, mapped: bool):
    """The gradient of `sum(sin(rule(x[, w])))` for `x` (and `w`), under `shard_map`
    over a one-device mesh (`x` sharded, `w` replicated) or not."""
    args = (x,) if w is None else (x, w)

    def grads(*args):
        return jax.grad(lambda *a: jnp.sum(jnp.sin(rule(*a))), range(len(args)))(*args)

    if not mapped:
        return jax.jit(grads)(*args)
    mesh = jax.make_mesh((1,), ("batch",))
    specs = (P("batch"), P())[: len(args)]
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    program = shard_map(grads, mesh=mesh, in_specs=specs, out_specs=specs)
    return jax.jit(program)(*placed)


X = jnp.linspace(-1.0, 3.0, 8, dtype=jnp.float32)
W = jnp.float32(0.7)


@pytest.mark.parametrize(
    "rule, w", [(Times(), W), (Constant(), None)], ids=["replicated", "constant"]
)
def test_cotangents_under_shard_map_equal_those_without(rule, w):
    expected = _grads(rule, X, w, mapped=False)
    got = _grads(rule, X, w, mapped=True)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))
    if w is not None:  # and they are the rule's: d/dw sum(sin(x w)) = sum(cos(x w) x)
        np.testing.assert_allclose(got[1], jnp.sum(jnp.cos(X * W) * X), rtol=1e-6)
    else:
        np.testing.assert_array_equal(np.asarray(got[0]), np.ones(8, np.float32))


def test_varying_axes_are_seen_inside_shard_map():
    """`varying_axes` reads JAX's types: the sharded input varies over the mesh
    axis, the replicated one over none (on JAX before 0.7, nothing varies)."""
    mesh = jax.make_mesh((1,), ("batch",))
    seen = {}

    def look(x, w):
        seen["x"], seen["w"] = _tangents.varying_axes(x), _tangents.varying_axes(w)
        return x

    x = jax.device_put(X, NamedSharding(mesh, P("batch")))
    w = jax.device_put(W, NamedSharding(mesh, P()))
    program = shard_map(
        look, mesh=mesh, in_specs=(P("batch"), P()), out_specs=P("batch")
    )
    jax.jit(program)(x, w)
    assert seen == {
        "x": frozenset({"batch"} if VARYING_TYPES else ()),
        "w": frozenset(),
    }


def _axes_after(match: Any) -> dict[str, frozenset[str]]:
    """Inside `shard_map` over a one-device mesh, with `x` sharded and `w`
    replicated: the axes that the cotangents `match` returns vary over, given a
    constant cotangent of `x` and one of `w` summed over `x` (varying with it)."""
    mesh = jax.make_mesh((1,), ("batch",))
    seen = {}

    def look(x, w):
        cotangents = (jnp.ones(x.shape, x.dtype), jnp.sum(x * w))
        ct_x, ct_w = match(cotangents, (x, w))
        seen["x"], seen["w"] = (_tangents.varying_axes(c) for c in (ct_x, ct_w))
        return x

    x = jax.device_put(X, NamedSharding(mesh, P("batch")))
    w = jax.device_put(W, NamedSharding(mesh, P()))
    specs = dict(in_specs=(P("batch"), P()), out_specs=P("batch"))
    jax.jit(shard_map(look, mesh=mesh, **specs))(x, w)
    return seen


def test_cotangents_vary_over_their_arguments_axes():
    assert _axes_after(_tangents._match_cotangents) == {
        "x": frozenset({"batch"} if VARYING_TYPES else ()),
        "w": frozenset(),
    }


def test_the_check_catches_unmatched_cotangents():
    """Planted defect: the cotangents matched in dtype only, as before this fix:
    `w`'s still varies over the batch (on JAX before 0.7 nothing varies)."""
    seen = _axes_after(_tangents._match_dtypes)
    assert seen["w"] == frozenset({"batch"} if VARYING_TYPES else ())
