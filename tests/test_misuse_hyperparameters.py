"""Misuse and bad input (issue 5), hyperparameters: every invalid value of every
check of every hyperparameter, derived from each rule's field declarations, is
rejected when the Module is built and when the functional form is called, naming
the rule, the argument and the value; a wrong type is a `TypeError`, a wrong value
a `ValueError`; a traced hyperparameter and one positional argument too many are
named; a hyperparameter by position means what it means by keyword. Rows of the
README's "Misuse and bad input" table (the rest: `tests/test_misuse.py`,
`tests/test_misuse_calls.py`).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import pytest
from conftest import CALL_KEY, ENTRIES, KEY, examples as _examples
from misuse_helpers import (
    assert_names,
    assert_same,
    fields_of,
    inputs_by_name,
    positional,
    require,
    rule_names,
    sample,
)

import eqxrules
from eqxrules._hyper import Invalid, declarations, parameters

# --------------------------------------------------------------------------------
# Invalid hyperparameters: derived from each rule's field declarations (every bad
# value of every check of every hyperparameter); `Quantized`, a layer rather than a
# catalogue entry, has its rows here.


class _Bad(NamedTuple):
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    error: type[Exception]
    argument: str
    value: Any = None  # `None`: the message need not show it


def _quantized_rows() -> list[_Bad]:
    linear = eqx.nn.Linear(3, 2, key=KEY)
    return [
        _Bad((jnp.tanh,), {}, TypeError, "layer"),
        _Bad((linear,), {"kernel_quantizer": 3}, TypeError, "kernel_quantizer", 3),
        _Bad((linear,), {"input_quantizer": "x"}, TypeError, "input_quantizer", "x"),
    ]


def _rule_rows(entry: eqxrules.Entry) -> list[Invalid]:
    return entry.module.invalid_hyperparameters(KEY)


def _row_id(name: str, bad: Any, i: int) -> str:
    return f"{name}-{bad.argument}={bad.value!r}-{i}"


def _invalid_cases() -> list[Any]:
    rows = [(entry.module, bad) for entry in ENTRIES for bad in _rule_rows(entry)]
    if hasattr(eqxrules, "Quantized"):
        rows += [(eqxrules.Quantized, bad) for bad in _quantized_rows()]
    return [
        pytest.param(module, bad, id=_row_id(module.__name__, bad, i))
        for i, (module, bad) in enumerate(rows)
    ]


def _shown(bad: Any) -> list[str]:
    return [f"`{bad.argument}`"] + ([] if bad.value is None else [f"={bad.value!r}"])


@pytest.mark.parametrize("module,bad", _invalid_cases())
def test_invalid_hyperparameter(module, bad):
    """Rejected when the Module is built, naming the rule, the argument and the
    value."""
    args = getattr(bad, "args", ())
    with pytest.raises(bad.error) as info, warnings.catch_warnings():
        # An array scale is set as a (dynamic) field: no warning is due, but
        # older Equinox may warn about arrays in fields all the same.
        warnings.simplefilter("ignore", UserWarning)
        module(*args, **bad.kwargs)
    assert_names(str(info.value), rule_names(module), *_shown(bad))


def _keyword_rows() -> list[Any]:
    """The invalid rows whose every field the functional form takes by keyword
    (`ste_sign(x, clip_value=...)`), as it does every hyperparameter, or, for a
    learnable parameter, also by keyword (`lsq_quantize(x, step=..., bits=...)`)."""
    rows = []
    for entry in ENTRIES:
        params = inspect.signature(entry.function).parameters
        keyword = {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
        keyword |= set(parameters(entry.module)) & set(params)
        rows += [
            pytest.param(entry, bad, id=_row_id(entry.name, bad, i))
            for i, bad in enumerate(_rule_rows(entry))
            if set(bad.kwargs) <= keyword
        ]
    return rows


@pytest.mark.parametrize("entry,bad", _keyword_rows())
def test_invalid_hyperparameter_at_call(entry, bad):
    """The functional form rejects the same values when it is called."""
    x = sample(entry)
    example = _examples(entry)[0]
    call_kwargs = example.call_kwargs(CALL_KEY)
    if isinstance(x, eqxrules.Args):  # by name, with the example's other fields
        params = inspect.signature(entry.function).parameters
        hyper = {f: getattr(example, f) for f in fields_of(entry) if f in params}
        with pytest.raises(bad.error) as info:
            entry.function(
                **inputs_by_name(entry, x), **call_kwargs, **{**hyper, **bad.kwargs}
            )
        assert_names(str(info.value), rule_names(entry.module), *_shown(bad))
        return
    with pytest.raises(bad.error) as info:
        entry.function(x, **call_kwargs, **bad.kwargs)
    assert_names(str(info.value), rule_names(entry.module), *_shown(bad))


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_every_hyperparameter_has_an_invalid_value(entry):
    """Every field of a rule is declared with `hyperparameter(...)` and is the
    `argument` of at least one invalid construction, so a new hyperparameter comes
    with its misuse cases, from its declaration."""
    fields = {f.name for f in dataclasses.fields(entry.module)}  # type: ignore[arg-type]
    assert set(declarations(entry.module)) == fields
    covered = {bad.argument for bad in _rule_rows(entry)}
    missing = sorted(fields - covered)
    assert not missing, f"`{entry.module.__name__}`: no invalid value for {missing}"


def test_wrong_types_are_type_errors_and_wrong_values_value_errors():
    """As in Equinox: a wrong type is a `TypeError`, also for a bool or a string
    where a number is due; a value of the right type out of range, a
    `ValueError`."""
    require("SteQuantize", "SteSign")
    for bits in (2.5, True, "2", None):
        with pytest.raises(TypeError, match=f"`bits` \\(={bits!r}\\)"):
            eqxrules.SteQuantize(bits=bits)
    with pytest.raises(ValueError, match="`bits` \\(=0\\) must be >= 1"):
        eqxrules.SteQuantize(bits=0)
    with pytest.raises(TypeError, match="must be a real number"):
        eqxrules.SteSign(clip_value=True)
    with pytest.raises(ValueError, match="must be greater than `lo` \\(=1.0\\)"):
        eqxrules.SteQuantize(lo=1.0, hi=0.5)


def test_hyperparameter_traced_under_jit():
    """A hyperparameter is static: passing a traced value names it."""
    require("SteSign")
    x = jnp.ones(3)
    # Newer Equinox also warns that an array is being set as a static field.
    with pytest.raises(TypeError) as info, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "A JAX array is being set as static")
        jax.jit(lambda c, x: eqxrules.ste_sign(x, clip_value=c))(1.0, x)
    # The tracer's repr is `Traced<...>` before jax 0.7 and `...Tracer...` after.
    assert_names(str(info.value), rule_names(eqxrules.SteSign), "`clip_value`", "Trace")


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_too_many_positional_arguments_show_the_call(entry):
    """One positional argument more than a functional form takes is a `TypeError`
    that names the form (a derived form also shows how it is called)."""
    args = [None] * (len(positional(entry.function)) + 1)
    with pytest.raises(TypeError) as info:
        entry.function(*args)
    assert entry.name in str(info.value), str(info.value)


BY_POSITION = [e for e in ENTRIES if set(positional(e.function)) & fields_of(e)]


def _value_and_vjp(f: Any, x: Any) -> Any:
    out, pull = jax.vjp(f, x)
    return out, pull(jtu.tree_map(lambda o: jnp.full_like(o, 3.0), out))


def _positional_matches_keywords(function: Any, entry: eqxrules.Entry) -> None:
    x = sample(entry)
    fields = fields_of(entry)
    names = positional(function)
    for rule in _examples(entry):
        hyper = {f: getattr(rule, f) for f in fields}
        values = {"key": CALL_KEY, **hyper}
        rest = {f: hyper[f] for f in fields - set(names)}
        # A key the example needs by keyword (`rounding="stochastic"`).
        keyed = {k: v for k, v in rule.call_kwargs(CALL_KEY).items() if k not in names}

        def given(d: Any) -> dict[str, Any]:
            """The inputs by name: every name not a hyperparameter is the one
            input of a rule of one (whatever its name), else named by `Inputs`."""
            x = eqx.combine(d, fixed)
            if isinstance(x, eqxrules.Args):
                return inputs_by_name(entry, x)
            return {n: x for n in names if n not in values}

        def by_position(d, rule=rule):
            inputs = given(d)
            return function(
                *[values.get(n, inputs.get(n)) for n in names], **rest, **keyed
            )

        def by_keyword(d):
            inputs = given(d)
            by_name = {
                n: values.get(n, inputs.get(n)) for n in names if n not in fields
            }
            return entry.function(**by_name, **hyper, **keyed)

        # With respect to the floating-point inputs (a mask is held fixed).
        d, fixed = eqx.partition(jtu.tree_map(jnp.asarray, x), eqx.is_inexact_array)
        actual, expected = _value_and_vjp(by_position, d), _value_and_vjp(by_keyword, d)
        assert_same(actual, expected, f"{entry.name} by position")


@pytest.mark.catalogue_wide
@pytest.mark.first_entry_quick
@pytest.mark.parametrize("entry", BY_POSITION, ids=lambda e: e.name)
def test_hyperparameters_by_position_are_the_keywords(entry):
    """A hyperparameter declared `positional=True` (0.1.0's calling convention,
    `clip_gradient(x, -1.0, 1.0)`) means the same by position as by keyword, in
    value and gradient, for every example's values."""
    _positional_matches_keywords(entry.function, entry)


def test_positional_hyperparameters_can_fail():
    """Planted defect: a form that reads its positional `lo` and `hi` the wrong
    way round is caught by the comparison above."""
    require("clip_gradient")
    entry = next(e for e in ENTRIES if e.name == "clip_gradient")

    def swapped(x, lo, hi):
        return eqxrules.clip_gradient(x, lo=-hi, hi=-lo * 0.5)

    with pytest.raises(AssertionError):
        _positional_matches_keywords(swapped, entry)
