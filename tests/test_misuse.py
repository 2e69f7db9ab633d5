"""Misuse and bad input (issue 5): what a user sees, one test per row of the
README's "Misuse and bad input" table. Here the rule-specific calls, the
declaration mechanism and the checker, and the check that every test the table
cites exists; the hyperparameters are in `tests/test_misuse_hyperparameters.py`,
the calls over the catalogue in `tests/test_misuse_calls.py`.

Every test asserts the exception type and that the message names the rule (its
functional name or its class name), the argument and the offending value. Where the
catalogue's data says enough (`elementwise`, `pytree_input`, `call_kwargs`, the
references, the hyperparameter declarations) the test runs over every entry, so
adding a rule needs no edit here.
"""

from __future__ import annotations

import pathlib
import re

import equinox as eqx
import jax.numpy as jnp
import pytest
from conftest import ENTRIES, KEY
from misuse_helpers import assert_names, require, rule_names

import eqxrules
from eqxrules.testing import RuleCheckError, check_rule


def _mlp():
    return eqx.nn.MLP(3, 2, 4, 1, key=KEY)


# --------------------------------------------------------------------------------
# Rule-specific calls.


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
    require("StraightThrough")
    with pytest.raises(ValueError) as info:
        eqxrules.straight_through(jnp.ones(3), forward=jnp.sign, surrogate=surrogate)
    assert_names(
        str(info.value),
        rule_names(eqxrules.StraightThrough),
        "`forward`",
        "`surrogate`",
        "float32[3]",
        shown,
    )


def test_straight_through_forward_with_another_structure():
    """A `forward` returning a pytree of another structure than the surrogate's."""
    require("StraightThrough")
    with pytest.raises(ValueError) as info:
        eqxrules.StraightThrough(lambda x: {"q": jnp.sign(x)}, jnp.tanh)(jnp.ones(3))
    assert_names(
        str(info.value),
        rule_names(eqxrules.StraightThrough),
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
    require(cls)
    module = getattr(eqxrules, cls)
    with pytest.raises(ValueError) as info:
        module()(jnp.asarray(0.5), **kwargs)
    assert_names(str(info.value), rule_names(module), "`axis` (=-1)", "shape ()")


def test_scaled_model_scale_must_broadcast_to_x():
    require("ScaledModel")
    model = eqxrules.ScaledModel(jnp.tanh, jnp.array([1.0, 2.0]))
    with pytest.raises(ValueError) as info:
        model(jnp.ones(3))
    assert_names(str(info.value), rule_names(eqxrules.ScaledModel), "`scale`", "(2,)")
    assert "(3,)" in str(info.value)


def test_quantize_with_a_quantizer_that_is_not_callable():
    require("quantize")
    with pytest.raises(TypeError) as info:
        eqxrules.quantize(_mlp(), kernel_quantizer=3)
    assert_names(str(info.value), ["quantize"], "`kernel_quantizer`", "=3")


def test_quantize_a_model_without_layers():
    require("quantize")
    with pytest.raises(ValueError) as info:
        eqxrules.quantize(jnp.tanh, kernel_quantizer=jnp.sign)
    assert_names(str(info.value), ["quantize"], "`model`", "`eqx.nn.Linear`")
    with pytest.raises(ValueError) as info:
        eqxrules.quantize(_mlp(), where=lambda node: False)
    assert_names(str(info.value), ["quantize"], "`model`", "`where`")


def test_quantize_where_selecting_what_is_not_a_layer():
    """A `where` that selects a node without a weight: a `TypeError` naming the
    node's path and type (it raised `AttributeError: ... no attribute 'weight'`)."""
    require("quantize")
    model = eqx.nn.Sequential([eqx.nn.Lambda(jnp.tanh), _mlp()])
    with pytest.raises(TypeError) as info:
        eqxrules.quantize(
            model,
            kernel_quantizer=jnp.sign,
            where=lambda node: isinstance(node, eqx.nn.Lambda),
        )
    assert_names(str(info.value), ["quantize"], "`where`", "layers[0]", "Lambda")


# --------------------------------------------------------------------------------
# The declaration mechanism and the checker.


def test_domain_with_low_not_below_high():
    with pytest.raises(ValueError) as info:
        eqxrules.Domain(low=1.0, high=-1.0)
    assert_names(str(info.value), ["Domain"], "`low`", "=1.0", "`high`", "=-1.0")


def test_declaring_a_second_functional_form():
    entry = ENTRIES[0]
    with pytest.raises(ValueError) as info:
        eqxrules.functional(entry.module)(lambda x: x)
    assert_names(str(info.value), rule_names(entry.module), f"`{entry.name}`")
    assert eqxrules.catalogue() == ENTRIES


def test_check_rule_without_inexact_inputs():
    with pytest.raises(TypeError) as info:
        check_rule(lambda n: n * 2, jnp.arange(3))
    assert_names(str(info.value), ["check_rule"], "`args`", "floating-point")


@pytest.mark.parametrize("reference", ["forward", "derivative"])
def test_check_rule_with_mismatched_signatures(reference):
    """A reference taking other arguments than `fn`: a `TypeError` naming it and
    how many arguments `fn` gets."""
    with pytest.raises(TypeError) as info:
        check_rule(lambda x: x, jnp.ones(3), **{reference: lambda x, y: x})
    assert_names(str(info.value), ["check_rule"], f"`{reference}`", "1 positional")


def test_check_rule_with_unknown_modes():
    with pytest.raises(ValueError) as info:
        check_rule(lambda x: x, jnp.ones(3), modes=("sideways",))
    assert_names(str(info.value), ["check_rule"], "`modes`", "'sideways'")


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
