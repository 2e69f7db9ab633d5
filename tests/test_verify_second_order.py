"""Second order wherever a rule's derivative is differentiable (issue 39 §1): each
rule declares whether it is (`Rule.second_order()`), `verify_rule` and `python -m
eqxrules` check its second derivatives off its kinks and at the moderate
extremes, a rule declaring none is reported "n/a", and a test keeps every
catalogue rule's declaration true both ways. 0.3 checked no second order: a
rule whose slope is `x * stop_gradient(x)` (the first derivative right, the
second half) passed."""

from __future__ import annotations

import json
import sys
from typing import ClassVar

import jax
import pytest
from conftest import ENTRIES, example_cases, examples

import eqxrules
from eqxrules import _cli, verify_rule
from eqxrules.testing import check_rule


class Cube(eqxrules.ElementwiseRule):
    r"""$y = x^3 / 3$, $\dot y = x^2 t$."""

    summary: ClassVar[str] = "x³/3"
    exact: ClassVar[bool] = True

    def primal(self, x):
        return x**3 / 3

    def slope(self, x):
        return x * x

    def reference_forward(self, x):
        return x * x * x / 3

    def reference_derivative(self, x):
        return x * x * x / 3


class _HalfSecond(Cube):
    """Planted: the slope `x * stop_gradient(x)`, right to first order, half the
    second derivative."""

    summary: ClassVar[str] = "x³/3, slope x·sg(x)"

    def slope(self, x):
        return x * jax.lax.stop_gradient(x)


def test_half_a_second_derivative_is_caught():
    result = verify_rule(Cube)
    assert result.passed
    twice = [r for label, r in result.reports if "at second order" in label]
    assert twice and twice[0]["second_order"].status == "passed"
    wrong = verify_rule(_HalfSecond, raise_on_failure=False)
    assert not wrong.passed
    assert all("check `second_order` failed" in p for p in wrong.problems), wrong
    assert any("off its kinks, at second order" in p for p in wrong.problems)


class _NoSecond(Cube):
    """Declares its derivative not differentiable (as a rule computed by a
    quantised product would)."""

    summary: ClassVar[str] = "x³/3, no second order declared"

    def second_order(self):
        return False


def _declaration_holds(rule, entry) -> str | None:
    """`None` if `rule` declares second order exactly where `check_rule(order=2)`
    at an input off its kinks passes; else what is wrong, in words."""
    domain = rule.input_domain()
    x = domain.sample(jax.random.key(3), off_kinks=True)
    fn, args, refs = entry.check_arguments(rule, x, jax.random.key(2))
    report = check_rule(
        fn, *args, **refs, order=2, checks=("second_order",), raise_on_failure=False
    )
    passed = report["second_order"].status == "passed"
    if rule.second_order() and not passed:
        return f"declares second order, but: {report['second_order'].describe()}"
    if not rule.second_order() and passed:
        return (
            "declares no second order, but its second derivatives are its references'"
        )
    return None


@pytest.mark.first_entry_quick
@pytest.mark.parametrize("entry,index", example_cases(ENTRIES))
def test_every_catalogue_rules_second_order_declaration_is_true(entry, index):
    assert _declaration_holds(examples(entry)[index], entry) is None


def test_a_false_declaration_is_found_both_ways():
    from eqxrules._registry import entry_of

    assert _declaration_holds(Cube(), entry_of(Cube)) is None
    assert "declares no second order" in _declaration_holds(
        _NoSecond(), entry_of(_NoSecond)
    )
    found = _declaration_holds(_HalfSecond(), entry_of(_HalfSecond))
    assert found is not None and found.startswith("declares second order, but")


def test_a_rule_declaring_no_second_order_is_reported_na(capsys, tmp_path, monkeypatch):
    result = verify_rule(_NoSecond)
    statuses = {r["second_order"].status for _, r in result.reports}
    assert "unsupported" in statuses and "passed" not in statuses
    module = tmp_path / "my_second.py"
    module.write_text(
        "from test_verify_second_order import _NoSecond as NoSecond\n"
        "from test_verify_second_order import Cube\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_second", raising=False)
    assert _cli.main(["verify", "my_second:NoSecond", "my_second:Cube", "--json"]) == 0
    rows = {
        r["module"]: r["checks"]["second_order"]
        for r in json.loads(capsys.readouterr().out)
    }
    assert rows == {"_NoSecond": "unsupported", "Cube": "passed"}
    assert _cli.main(["verify", "my_second:NoSecond"]) == 0
    row = next(
        line.split() for line in capsys.readouterr().out.splitlines()
        if line.startswith("my_second:NoSecond")
    )  # fmt: skip
    assert row[-2] == "n/a"  # the "2nd" column, before the time


def test_the_second_order_column_is_checked_for_the_catalogue(capsys):
    """`python -m eqxrules` reports second order, not "-" (0.3: "-" for all)."""
    assert _cli.main(["verify", "ste_round", "safe_sqrt", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["checks"]["second_order"] for r in rows] == ["passed", "passed"]
