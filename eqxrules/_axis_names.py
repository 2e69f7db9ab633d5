"""Named axes (`axis_name`), as `eqx.nn.BatchNorm` takes them: a computation across
the examples of a `jax.vmap`, or the devices of a `jax.shard_map`, asked for by the
name of that axis, so that `vmap` keeps its meaning everywhere else.

`axis_name` is `None`, one hashable name, or a tuple of names (one per mapped
axis the computation spans). `names` gives the tuple; `check_bound` makes an unbound
name a clear `ValueError` (JAX's own is a `NameError` deep inside a collective).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
from jax.custom_batching import custom_vmap

from ._hyper import Check


def _is_name(v: Any) -> bool:
    return v is not None and not isinstance(v, (list, dict, set)) and _hashable(v)


def _hashable(v: Any) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


def names(axis_name: Any) -> tuple[Hashable, ...]:
    """`axis_name` as a tuple of names: `()` for `None`, `(name,)` for one name."""
    if axis_name is None:
        return ()
    if isinstance(axis_name, tuple):
        return axis_name
    return (axis_name,)


def _valid(v: Any) -> bool:
    return all(_is_name(n) and not isinstance(n, tuple) for n in names(v)) and (
        not isinstance(v, tuple) or len(v) > 0
    )


axis_names = Check(
    "be None, a hashable axis name (as `jax.vmap(..., axis_name=...)` takes), or "
    "a non-empty tuple of them",
    lambda v, _: _valid(v),
    TypeError,
    (["batch"], ()),
)


def check_names(function: str, axis_name: Any, argument: str = "axis_name") -> None:
    """A `TypeError` naming `function` unless `axis_name` is `None`, a name or a
    tuple of names."""
    if not _valid(axis_name):
        raise TypeError(
            f"`{function}`: `{argument}` (={axis_name!r}) must {axis_names.must}."
        )


def check_bound(function: str, axis_name: Any, argument: str = "axis_name") -> None:
    """A `ValueError` naming `function` and the name unless every name of
    `axis_name` is bound here: by an enclosing `jax.vmap(..., axis_name=...)`,
    `jax.shard_map` (a mesh axis) or `jax.pmap`."""
    check_names(function, axis_name, argument)
    for name in names(axis_name):
        try:
            jax.lax.axis_index(name)
        except NameError:
            raise ValueError(
                f"`{function}`: `{argument}` names the axis {name!r}, which is not "
                "bound here: call it under `jax.vmap(..., axis_name="
                f"{name!r})` (its examples then share the batch-wide "
                "computation), or a `jax.shard_map` over a mesh axis of that name; "
                "or leave `axis_name=None` for a call of its own."
            ) from None


def split(axis_name: Any) -> tuple[tuple[Hashable, ...], tuple[Hashable, ...]]:
    """The names of `axis_name` that an enclosing `jax.vmap` maps (`vmapped`), and
    the others, bound by a `jax.shard_map` or `jax.pmap` (`collective`): a
    computation spans the first by joining the mapped axis (a batching rule), the
    second with collectives (`lax.pmax`). Told apart here, where the names are
    bound: a batching rule sees `lax.axis_index` of a `vmap`'s name mapped, and
    of any other name not."""
    vmapped = [n for n in names(axis_name) if _mapped(n)]
    return tuple(vmapped), tuple(n for n in names(axis_name) if n not in vmapped)


def _mapped(name: Hashable) -> bool:
    seen: list[bool] = []

    @custom_vmap
    def probe(index: jax.Array) -> jax.Array:
        return index

    @probe.def_vmap
    def _(size: int, in_batched: Any, index: jax.Array) -> Any:
        seen.append(bool(in_batched[0]))
        return index, in_batched[0]

    probe(jax.lax.axis_index(name))
    return any(seen)


def tags(vmapped: tuple[Hashable, ...]) -> tuple[jax.Array, ...]:
    """One `lax.axis_index` per name of a `vmap`: an array mapped along that
    name's `vmap` (and no other), by which the quantised core's batching rule
    knows that the axis it batches is the one named."""
    return tuple(jax.lax.axis_index(n) for n in vmapped)
