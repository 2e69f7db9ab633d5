"""Tangent plumbing shared by the rules: a JVP of some arguments only
(`partial_jvp`), `None` (symbolic-zero) tangents lined up with their primals, a
tangent cast to its primal's dtype, and calling a function with a key only if it
takes one."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu
from jaxtyping import PRNGKeyArray

_T = TypeVar("_T")


def partial_jvp(
    fn: Callable[..., _T], primals: tuple[Any, ...], tangents: tuple[Any, ...]
) -> _T | None:
    """`jax.jvp` that respects symbolic zeros.

    `tangents` mirrors `primals`, with `None` wherever the tangent is a symbolic zero
    (as `eqx.filter_custom_jvp` passes them). Only the perturbed leaves are
    differentiated, so no zero arrays are materialised, and a tangent is never dropped.
    Returns `None` (a symbolic zero) when nothing is perturbed.
    """
    leaves, treedef = jtu.tree_flatten(primals)
    t_leaves = treedef.flatten_up_to(_align_tangents(primals, tangents))
    index = [
        i
        for i, (p, t) in enumerate(zip(leaves, t_leaves))
        if t is not None and eqx.is_inexact_array(p)
    ]
    if not index:
        return None

    def restricted(*perturbed):
        new = list(leaves)
        for i, p in zip(index, perturbed):
            new[i] = p
        return fn(*jtu.tree_unflatten(treedef, new))

    _, t_out = jax.jvp(
        restricted,
        tuple(leaves[i] for i in index),
        tuple(t_leaves[i] for i in index),
    )
    return t_out


def _is_none_leaf(x: Any) -> bool:
    return x is None


def _align_tangents(primals: Any, tangents: Any) -> Any:
    # `tangents` may hold `None` in place of a whole subtree (a Module whose
    # parameters were not differentiated); expand those to `None` per leaf.
    def expand(t, p):
        return jtu.tree_map(lambda _: None, p) if t is None else t

    return jtu.tree_map(expand, tangents, primals, is_leaf=lambda t: t is None)


def _cast_like(t: Any, like: Any) -> Any:
    if t is None or not eqx.is_inexact_array(like):
        return t
    return t.astype(like.dtype)


def _match_dtypes(t_tree: Any, like_tree: Any) -> Any:
    return jtu.tree_map(_cast_like, t_tree, like_tree, is_leaf=lambda t: t is None)


def varying_axes(x: Any) -> frozenset[str]:
    """The mesh axes over which `x` varies inside `jax.shard_map` (JAX's varying
    manual axes): empty outside it, and on JAX without such types (before 0.7)."""
    typeof = getattr(jax, "typeof", None)
    if typeof is None:
        return frozenset()
    aval = typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # JAX >= 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))  # JAX 0.7 to 0.9


def _vary(x: Any, axes: tuple[str, ...]) -> Any:
    """`x` made varying over `axes`: `jax.lax.pcast` from JAX 0.10, `pvary` before
    (only called where JAX has varying axes, so one of them exists)."""
    pcast = getattr(jax.lax, "pcast", None)
    if pcast is not None:
        return pcast(x, axes, to="varying")
    return getattr(jax.lax, "pvary")(x, axes)


def _cotangent_like(ct: Any, like: Any) -> Any:
    r"""`ct`, a cotangent of `like`, in `like`'s dtype and varying over the same
    `shard_map` axes: summed (`psum`) over the axes it varies over and `like` does
    not, as JAX's own transpose of the implicit `pvary` does (a replicated weight's
    gradient is the sum of every device's), and made varying over those `like`
    varies over and it does not."""
    ct = _cast_like(ct, like)
    if ct is None or not eqx.is_array(like):
        return ct
    have, want = varying_axes(ct), varying_axes(like)
    if have - want:
        ct = jax.lax.psum(ct, tuple(sorted(have - want)))
    if want - have:
        ct = _vary(ct, tuple(sorted(want - have)))
    return ct


def _match_cotangents(ct_tree: Any, like_tree: Any) -> Any:
    """`_cotangent_like` for every leaf: what a custom VJP's backward pass must
    return for JAX to accept it, dtype and `shard_map` axes alike."""
    return jtu.tree_map(
        _cotangent_like, ct_tree, like_tree, is_leaf=lambda t: t is None
    )


def takes_key(f: Callable[..., Any]) -> bool:
    """Whether `f` accepts a `key=` keyword (by name or through `**kwargs`)."""
    try:
        params = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.kind is p.VAR_KEYWORD or (p.name == "key" and p.kind is not p.POSITIONAL_ONLY)
        for p in params
    )


def call_with_key(f: Callable[..., _T], x: Any, key: PRNGKeyArray | None) -> _T:
    """`f(x, key=key)` if a key was given and `f` takes one (an Equinox layer with
    dropout inside a wrapper rule, say), else `f(x)`."""
    if key is None or not takes_key(f):
        return f(x)
    return f(x, key=key)
