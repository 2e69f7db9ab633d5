"""The slot a `VJPRule` with learnable `parameter` fields gives their cotangents
in: `bwd` returns `(cotangents of the arguments, {field: cotangent, ...})`, read
here into the rule's own cotangent (a Module-shaped tree, `None` elsewhere)."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax.tree_util as jtu

from ._hyper import parameters
from ._tangents import _match_cotangents


def _described(x: Any) -> str:
    """What `bwd` returned, in words (not its values: arrays, or tracers)."""
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    return f"a {type(x).__name__}"


def split_cotangents(rule: Any, out: Any) -> tuple[Any, dict[str, Any]]:
    """`rule.bwd`'s result as `(cotangents of the arguments, of the parameters)`,
    or a `TypeError` saying what a rule with parameter fields must return."""
    names = parameters(type(rule))
    if not names:
        return out, {}
    listed = ", ".join(f"`{n}`" for n in names)
    slot = "{" + ", ".join(f"{n!r}: ..." for n in names) + "}"
    ok = (
        isinstance(out, tuple)
        and len(out) == 2
        and isinstance(out[0], (tuple, list))
        and isinstance(out[1], dict)
    )
    if not ok:
        raise TypeError(
            f"`{rule.rule_name()}`: a `VJPRule` with learnable `parameter` "
            f"field(s) {listed} gives their cotangents from `bwd`: return "
            f"`(cotangents of the arguments, {slot})` (`None` for a zero one), "
            f"not {_described(out)}; else their gradient would be silently 0."
        )
    args, given = out
    if set(given) != set(names):
        raise TypeError(
            f"`{rule.rule_name()}`: `bwd` must give a cotangent (or `None`) for "
            f"each `parameter` field, {listed}, in `{slot}`; it gave "
            f"{sorted(given)}."
        )
    return args, given


def rule_cotangent(rule: Any, given: dict[str, Any], perturbed: Any) -> Any:
    """The rule's cotangent: each parameter field's from `given`, in its dtype,
    where that field was perturbed; `None` elsewhere."""
    ct_rule = jtu.tree_map(lambda _: None, rule)
    if not given:
        return ct_rule
    names = list(given)
    values = [
        jtu.tree_map(lambda _: None, getattr(rule, n))
        if given[n] is None
        else jtu.tree_map(
            lambda ct, p, like: _match_cotangents(ct, like) if p else None,
            given[n],
            getattr(perturbed, n),
            getattr(rule, n),
            is_leaf=lambda t: t is None,
        )
        for n in names
    ]
    return eqx.tree_at(
        lambda r: [getattr(r, n) for n in names],
        ct_rule,
        values,
        is_leaf=lambda t: t is None,
    )
