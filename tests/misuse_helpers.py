"""What the misuse tests share (`tests/test_misuse*.py`): how a message must name
the rule, the argument and the value; a host input of an entry; the names of a
functional form's positional parameters and of a rule's fields; and a comparison
of two pytrees of arrays, NaN where NaN.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
import pytest
from conftest import ENTRIES

import eqxrules


def rule_names(cls: type) -> list[str]:
    """How a message may name the rule: its class, or its functional form."""
    return [cls.__name__, *(e.name for e in ENTRIES if e.module is cls)]


def assert_names(message: str, rule: list[str], *parts: str) -> None:
    assert any(f"`{name}`" in message for name in rule), (rule, message)
    assert_parts(message, *parts)


def assert_parts(message: str, *parts: str) -> None:
    for part in parts:
        assert part in message, (part, message)


def sample(entry: eqxrules.Entry, seed: int = 1) -> Any:
    """A host input: an array, or an `eqxrules.Args` of them (several inputs)."""
    x = entry.domain.sample(jax.random.key(seed), off_kinks=True)
    return jtu.tree_map(np.array, x)


def inputs_by_name(entry: eqxrules.Entry, x: Any) -> dict[str, Any]:
    """The functional form's inputs by name: `{"x": x}`, or one per input of a rule
    of several (`eqxrules.Inputs` names them as `primal` does)."""
    if isinstance(x, eqxrules.Args):
        return dict(zip(entry.domain.names, x, strict=True))
    return {"x": x}


def positional(fn: Any) -> list[str]:
    P = inspect.Parameter
    kinds = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
    return [
        p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds
    ]


def fields_of(entry: eqxrules.Entry) -> set[str]:
    return {f.name for f in dataclasses.fields(entry.module)}


def assert_same(actual: Any, expected: Any, what: str) -> None:
    for (path, a), e in zip(
        jtu.tree_leaves_with_path(eqx.filter(actual, eqx.is_inexact_array)),
        jtu.tree_leaves(eqx.filter(expected, eqx.is_inexact_array)),
    ):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        where = f"{what}{jtu.keystr(path)}"
        assert a.shape == e.shape, where
        np.testing.assert_array_equal(np.isnan(a), np.isnan(e), err_msg=where)
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6, err_msg=where)


def require(*names: str) -> None:
    missing = [n for n in names if not hasattr(eqxrules, n)]
    if missing:
        pytest.fail(f"this test is about {missing}, which eqxrules no longer has")
