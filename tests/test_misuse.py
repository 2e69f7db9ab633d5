"""Misuse and bad input (issue 5): what a user sees, one test per row of the README's
"Misuse and bad input" table.

Every test asserts the exception type and that the message names the rule (its
functional name or its class name), the argument and the offending value. Where the
catalogue's data says enough (`elementwise`, `pytree_input`, `call_kwargs`, the
references, the hyperparameter declarations) the test runs over every entry, so
adding a rule needs no edit here.
"""

from __future__ import annotations

import dataclasses
import functools as ft
import inspect
import pathlib
import re
import warnings
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from conftest import CALL_KEY, ENTRIES, KEY, call, examples as _examples, sum_loss

import eqxrules
from eqxrules._hyper import Invalid, declarations, parameters
from eqxrules.testing import RuleCheckError, check_rule

NAN, INF = float("nan"), float("inf")


def _names(cls: type) -> list[str]:
    """How a message may name the rule: its class, or its functional form."""
    return [cls.__name__, *(e.name for e in ENTRIES if e.module is cls)]


def _assert_names(message: str, rule: list[str], *parts: str) -> None:
    assert any(f"`{name}`" in message for name in rule), (rule, message)
    _assert_parts(message, *parts)


def _assert_parts(message: str, *parts: str) -> None:
    for part in parts:
        assert part in message, (part, message)


def _sample(entry: eqxrules.Entry, seed: int = 1) -> Any:
    """A host input: an array, or an `eqxrules.Args` of them (several inputs)."""
    x = entry.domain.sample(jax.random.key(seed), off_kinks=True)
    return jtu.tree_map(np.array, x)


def _inputs(entry: eqxrules.Entry, x: Any) -> dict[str, Any]:
    """The functional form's inputs by name: `{"x": x}`, or one per input of a rule
    of several (`eqxrules.Inputs` names them as `primal` does)."""
    if isinstance(x, eqxrules.Args):
        return dict(zip(entry.domain.names, x, strict=True))
    return {"x": x}


_loss = sum_loss


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


def _mlp():
    return eqx.nn.MLP(3, 2, 4, 1, key=KEY)


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
    _assert_names(str(info.value), _names(module), *_shown(bad))


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
    x = _sample(entry)
    example = _examples(entry)[0]
    call_kwargs = example.call_kwargs(CALL_KEY)
    if isinstance(x, eqxrules.Args):  # by name, with the example's other fields
        params = inspect.signature(entry.function).parameters
        hyper = {f: getattr(example, f) for f in _fields(entry) if f in params}
        with pytest.raises(bad.error) as info:
            entry.function(
                **_inputs(entry, x), **call_kwargs, **{**hyper, **bad.kwargs}
            )
        _assert_names(str(info.value), _names(entry.module), *_shown(bad))
        return
    with pytest.raises(bad.error) as info:
        entry.function(x, **call_kwargs, **bad.kwargs)
    _assert_names(str(info.value), _names(entry.module), *_shown(bad))


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
    _require("SteQuantize", "SteSign")
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
    _require("SteSign")
    x = jnp.ones(3)
    # Newer Equinox also warns that an array is being set as a static field.
    with pytest.raises(TypeError) as info, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "A JAX array is being set as static")
        jax.jit(lambda c, x: eqxrules.ste_sign(x, clip_value=c))(1.0, x)
    # The tracer's repr is `Traced<...>` before jax 0.7 and `...Tracer...` after.
    _assert_names(str(info.value), _names(eqxrules.SteSign), "`clip_value`", "Trace")


def _positional(fn: Any) -> list[str]:
    P = inspect.Parameter
    kinds = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
    return [
        p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds
    ]


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_too_many_positional_arguments_show_the_call(entry):
    """One positional argument more than a functional form takes is a `TypeError`
    that names the form (a derived form also shows how it is called)."""
    args = [None] * (len(_positional(entry.function)) + 1)
    with pytest.raises(TypeError) as info:
        entry.function(*args)
    assert entry.name in str(info.value), str(info.value)


def _fields(entry: eqxrules.Entry) -> set[str]:
    return {f.name for f in dataclasses.fields(entry.module)}


BY_POSITION = [e for e in ENTRIES if set(_positional(e.function)) & _fields(e)]


def _value_and_vjp(f: Any, x: Any) -> Any:
    out, pull = jax.vjp(f, x)
    return out, pull(jtu.tree_map(lambda o: jnp.full_like(o, 3.0), out))


def _positional_matches_keywords(function: Any, entry: eqxrules.Entry) -> None:
    x = _sample(entry)
    fields = _fields(entry)
    names = _positional(function)
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
                return _inputs(entry, x)
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
        _assert_same(actual, expected, f"{entry.name} by position")


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
    _require("clip_gradient")
    entry = next(e for e in ENTRIES if e.name == "clip_gradient")

    def swapped(x, lo, hi):
        return eqxrules.clip_gradient(x, lo=-hi, hi=-lo * 0.5)

    with pytest.raises(AssertionError):
        _positional_matches_keywords(swapped, entry)


# --------------------------------------------------------------------------------
# Calls, over the catalogue.


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_two_positional_arguments(entry):
    """A rule takes its inputs (one, or those `eqxrules.Inputs` names): one more
    positional argument is a `TypeError` naming the rule and saying how many it
    got."""
    rule = _examples(entry)[0]
    x = jtu.tree_map(jnp.asarray, _sample(entry))
    args = (*x, x[-1]) if isinstance(x, eqxrules.Args) else (x, x)
    with pytest.raises(TypeError) as info:
        rule(*args, **rule.call_kwargs(CALL_KEY))
    _assert_names(str(info.value), _names(entry.module), str(len(args)))


@pytest.mark.parametrize(
    "entry",
    [e for e in ENTRIES if isinstance(e.domain, eqxrules.Inputs)],
    ids=lambda e: e.name,
)
def test_inputs_that_do_not_broadcast(entry):
    """A rule of several inputs whose shapes do not broadcast together raises a
    `ValueError` naming the rule, each input and its shape."""
    rule = _examples(entry)[0]
    x = list(jtu.tree_map(jnp.asarray, _sample(entry)))
    j = next(i for i, a in enumerate(x) if a.ndim)  # an input with an axis
    x[j] = jnp.concatenate([x[j], x[j]], axis=-1)  # its last axis doubled
    with pytest.raises(ValueError) as info:
        rule(*x, **rule.call_kwargs(CALL_KEY))
    shapes = [str(tuple(a.shape)) for a in x]
    _assert_names(str(info.value), _names(entry.module), *entry.domain.names, *shapes)


def _needs_call_kwargs(entry: eqxrules.Entry) -> bool:
    return bool(_examples(entry)[0].call_kwargs(CALL_KEY))


@pytest.mark.parametrize(
    "entry", [e for e in ENTRIES if _needs_call_kwargs(e)], ids=lambda e: e.name
)
def test_missing_call_keyword(entry):
    """A rule called without the keyword arguments it needs (a PRNG `key`) raises a
    `TypeError` naming the rule and the keyword."""
    rule = _examples(entry)[0]
    with pytest.raises(TypeError) as info:
        call(rule, jtu.tree_map(jnp.asarray, _sample(entry)))
    message = str(info.value)
    _assert_names(message, _names(entry.module))
    for k in rule.call_kwargs(CALL_KEY):
        # Named as in `m(x, key=key)`, or as Python names a missing argument.
        assert f"{k}=" in message or f"'{k}'" in message, (k, message)


def _nonfinite(entry: eqxrules.Entry) -> Any:
    """An input whose first elements are NaN, +inf and -inf (in each
    floating-point input of a rule of several)."""

    def spoil(a: np.ndarray) -> jax.Array:
        if np.issubdtype(a.dtype, np.floating):
            flat = a.reshape(-1)
            n = min(3, flat.size)
            flat[:n] = (NAN, INF, -INF)[:n]
        return jnp.asarray(a)

    return jtu.tree_map(spoil, _sample(entry))


def _value_and_grads(entry: eqxrules.Entry, x: jax.Array):
    """The rule's value and gradient, and the references' (`_loss` of the output),
    under one `jit`."""
    return _jitted(entry)(_examples(entry)[0], x)


@ft.cache
def _jitted(entry: eqxrules.Entry):
    rule = _examples(entry)[0]
    kwargs = rule.call_kwargs(CALL_KEY)

    @eqx.filter_jit
    def run(rule, x):
        def grads(f):
            return eqx.filter_grad(lambda rx: _loss(f(*rx)))((rule, x))[1]

        out = call(rule, x, **kwargs)
        ref_out = call(rule.reference_forward, x, **kwargs)
        g = grads(lambda r, x: call(r, x, **kwargs))
        if entry.reference_vjp:
            ct = jtu.tree_map(jnp.ones_like, eqx.filter(out, eqx.is_inexact_array))
            ref_g = call(ft.partial(rule.reference_vjp, ct), x, **kwargs)[1]
        else:
            ref_g = grads(lambda r, x: call(r.reference_derivative, x, **kwargs))
        return out, ref_out, g, ref_g

    return run


def _assert_same(actual: Any, expected: Any, what: str) -> None:
    for (path, a), e in zip(
        jtu.tree_leaves_with_path(eqx.filter(actual, eqx.is_inexact_array)),
        jtu.tree_leaves(eqx.filter(expected, eqx.is_inexact_array)),
    ):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        where = f"{what}{jtu.keystr(path)}"
        assert a.shape == e.shape, where
        np.testing.assert_array_equal(np.isnan(a), np.isnan(e), err_msg=where)
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6, err_msg=where)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_nan_and_inf_inputs(entry):
    """NaN, +inf and -inf inputs: the value is the reference's (NaN where it is NaN),
    and so is the gradient, NaN included: never a silent finite number where the
    reference has NaN, nor the reverse."""
    out, ref_out, g, ref_g = _value_and_grads(entry, _nonfinite(entry))
    _assert_same(out, ref_out, "value")
    _assert_same(g, ref_g, "gradient")


@pytest.mark.parametrize(
    "entry", [e for e in ENTRIES if e.elementwise], ids=lambda e: e.name
)
def test_nan_and_inf_stay_local(entry):
    """For an elementwise rule, non-finite elements do not change the value or the
    gradient of the others."""
    x = _nonfinite(entry)
    out, _, g, _ = _value_and_grads(entry, x)
    clean = jnp.where(jnp.isfinite(x), x, 0.0)
    out_clean, _, g_clean, _ = _value_and_grads(entry, clean)
    finite = np.isfinite(np.asarray(x))
    for a, b in zip(jtu.tree_leaves((out, g)), jtu.tree_leaves((out_clean, g_clean))):
        np.testing.assert_array_equal(np.asarray(a)[finite], np.asarray(b)[finite])


def _takes_one_float_array(entry: eqxrules.Entry) -> bool:
    """Whether the rule rejects an integer array as not floating-point: the rules
    on one floating-point array (elementwise, blocked, learned, categorical), not
    the pytree rules nor those that pass `x` to a model they wrap.

    Called at collection, so the rule is traced (`filter_eval_shape`), not run: the
    check of its input's dtype is made when it is traced, and an abstract int32
    input of the domain's shape stands for `jnp.zeros(shape, jnp.int32)` without an
    eager compilation per rule."""
    rule = _examples(entry)[0]
    x = jax.ShapeDtypeStruct(tuple(entry.domain.shape), jnp.int32)
    kwargs = rule.call_kwargs(CALL_KEY)
    try:
        eqx.filter_eval_shape(lambda r, x: r(x, **kwargs), rule, x)
    except TypeError as e:
        return "expects a floating-point array" in str(e)
    return False


ARRAY_ENTRIES = [e for e in ENTRIES if _takes_one_float_array(e)]


def test_the_array_rules_are_found():
    """The selection above finds every elementwise rule and each kind of rule on
    one array (so the test below cannot pass by selecting nothing)."""
    found = {e.name for e in ARRAY_ENTRIES}
    assert {e.name for e in ENTRIES if e.elementwise} <= found
    kinds = {"lsq_quantize", "pact_quantize", "mx_quantize", "nvfp4_quantize"}
    assert kinds | {"straight_through_onehot", "magnitude_aware_sign"} <= found
    assert not any(e.module.pytree_input for e in ARRAY_ENTRIES)


@pytest.mark.parametrize(
    "value", [[0.5, -1.0], (0.5,), "0.5", None], ids=["list", "tuple", "str", "None"]
)
@pytest.mark.parametrize("entry", ARRAY_ENTRIES, ids=lambda e: e.name)
def test_input_that_is_not_an_array(entry, value):
    """A list (or a tuple, a string, `None`) where the rule takes an array: a
    `TypeError` naming the rule, its input, what was given and what to do, as
    `jnp`'s own functions reject lists (0.2.0 said `Cannot determine dtype of
    [0.5, -1.0]`, naming neither)."""
    rule = _examples(entry)[0]
    argument = _positional(entry.function)[0]
    given = "None" if value is None else f"a {type(value).__name__} ({value!r})"
    with pytest.raises(TypeError) as info:
        rule(value, **rule.call_kwargs(CALL_KEY))
    _assert_names(
        str(info.value),
        _names(entry.module),
        f"floating-point array for `{argument}`, got {given}",
        f"`jnp.asarray({argument})`",
    )


def test_scaled_model_names_a_list_input():
    """`ScaledModel` divides `x` before its sub-model sees it: a list is a
    `TypeError` naming the rule and `x` (0.2.0 gave Python's "unsupported operand
    type(s) for /"), while an integer array is divided as `jnp` divides it."""
    entry = next(e for e in ENTRIES if e.module is eqxrules.ScaledModel)
    rule = _examples(entry)[0]
    with pytest.raises(
        TypeError, match="`scaled_call` expects an array for `x`, got a list"
    ):
        rule([0.5, -1.0, 2.0])


@pytest.mark.parametrize(
    "entry", [e for e in ENTRIES if e.module.pytree_input], ids=lambda e: e.name
)
def test_pytree_rules_take_a_list(entry):
    """A rule on any pytree still takes a list of arrays, and gives a list: its
    reference's value."""
    rule = _examples(entry)[0]
    kwargs = rule.call_kwargs(CALL_KEY)
    x = [jnp.asarray(_sample(entry)), jnp.asarray(_sample(entry, seed=2))]
    out = rule(x, **kwargs)
    assert isinstance(out, list) and len(out) == 2
    _assert_same(out, rule.reference_forward(x, **kwargs), "value")


def _shaped_entries() -> list[Any]:
    """Entries that take any shape: elementwise rules and pytree rules."""
    return [e for e in ENTRIES if e.elementwise or e.module.pytree_input]


def _reference_rejects(entry: eqxrules.Entry, x: jax.Array) -> bool:
    rule = _examples(entry)[0]
    kwargs = rule.call_kwargs(CALL_KEY)
    try:
        jax.eval_shape(lambda x: rule.reference_forward(x, **kwargs), x)
    except Exception:
        return True
    return False


@pytest.mark.parametrize("shape", [(0,), ()], ids=["empty", "scalar"])
@pytest.mark.parametrize("entry", _shaped_entries(), ids=lambda e: e.name)
def test_empty_and_scalar_inputs(entry, shape):
    """An empty array and a scalar give a value and a gradient of that shape and
    dtype, equal to the references'. Where the reference has no value (a scalar has
    no axis to standardise along), the rule raises a `ValueError` naming itself and
    the input's shape, when called."""
    x = jnp.asarray(_sample(entry).reshape(-1)[: int(np.prod(shape))].reshape(shape))
    if _reference_rejects(entry, x):
        rule = _examples(entry)[0]
        with pytest.raises(ValueError) as info:
            rule(x, **rule.call_kwargs(CALL_KEY))
        _assert_names(str(info.value), _names(entry.module), f"shape {shape}")
        return
    out, ref_out, g, ref_g = _value_and_grads(entry, x)
    for o in jtu.tree_leaves(out):
        assert o.shape == shape and o.dtype == x.dtype
    assert g.shape == shape and g.dtype == x.dtype
    _assert_same(out, ref_out, "value")
    _assert_same(g, ref_g, "gradient")


# --------------------------------------------------------------------------------
# Rule-specific calls.


def _require(*names: str) -> None:
    missing = [n for n in names if not hasattr(eqxrules, n)]
    if missing:
        pytest.fail(f"this test is about {missing}, which eqxrules no longer has")


@pytest.mark.parametrize(
    "surrogate,shown",
    [
        (lambda x: x[:2], "float32[2]"),
        (lambda x: (x, x), "(float32[3], float32[3])"),
        (lambda x: x.astype(jnp.float16), "float16[3]"),
    ],
    ids=["shape", "structure", "dtype"],
)
def test_straight_through_surrogate_must_match_forward(surrogate, shown):
    """A surrogate whose output differs from the forward's in shape, pytree
    structure or dtype: a `ValueError` naming both and showing both."""
    _require("StraightThrough")
    with pytest.raises(ValueError) as info:
        eqxrules.straight_through(jnp.ones(3), forward=jnp.sign, surrogate=surrogate)
    _assert_names(
        str(info.value),
        _names(eqxrules.StraightThrough),
        "`forward`",
        "`surrogate`",
        "float32[3]",
        shown,
    )


def test_straight_through_forward_with_another_structure():
    """A `forward` returning a pytree of another structure than the surrogate's."""
    _require("StraightThrough")
    with pytest.raises(ValueError) as info:
        eqxrules.StraightThrough(lambda x: {"q": jnp.sign(x)}, jnp.tanh)(jnp.ones(3))
    _assert_names(
        str(info.value),
        _names(eqxrules.StraightThrough),
        "`forward`",
        "{'q': float32[3]}",
        "`surrogate`",
    )


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        ("StraightThroughOneHot", {}),
        ("GumbelSoftmax", {"key": KEY}),
        ("Standardize", {}),
    ],
)
def test_axis_out_of_range_for_a_scalar(cls, kwargs):
    """A rule that works along `axis` (categories, statistics) given a scalar: a
    `ValueError` when called, naming the rule, `axis`, its value and the shape, not
    an error from deep inside."""
    _require(cls)
    module = getattr(eqxrules, cls)
    with pytest.raises(ValueError) as info:
        module()(jnp.asarray(0.5), **kwargs)
    _assert_names(str(info.value), _names(module), "`axis` (=-1)", "shape ()")


def test_scaled_model_scale_must_broadcast_to_x():
    _require("ScaledModel")
    model = eqxrules.ScaledModel(jnp.tanh, jnp.array([1.0, 2.0]))
    with pytest.raises(ValueError) as info:
        model(jnp.ones(3))
    _assert_names(str(info.value), _names(eqxrules.ScaledModel), "`scale`", "(2,)")
    assert "(3,)" in str(info.value)


def test_quantize_with_a_quantizer_that_is_not_callable():
    _require("quantize")
    with pytest.raises(TypeError) as info:
        eqxrules.quantize(_mlp(), kernel_quantizer=3)
    _assert_names(str(info.value), ["quantize"], "`kernel_quantizer`", "=3")


def test_quantize_a_model_without_layers():
    _require("quantize")
    with pytest.raises(ValueError) as info:
        eqxrules.quantize(jnp.tanh, kernel_quantizer=jnp.sign)
    _assert_names(str(info.value), ["quantize"], "`model`", "`eqx.nn.Linear`")
    with pytest.raises(ValueError) as info:
        eqxrules.quantize(_mlp(), where=lambda node: False)
    _assert_names(str(info.value), ["quantize"], "`model`", "`where`")


def test_quantize_where_selecting_what_is_not_a_layer():
    """A `where` that selects a node without a weight: a `TypeError` naming the
    node's path and type (it raised `AttributeError: ... no attribute 'weight'`)."""
    _require("quantize")
    model = eqx.nn.Sequential([eqx.nn.Lambda(jnp.tanh), _mlp()])
    with pytest.raises(TypeError) as info:
        eqxrules.quantize(
            model,
            kernel_quantizer=jnp.sign,
            where=lambda node: isinstance(node, eqx.nn.Lambda),
        )
    _assert_names(str(info.value), ["quantize"], "`where`", "layers[0]", "Lambda")


# --------------------------------------------------------------------------------
# The declaration mechanism and the checker.


def test_domain_with_low_not_below_high():
    with pytest.raises(ValueError) as info:
        eqxrules.Domain(low=1.0, high=-1.0)
    _assert_names(str(info.value), ["Domain"], "`low`", "=1.0", "`high`", "=-1.0")


def test_declaring_a_second_functional_form():
    entry = ENTRIES[0]
    with pytest.raises(ValueError) as info:
        eqxrules.functional(entry.module)(lambda x: x)
    _assert_names(str(info.value), _names(entry.module), f"`{entry.name}`")
    assert eqxrules.catalogue() == ENTRIES


def test_check_rule_without_inexact_inputs():
    with pytest.raises(TypeError) as info:
        check_rule(lambda n: n * 2, jnp.arange(3))
    _assert_names(str(info.value), ["check_rule"], "`args`", "floating-point")


@pytest.mark.parametrize("reference", ["forward", "derivative"])
def test_check_rule_with_mismatched_signatures(reference):
    """A reference taking other arguments than `fn`: a `TypeError` naming it and
    how many arguments `fn` gets."""
    with pytest.raises(TypeError) as info:
        check_rule(lambda x: x, jnp.ones(3), **{reference: lambda x, y: x})
    _assert_names(str(info.value), ["check_rule"], f"`{reference}`", "1 positional")


def test_check_rule_with_unknown_modes():
    with pytest.raises(ValueError) as info:
        check_rule(lambda x: x, jnp.ones(3), modes=("sideways",))
    _assert_names(str(info.value), ["check_rule"], "`modes`", "'sideways'")


def test_check_rule_with_forward_of_another_structure():
    """`forward` returning another pytree structure than `fn`: the `primal` check
    fails, and the `RuleCheckError` says why."""
    with pytest.raises(RuleCheckError) as info:
        check_rule(
            lambda x: jnp.sin(x),
            jnp.ones(3),
            forward=lambda x: (jnp.sin(x),),
            derivative=jnp.sin,
        )
    assert info.value.failed == ["primal"]
    assert re.search(
        r"check `primal` failed.*pytree structure differs", str(info.value)
    )


def test_readme_misuse_table_names_tests_that_exist():
    """Every test the README's misuse table cites exists (and every matrix situation
    it cites is registered, in `tests/matrix/`)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    table = readme.split("## Misuse and bad input", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")][2:]
    assert len(rows) >= 15
    for row in rows:
        cited = row.rstrip(" |").rsplit(" | ", 1)[1]
        tests = re.findall(r"`tests/(\w+)\.py::(\w+)`", cited)
        situations = re.findall(r"`tests/test_matrix\.py` \(([^)]*)\)", cited)
        assert tests or situations, row
        for file, name in tests:
            assert f"\ndef {name}(" in (root / "tests" / f"{file}.py").read_text(), name
        matrix = "".join(
            p.read_text() for p in sorted((root / "tests" / "matrix").glob("*.py"))
        )
        for names in situations:
            for name in re.findall(r"`(\w+)`", names):
                assert f'@situation(\n    "{name}"' in matrix or (
                    f'@situation("{name}"' in matrix
                ), name
