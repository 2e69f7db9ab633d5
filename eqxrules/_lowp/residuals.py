r"""The quantised core's custom VJP with its residuals in their formats (issue 41
§2): the forward pass quantises, besides its own product's operands, the left
operand of the weight-gradient product (`a`, blocked along what that product
contracts: the rows), and keeps it for the backward pass as its codes and scales
in their formats' dtypes (`quantise.Saved`): a quarter of `a`'s float32 bytes for
FP8, an eighth for FP4, where 0.2 kept `a` whole. The weight `b` is kept as it
is (it lives on anyway); of `a` the backward pass needs nothing else but its
type (`Like`: shape, dtype, sharding, varying mesh axes).

The values and gradients are bit for bit those of computing every product in
the backward pass (the same quantised operands, the same products). This is the
VJP of every call but one under a `jax.vmap` that `axis_name` names (there the
weight-gradient product's blocks span the batch, which the forward pass of one
example cannot quantise: `core._Bilinear`, which keeps `a`).
"""

from __future__ import annotations

import functools as ft
from collections.abc import Hashable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._tangents import _cotangent_like, _vary, varying_axes
from . import quantise
from .core import product
from .ops import Op
from .quantise import (
    Saved,
    keys_of,
    loaded,
    operand,
    plan,
    product_keys,
    saved_operand,
)
from .recipes import Custom

_F32 = jnp.float32


class Config(eqx.Module):
    """What the VJP computes: `op` with the products of `recipe`, per-tensor
    scales spanning the collective axes `spanned`. Static (hashable)."""

    op: Op = eqx.field(static=True)
    recipe: Custom = eqx.field(static=True)
    spanned: tuple[Hashable, ...] = eqx.field(static=True)


class Like(eqx.Module):
    """The type of an array the backward pass needs but not its values: its
    shape, dtype, explicit sharding (or `None`) and varying `shard_map` axes."""

    shape: tuple[int, ...] = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)
    sharding: Any = eqx.field(static=True)
    varying: tuple[str, ...] = eqx.field(static=True)

    @classmethod
    def of(cls, v: Array) -> Like:
        typeof = getattr(jax, "typeof", None)
        sharding = None if typeof is None else getattr(typeof(v), "sharding", None)
        if sharding is not None and getattr(sharding, "mesh", None) is not None:
            sharding = None if sharding.mesh.empty else sharding
        varying = tuple(sorted(varying_axes(v)))
        return cls(tuple(v.shape), v.dtype, sharding, varying)

    def zeros(self, dtype: Any = None) -> Array:
        """Zeros of this type (for a linear transpose's point, and a cotangent's
        type)."""
        z = jnp.zeros(self.shape, self.dtype if dtype is None else dtype)
        if self.sharding is not None:
            z = jax.sharding.reshard(z, self.sharding)
        return _vary(z, self.varying) if self.varying else z


@ft.partial(jax.custom_vjp, nondiff_argnums=(0,))
def bilinear(config: Config, a: Array, b: Array, key: Any, extras: Any) -> Array:
    """`config.op(a, b, *extras)` with the products of `config.recipe`."""
    return _forward(config, a, b, key, extras)


def _forward(config: Config, a: Array, b: Array, key: Any, extras: Any) -> Array:
    k = product_keys(key)
    a32, b32 = a.astype(_F32), b.astype(_F32)
    fwd = product(config.op, "fwd", config.recipe.fwd, (), config.spanned)
    y = fwd(a32, b32, extras, None, k[0], ())
    return y.astype(jnp.result_type(a, b))


def _fwd(config: Config, a: Array, b: Array, key: Any, extras: Any):
    y = _forward(config, a, b, key, extras)
    kept = _keep(config)(a.astype(_F32), b.astype(_F32), extras, key)
    return y, (kept, b, key, extras, Like.of(a))


@ft.cache
def _keep(config: Config) -> Any:
    """The weight-gradient product's left operand, quantised and kept (one
    compiled program eagerly, traced in place under `jit`)."""

    def keep(a: Array, b: Array, extras: Any, key: Any) -> Saved:
        dw = config.op.transpose("dw", b)
        p = plan(dw, config.recipe.dw, a.shape, "dw")
        keys = keys_of(product_keys(key)[2])
        return saved_operand(p, 0, a, extras, keys, config.spanned)

    return jax.jit(keep, inline=True)


@ft.cache
def _weight_gradient(config: Config) -> Any:
    """The weight-gradient product from its kept left operand."""

    def run(kept: Saved, dy: Array, extras: Any, b: Array, key: Any, like: Like):
        dw = config.op.transpose("dw", b)
        p = plan(dw, config.recipe.dw, like.shape, "dw")
        keys = keys_of(product_keys(key)[2])
        q_dy = operand(p, 1, dy, extras, keys, config.spanned)
        return quantise.contract(p.op, loaded(kept), q_dy, extras)

    return jax.jit(run, inline=True)


def _bwd(config: Config, residuals: Any, dy: Array) -> tuple[Any, ...]:
    kept, b, key, extras, like = residuals
    k = product_keys(key)
    b32, dy32 = b.astype(_F32), dy.astype(_F32)
    a_like = like.zeros(_F32)
    dx = product(config.op, "dx", config.recipe.dx, (), config.spanned)
    da = dx(dy32, b32, extras, a_like, k[1], ())
    db = _weight_gradient(config)(kept, dy32, extras, b32, key, like)
    da = _cotangent_like(da, like.zeros())
    db = _cotangent_like(db, b)
    return da, db, None, None


bilinear.defvjp(_fwd, _bwd)
