"""How the checker names and splits the arguments of a rule: by the names `fn`'s
signature gives them, and (for `held_fixed`) into groups perturbed one at a time."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.tree_util as jtu

from ._compare import KeyPath, _is_none


def _arg_names(fn: Callable[..., Any], n: int) -> tuple[str, ...]:
    """The names `fn`'s signature gives its first `n` positional arguments, as the
    user wrote them (`lambda m, x: m(x)`: `m`, `x`); `args[i]` where it gives none
    (past a `*args`, or no signature)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )
    return tuple(
        params[i].name
        if i < len(params) and params[i].kind in positional
        else f"args[{i}]"
        for i in range(n)
    )


@dataclasses.dataclass(frozen=True)
class _Group:
    """One differentiable argument, or one field of a Module argument: what the
    `held_fixed` check perturbs alone. `get` takes its part of the differentiable
    leaves; `put` puts a replacement back; `path` is where it is among them."""

    label: str
    index: int
    field: str | None

    @property
    def path(self) -> KeyPath:
        index = (jtu.SequenceKey(self.index),)
        return index if self.field is None else (*index, jtu.GetAttrKey(self.field))

    def get(self, diff: tuple[Any, ...]) -> Any:
        arg = diff[self.index]
        return arg if self.field is None else getattr(arg, self.field)

    def put(self, diff: tuple[Any, ...], part: Any) -> tuple[Any, ...]:
        arg, field = part, self.field
        if field is not None:
            arg = eqx.tree_at(
                lambda m: getattr(m, field),
                diff[self.index],
                part,
                is_leaf=_is_none,
            )
        return diff[: self.index] + (arg,) + diff[self.index + 1 :]


def _groups(diff: tuple[Any, ...], names: tuple[str, ...]) -> list[_Group]:
    """Each top-level argument holding inexact arrays is a group; a Module argument
    is split into its fields that hold inexact arrays. `names`: the arguments'."""
    groups = []
    for i, arg in enumerate(diff):
        leaves = jtu.tree_flatten_with_path(arg)[0]
        if not leaves:
            continue
        keys = [path[0] if path else None for path, _ in leaves]
        if isinstance(arg, eqx.Module) and all(
            isinstance(k, jtu.GetAttrKey) for k in keys
        ):
            fields = dict.fromkeys(k.name for k in keys)  # type: ignore[union-attr]
            groups += [_Group(f"{names[i]}.{n}", i, n) for n in fields]
        else:
            groups.append(_Group(names[i], i, None))
    return groups
