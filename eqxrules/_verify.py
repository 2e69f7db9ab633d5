"""What verifying a catalogue entry means, shared by `python -m eqxrules`, the test
suite and [`eqxrules.verify_rule`][]: every example instance is checked
with `check_rule` at every one of its kinks (where straight-through estimators go
wrong; `rule.kinks()`, from its hyperparameters), at degenerate slices (zero,
constant, one inf: where a rule that reduces over an axis goes wrong), at the
extremes of the dtype's range, off the kinks at second order where its derivative
is differentiable and, for instances whose derivative is the true one, against
finite differences.

It reads the catalogue and runs the checker, so it lives beside the catalogue and
imports `eqxrules.testing`; the checker imports nothing back."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PRNGKeyArray

from ._catalogue import Entry
from ._domain import Args, Domain, Inputs
from .testing import CHECKS, RuleReport, check_rule
from .testing._extremes import magnitudes
from .testing._reuse import reusing


@dataclasses.dataclass
class EntryResult:
    """The reports of every check of one entry, and a status per check: `"passed"`
    if it passed somewhere and failed nowhere, `"failed"` if it failed anywhere,
    else `"unsupported"` or `"skipped"`. `skipped`: the inputs (and checks at an
    input) not judged, in words, because the references are finite nowhere
    there: outside the rule's domain."""

    entry: Entry
    reports: list[RuleReport]
    seconds: float
    labels: list[str] = dataclasses.field(default_factory=list)  # one per report
    examples: list[Any] = dataclasses.field(default_factory=list)  # those checked
    skipped: list[str] = dataclasses.field(default_factory=list)

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def module(self) -> type:
        return self.entry.module

    @property
    def modes(self) -> tuple[str, ...]:
        return self.entry.modes

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.reports) and self.modes_match

    @property
    def modes_match(self) -> bool:
        """The checker found forward mode exactly where the entry declares it."""
        return all(r.forward_mode == self.entry.forward_mode for r in self.reports)

    def status(self, check: str) -> str:
        return combined_status(self.reports, check)

    def failures(self) -> list[str]:
        lines = [
            f"{label}: {result.describe()}"
            for label, report in zip(self.labels, self.reports, strict=True)
            for result in report.results
            if result.status == "failed"
        ]
        if not self.modes_match:
            lines.append(
                f"forward mode declared {self.entry.forward_mode} but the checker "
                "found otherwise"
            )
        return lines


def combined_status(reports: list[RuleReport], check: str) -> str:
    """`check`'s status over several reports: `"failed"` if it failed in any,
    else `"passed"` if it passed in any, else `"unsupported"` or `"skipped"`."""
    statuses = {r[check].status for r in reports}
    for s in ("failed", "passed", "unsupported", "skipped"):
        if s in statuses:
            return s
    return "skipped"


# The checks whose outcome depends on the input's values, not only on the rule's
# program: the value and its derivative in each mode. Linearity, transposition,
# batching, jit, the zero cotangent and dtypes are properties of the program,
# checked once per example (at its first input holding kinks).
VALUE_CHECKS = ("primal", "jvp", "vjp")

_BATTERY = tuple(c for c in CHECKS if c != "second_order")

_NOT_DIFFERENTIABLE = (
    "the rule declares its derivative not differentiable (`second_order()` is "
    "False), so it has no second derivative to check"
)


def tangent_space(domain: Any, several: bool) -> tuple[Any, ...] | None:
    """`check_rule`'s `tangent_space` for `(m, *inputs)`: each input's domain's
    projection, where it has one of its own (the rule Module's fields move
    freely)."""
    domains = domain.domains if several else (domain,)
    spaces = [None if type(d).project is Domain.project else d.project for d in domains]
    return (None, *spaces) if any(spaces) else None


def _moderate(x: Any) -> bool:
    """Whether every floating-point element of `x` is finite and at most the
    dtype's `big` extreme in magnitude (`Domain.extremes`)."""
    for leaf in jax.tree_util.tree_leaves(x):
        if not eqx.is_inexact_array(leaf):
            continue
        a = np.asarray(leaf, np.float64)
        if not (
            np.all(np.isfinite(a)) and np.all(np.abs(a) <= magnitudes(leaf.dtype)[0])
        ):
            return False
    return True


def _outside(report: RuleReport, what: str) -> str | None:
    """At a degenerate or extreme input, a check that compared nothing met a
    reference finite nowhere there: the input (or, for a derivative, the
    derivative there) is outside the references' domain and cannot be judged.
    Such checks are relabelled "skipped", saying so; returns what was skipped,
    in words, or `None`."""
    nothing = [r for r in report.results if r.status == "failed" and r.compared == 0]
    if not nothing:
        return None
    if report["primal"] in nothing:
        nothing = [r for r in report.results if r.status in ("failed", "passed")]
        why = "the reference value is finite nowhere there"
    else:
        why = "the reference derivative is finite nowhere there"
    for r in nothing:
        r.status, r.detail = "skipped", f"outside the rule's domain: {why}"
        r.exception = None
    checks = ", ".join(f"`{r.name}`" for r in nothing)
    return f"{what}: {checks} skipped, outside the rule's domain ({why})"


def verify(
    entry: Entry,
    key: PRNGKeyArray | None = None,
    *,
    indices: Sequence[int] | None = None,
) -> EntryResult:
    """Check every example of `entry` (or those at `indices`, as built from the
    same key); never raises on a failing check.

    For each example `rule`, with `domain = rule.input_domain()`, `check_rule`
    against the references (cotangents scaled also to either side of the rule's
    `cotangent_thresholds()`, tangents in the domain's tangent space):

    - at every kink: one input per `n` kinks (`n` elements per input), from
        `domain.on_kinks` (one random input for a rule without kinks); the first
        with every check, the others with those whose outcome depends on the
        input's values (`VALUE_CHECKS`: the value, the JVP and the VJP);
    - at each degenerate input of `domain.degenerate` (a zero, a constant and a
        non-finite slice), where a rule that reduces over an axis goes wrong and
        must still agree with its references (the value, the JVP and the VJP):
        finite where they are finite, NaN only where they are;
    - at each extreme input of `domain.extremes` (the ends of the dtype's range,
        `-inf`, a masked row) in the same way, and at second order where the
        rule's derivative is differentiable (`rule.second_order()`). At a
        degenerate or extreme input where a reference is finite nowhere, the
        checks that compared nothing are skipped and `skipped` says so;
    - off its kinks: for an example whose `is_exact()`, every check and finite
        differences; for one whose `second_order()`, second order (the value
        checks alongside)."""
    key = jax.random.key(0) if key is None else key
    k_examples, k_on, k_off, k_call, k_degenerate = jax.random.split(key, 5)
    k_extreme = jax.random.fold_in(k_degenerate, 1)
    start = time.perf_counter()
    reports: list[RuleReport] = []
    labels: list[str] = []
    skipped: list[str] = []
    examples = list(entry.examples(k_examples))
    if indices is not None:
        examples = [examples[i] for i in indices]
    functions: dict[int, tuple[Any, Any, Any]] = {}

    def check(
        rule: Any,
        x: Any,
        label: str,
        finite_differences: bool,
        nan: str = "nan",
        checks: tuple[str, ...] | None = None,
        order: int = 1,
    ) -> RuleReport:
        # The same functions for every input of an example, so that the checks
        # at its later inputs reuse the program traced at its first (`reusing`).
        if id(rule) not in functions:
            fn, _, refs = entry.check_arguments(rule, x, k_call)
            functions[id(rule)] = (rule, fn, refs)
        _, fn, refs = functions[id(rule)]
        args = (rule, *x) if isinstance(x, Args) else (rule, x)
        domain = rule.input_domain()
        report = check_rule(
            fn,
            *args,
            **refs,
            finite_differences=finite_differences,
            raise_on_failure=False,
            where_reference_nan=nan,
            checks=checks,
            order=order,
            cotangent_thresholds=rule.cotangent_thresholds(),
            tangent_space=tangent_space(domain, isinstance(x, Args)),
        )
        if not rule.second_order():
            result = report["second_order"]
            result.status, result.detail = "unsupported", _NOT_DIFFERENTIABLE
        labels.append(label)
        reports.append(report)
        return report

    def example(i: int, rule: Any) -> None:
        name = f"example {i} ({rule!r})"
        domain = rule.input_domain()
        second = rule.second_order()
        # With second order, every call at this example computes it (one program,
        # `_core.wanted`); it is checked where the derivative is differentiable.
        order = 2 if second else 1
        on_kinks = domain.on_kinks(k_on)
        n = len(domain.kinks)
        for j, x in enumerate(on_kinks):
            # The first input gets the whole battery; the others the checks whose
            # outcome depends on the input's values.
            if not n:
                where = "at a random input (it declares no kinks)"
            elif len(on_kinks) == 1:
                where = "at its kinks"
            elif isinstance(domain, Inputs):  # each input holds its own
                where = f"at its kinks (input {j + 1} of {len(on_kinks)} holding them)"
            else:
                size = math.prod(domain.shape)
                last = min(n, (j + 1) * size)
                where = f"at its kinks {j * size + 1} to {last} of {n}"
            # (Not second order at the kinks, where the derivative jumps.)
            checks = _BATTERY if j == 0 else VALUE_CHECKS
            check(rule, x, f"{name} {where}", False, checks=checks, order=order)
        # Where a reference's own formula breaks down (NaN), the rule need not.
        for what, x in domain.degenerate(k_degenerate):
            label = f"{name} at {what}"
            report = check(rule, x, label, False, "any", VALUE_CHECKS, order=order)
            note = _outside(report, label)
            skipped.extend([] if note is None else [note])
        for what, x in domain.extremes(k_extreme):
            label = f"{name} at {what}"
            # Second order where a second derivative (a product of two) need not
            # overflow: finite inputs no larger than `1e30` (for float32).
            twice = second and _moderate(x)
            at = (*VALUE_CHECKS, "second_order") if twice else VALUE_CHECKS
            report = check(rule, x, label, False, "any", at, order=order)
            note = _outside(report, label)
            skipped.extend([] if note is None else [note])
        off_kinks = domain.sample(k_off, off_kinks=True)
        label = f"{name} off its kinks"
        if rule.is_exact():
            check(rule, off_kinks, label, True, checks=_BATTERY, order=order)
        if second:  # (the program of the extremes' second order, reused)
            checks = (*VALUE_CHECKS, "second_order")
            check(
                rule,
                off_kinks,
                f"{label}, at second order",
                False,
                checks=checks,
                order=2,
            )

    with reusing():
        for i, rule in zip(
            range(len(examples)) if indices is None else indices, examples, strict=True
        ):
            example(i, rule)
    seconds = time.perf_counter() - start
    return EntryResult(entry, reports, seconds, labels, examples, skipped)


__all__ = ["CHECKS", "EntryResult", "tangent_space", "verify"]
