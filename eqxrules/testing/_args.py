"""`Args`: the inputs of a rule of several, as one pytree, and `call`, which applies a
function to a test input of either kind. Part of the checker (it imports nothing
else of eqxrules), so that its strategies can draw them."""

from __future__ import annotations

from typing import Any

import jax.tree_util as jtu


class Args(tuple):  # noqa: SLOT001  (a pytree node, registered below)
    """The test inputs of a rule of several inputs, one per [`Inputs`][] entry: the
    rule is called as `rule(*args)`. A pytree (a tuple subclass JAX maps over), so
    that a transformation of the inputs (`vmap`, a dtype cast with
    `jax.tree_util.tree_map`) gives `Args` again, and a rule of one input (whose
    test input is an array, or any pytree) is never mistaken for one of several."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Args{tuple(self)!r}"


jtu.register_pytree_node(Args, lambda a: (tuple(a), None), lambda _, c: Args(c))


def call(f: Any, x: Any, **kwargs: Any) -> Any:
    """`f(*x)` for the [`Args`][] of a rule of several inputs, else `f(x)`."""
    return f(*x, **kwargs) if isinstance(x, Args) else f(x, **kwargs)
