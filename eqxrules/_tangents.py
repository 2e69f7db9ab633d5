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
