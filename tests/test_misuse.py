"""Misuse and bad input (issue 5): what a user sees, one test per row of the README's
"Misuse and bad input" table.

Every test asserts the exception type and that the message names the rule (its
functional name or its class name), the argument and the offending value. Where the
catalogue's data says enough (`elementwise`, `pytree_input`, `call_kwargs`, the
references) the test runs over every entry; invalid hyperparameters are a table of
rows for the rules that exist (a row whose class is gone is not collected).
"""

from __future__ import annotations

import dataclasses
import functools as ft
import pathlib
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import eqxrules
from eqxrules.testing import RuleCheckError, check_rule

KEY = jax.random.key(0)
CALL_KEY = jax.random.key(2)
ENTRIES = eqxrules.catalogue()
NAN, INF = float("nan"), float("inf")


@ft.cache
def _examples(entry: eqxrules.Entry) -> tuple[eqxrules.Rule, ...]:
    return tuple(entry.examples(KEY))


def _names(cls: type) -> list[str]:
    """How a message may name the rule: its class, or its functional form."""
    return [cls.__name__, *(e.name for e in ENTRIES if e.module is cls)]


def _assert_names(message: str, rule: list[str], *parts: str) -> None:
    assert any(f"`{name}`" in message for name in rule), (rule, message)
    _assert_parts(message, *parts)


def _assert_parts(message: str, *parts: str) -> None:
    for part in parts:
        assert part in message, (part, message)


def _sample(entry: eqxrules.Entry, seed: int = 1) -> np.ndarray:
    return np.array(entry.domain.sample(jax.random.key(seed), off_kinks=True))


def _loss(out: Any) -> jax.Array:
    leaves = [o for o in jtu.tree_leaves(out) if eqx.is_inexact_array(o)]
    return sum((jnp.sum(o.astype(jnp.float32)) for o in leaves), jnp.zeros(()))


# --------------------------------------------------------------------------------
# Invalid hyperparameters: (class, positional arguments, keyword arguments,
# exception, argument named, value named).


def _mlp():
    return eqx.nn.MLP(3, 2, 4, 1, key=KEY)


def _linear():
    return eqx.nn.Linear(3, 2, key=KEY)


_INVALID = [
    ("ScaledModel", (_mlp, 2.0), {"mode": "bogus"}, ValueError, "mode", "bogus"),
    ("ScaledModel", (_mlp, 0.0), {}, ValueError, "scale", 0.0),
    ("ScaledModel", (_mlp, NAN), {}, ValueError, "scale", NAN),
    ("ScaledModel", (_mlp, -INF), {}, ValueError, "scale", -INF),
    ("ScaledModel", (_mlp, np.array([1.0, 0.0, 2.0])), {}, ValueError, "scale", None),
    ("ScaledModel", (_mlp, "2"), {}, TypeError, "scale", "2"),
    ("ScaledModel", (_mlp, True), {}, TypeError, "scale", True),
    ("ScaledModel", (3, 2.0), {}, TypeError, "sub_model", 3),
    ("SteSign", (), {"clip_value": -1.0}, ValueError, "clip_value", -1.0),
    ("SteSign", (), {"clip_value": NAN}, ValueError, "clip_value", NAN),
    ("SteSign", (), {"clip_value": "1"}, TypeError, "clip_value", "1"),
    ("SteSign", (), {"clip_value": True}, TypeError, "clip_value", True),
    ("SwishSign", (), {"beta": 0.0}, ValueError, "beta", 0.0),
    ("SwishSign", (), {"beta": -5.0}, ValueError, "beta", -5.0),
    ("SwishSign", (), {"beta": INF}, ValueError, "beta", INF),
    ("SwishSign", (), {"beta": "5"}, TypeError, "beta", "5"),
    ("MagnitudeAwareSign", (), {"clip_value": -0.5}, ValueError, "clip_value", -0.5),
    ("MagnitudeAwareSign", (), {"clip_value": None}, TypeError, "clip_value", None),
    ("SteTernary", (), {"threshold_value": 0.0}, ValueError, "threshold_value", 0.0),
    ("SteTernary", (), {"threshold_value": -0.1}, ValueError, "threshold_value", -0.1),
    ("SteTernary", (), {"threshold_value": "a"}, TypeError, "threshold_value", "a"),
    ("SteTernary", (), {"clip_value": -1.0}, ValueError, "clip_value", -1.0),
    ("SteHeaviside", (), {"clip_value": -1.0}, ValueError, "clip_value", -1.0),
    ("SteHeaviside", (), {"clip_value": INF}, ValueError, "clip_value", INF),
    ("SteQuantize", (), {"bits": 0}, ValueError, "bits", 0),
    ("SteQuantize", (), {"bits": 2.5}, ValueError, "bits", 2.5),
    ("SteQuantize", (), {"bits": True}, ValueError, "bits", True),
    ("SteQuantize", (), {"lo": 1.0, "hi": 1.0}, ValueError, "lo", 1.0),
    ("SteQuantize", (), {"lo": 2.0, "hi": 1.0}, ValueError, "hi", 1.0),
    ("SteQuantize", (), {"lo": NAN}, ValueError, "lo", NAN),
    ("SteQuantize", (), {"hi": INF}, ValueError, "hi", INF),
    ("SteQuantize", (), {"lo": "a"}, TypeError, "lo", "a"),
    ("DoReFa", (), {"bits": 0}, ValueError, "bits", 0),
    ("DoReFa", (), {"bits": "2"}, ValueError, "bits", "2"),
    ("StraightThrough", (3, jnp.tanh), {}, TypeError, "forward", 3),
    ("StraightThrough", (jnp.sign, "x"), {}, TypeError, "surrogate", "x"),
    ("StraightThroughOneHot", (), {"axis": 1.5}, TypeError, "axis", 1.5),
    ("StraightThroughOneHot", (), {"axis": True}, TypeError, "axis", True),
    ("GumbelSoftmax", (), {"tau": 0.0}, ValueError, "tau", 0.0),
    ("GumbelSoftmax", (), {"tau": -1.0}, ValueError, "tau", -1.0),
    ("GumbelSoftmax", (), {"tau": INF}, ValueError, "tau", INF),
    ("GumbelSoftmax", (), {"hard": "yes"}, TypeError, "hard", "yes"),
    ("GumbelSoftmax", (), {"axis": 0.5}, TypeError, "axis", 0.5),
    ("StopGradient", (3,), {}, TypeError, "fn", 3),
    ("Frozen", ("m",), {}, TypeError, "module", "m"),
    ("Standardize", (), {"axis": 1.5}, TypeError, "axis", 1.5),
    ("Standardize", (), {"axis": ()}, TypeError, "axis", ()),
    ("Standardize", (), {"axis": (0, "a")}, TypeError, "axis", (0, "a")),
    ("Standardize", (), {"eps": -1.0}, ValueError, "eps", -1.0),
    ("Standardize", (), {"eps": NAN}, ValueError, "eps", NAN),
    ("Standardize", (), {"eps": "1"}, TypeError, "eps", "1"),
    ("GradientReversal", (), {"scale": NAN}, ValueError, "scale", NAN),
    ("GradientReversal", (), {"scale": INF}, ValueError, "scale", INF),
    ("GradientReversal", (), {"scale": "1"}, TypeError, "scale", "1"),
    ("GradientScale", (NAN,), {}, ValueError, "scale", NAN),
    ("GradientScale", (None,), {}, TypeError, "scale", None),
    ("ClipGradient", (1.0, 0.5), {}, ValueError, "lo", 1.0),
    ("ClipGradient", (0.5, 1.0), {}, ValueError, "lo", 0.5),
    ("ClipGradient", (-1.0, -0.5), {}, ValueError, "hi", -0.5),
    ("ClipGradient", ("a", 1.0), {}, TypeError, "lo", "a"),
    ("ClipGradientNorm", (0.0,), {}, ValueError, "max_norm", 0.0),
    ("ClipGradientNorm", (-1.0,), {}, ValueError, "max_norm", -1.0),
    ("ClipGradientNorm", (NAN,), {}, ValueError, "max_norm", NAN),
    ("ClipGradientNorm", ("1",), {}, TypeError, "max_norm", "1"),
    ("Quantized", (jnp.tanh,), {}, TypeError, "layer", None),
    (
        "Quantized",
        (_linear,),
        {"kernel_quantizer": 3},
        TypeError,
        "kernel_quantizer",
        3,
    ),
    (
        "Quantized",
        (_linear,),
        {"input_quantizer": "x"},
        TypeError,
        "input_quantizer",
        "x",
    ),
]


def _build(args: tuple[Any, ...]) -> tuple[Any, ...]:
    # `_mlp` and `_linear` stand for fresh small models, built when the test runs
    # (collection stays cheap).
    return tuple(a() if a is _mlp or a is _linear else a for a in args)


def _invalid_cases() -> list[Any]:
    return [
        pytest.param(*row, id=f"{row[0]}-{row[4]}={row[5]!r}-{i}")
        for i, row in enumerate(_INVALID)
        if hasattr(eqxrules, row[0])
    ]


@pytest.mark.parametrize("cls,args,kwargs,error,argument,value", _invalid_cases())
def test_invalid_hyperparameter(cls, args, kwargs, error, argument, value):
    """Rejected when the Module is built, naming the rule, the argument and the
    value."""
    module = getattr(eqxrules, cls)
    with pytest.raises(error) as info:
        module(*_build(args), **kwargs)
    shown = [f"`{argument}`"]
    if value is not None:
        shown.append(f"={value!r}")
    _assert_names(str(info.value), _names(module), *shown)


def test_every_entry_has_a_row_or_no_hyperparameters():
    """A rule with a static field has at least one invalid-value row above (so a
    new hyperparameter is noticed), unless the rule has none."""
    with_rows = {row[0] for row in _INVALID}
    for entry in ENTRIES:
        fields = [
            f.name
            for f in dataclasses.fields(entry.module)  # type: ignore[arg-type]
            if f.metadata.get("static", False)
        ]
        if fields:
            assert entry.module.__name__ in with_rows, (entry.name, fields)


def test_hyperparameter_traced_under_jit():
    """A hyperparameter is static: passing a traced value names it."""
    if not hasattr(eqxrules, "SteSign"):
        pytest.fail("the table above assumes `SteSign`")
    x = jnp.ones(3)
    # Equinox warns first that an array is being set as a static field.
    with pytest.raises(TypeError) as info, pytest.warns(UserWarning, match="static"):
        jax.jit(lambda c, x: eqxrules.ste_sign(x, clip_value=c))(1.0, x)
    _assert_names(str(info.value), _names(eqxrules.SteSign), "`clip_value`", "Tracer")


# --------------------------------------------------------------------------------
# Calls, over the catalogue.


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_two_positional_arguments(entry):
    """Every rule takes one input: a second positional argument is a `TypeError`
    naming the rule and saying how many it got."""
    rule = _examples(entry)[0]
    x = jnp.asarray(_sample(entry))
    with pytest.raises(TypeError) as info:
        rule(x, x, **rule.call_kwargs(CALL_KEY))
    _assert_names(str(info.value), _names(entry.module), "2")


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
        rule(jnp.asarray(_sample(entry)))
    missing = list(rule.call_kwargs(CALL_KEY))
    # Python's own message names the Module's method (`StochasticRound.primal()`).
    message = str(info.value)
    assert any(re.search(rf"`{n}`|\b{n}\.", message) for n in _names(entry.module))
    _assert_parts(message, *(f"'{k}'" for k in missing))


def _nonfinite(entry: eqxrules.Entry) -> jax.Array:
    x = _sample(entry)
    flat = x.reshape(-1)
    flat[:3] = NAN, INF, -INF
    return jnp.asarray(x)


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

        out = rule(x, **kwargs)
        ref_out = rule.reference_forward(x, **kwargs)
        g = grads(lambda r, x: r(x, **kwargs))
        if entry.reference_vjp:
            ct = jtu.tree_map(jnp.ones_like, eqx.filter(out, eqx.is_inexact_array))
            ref_g = rule.reference_vjp(ct, x, **kwargs)[1]
        else:
            ref_g = grads(lambda r, x: r.reference_derivative(x, **kwargs))
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


def _shaped_entries() -> list[Any]:
    """Entries that take any shape: elementwise rules and pytree rules."""
    return [e for e in ENTRIES if e.elementwise or e.module.pytree_input]


@pytest.mark.parametrize("shape", [(0,), ()], ids=["empty", "scalar"])
@pytest.mark.parametrize("entry", _shaped_entries(), ids=lambda e: e.name)
def test_empty_and_scalar_inputs(entry, shape):
    """An empty array and a scalar give a value and a gradient of that shape and
    dtype, equal to the references'."""
    x = jnp.asarray(_sample(entry).reshape(-1)[: int(np.prod(shape))].reshape(shape))
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
    "cls,kwargs", [("StraightThroughOneHot", {}), ("GumbelSoftmax", {"key": KEY})]
)
def test_categorical_rule_on_a_scalar(cls, kwargs):
    """Logits need an axis of categories: a scalar is a `ValueError` or `TypeError`
    naming the rule and `axis`, not an error from deep inside."""
    _require(cls)
    module = getattr(eqxrules, cls)
    with pytest.raises((ValueError, TypeError)) as info:
        module()(jnp.asarray(0.5), **kwargs)
    _assert_names(str(info.value), _names(module), "`axis`")


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
    _assert_names(str(info.value), ["quantize"], "`model`", "`where`")


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
    it cites is registered)."""
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
        matrix = (root / "tests" / "test_matrix.py").read_text()
        for names in situations:
            for name in re.findall(r"`(\w+)`", names):
                assert f'@situation(\n    "{name}"' in matrix or (
                    f'@situation("{name}"' in matrix
                ), name
