"""Reusing one traced program across `check_rule` calls that differ only in the
point: what `eqxrules.verify_rule` asks for when it checks one example at many
inputs of one shape.

Tracing dominates such a call once its program is compiled: the core's rule and
references are traced afresh on every call (so that a rule whose closure changed
is never reported on from before; `_programs`). Inside `reusing()` the caller
promises that the functions it passes (the same objects, call after call) do not
change, and a call whose functions, options, non-differentiable arguments and
shapes are those of an earlier one runs that one's core, untraced, at its own
point: the core takes the point as an argument."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax.tree_util as jtu
import numpy as np

from . import _programs

_entries: dict[tuple[Any, ...], dict[str, Any]] | None = None


@contextlib.contextmanager
def reusing() -> Iterator[None]:
    """Within: reuse each call's core (and output shapes) for later calls with the
    same functions, options, non-differentiable arguments and shapes. The caller
    promises that its functions do not change in between."""
    global _entries
    outer, _entries = _entries, {}
    try:
        yield
    finally:
        _entries = outer


def _leaf_key(x: Any) -> tuple[Any, ...]:
    if eqx.is_array(x):
        a = np.asarray(x)
        if a.dtype != object:
            digest = hashlib.blake2b(a.tobytes(), digest_size=16).digest()
            return ("array", a.shape, a.dtype.str, digest)
    return ("object", id(x))


def key(p: Any, *what: Any) -> tuple[Any, ...] | None:
    """What must match for problem `p` to reuse an earlier call's `what` (the
    core, by the parts it computes; the output's shapes), or `None` outside
    `reusing()`. The objects named by identity are kept alive with the entry."""
    if _entries is None:
        return None
    leaves, treedef = jtu.tree_flatten(p.static)
    return (
        *what,
        id(p.fn),
        id(p.forward),
        id(p.derivative),
        id(p.reference_vjp),
        p.modes,
        tuple(id(s) for s in p.spaces),
        treedef,
        tuple(_leaf_key(x) for x in leaves),
        _programs._signature((p.diff,)),
    )


def get(k: tuple[Any, ...] | None) -> dict[str, Any] | None:
    return None if k is None or _entries is None else _entries.get(k)


def put(k: tuple[Any, ...] | None, p: Any, **entry: Any) -> None:
    if k is not None and _entries is not None:
        # The objects the key names by identity, alive as long as the entry.
        keep = (p.fn, p.forward, p.derivative, p.reference_vjp, p.spaces, p.static)
        _entries.setdefault(k, {"keep": keep}).update(entry)
