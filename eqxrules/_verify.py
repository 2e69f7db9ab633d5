"""What verifying a catalogue entry means, shared by `python -m eqxrules`, the test
suite and [`eqxrules.verify_rule`][]: every example instance is checked
with `check_rule` at every one of its kinks (where straight-through estimators go
wrong; `rule.kinks()`, from its hyperparameters), at degenerate slices (zero,
constant, one inf: where a rule that reduces over an axis goes wrong), and, for
instances whose derivative is the true one, against finite differences off the
kinks.

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
import jax.numpy as jnp
import numpy as np
from jaxtyping import PRNGKeyArray

from ._catalogue import Entry, Rule
from ._domain import Args, Domain, Inputs, _magnitudes
from ._registry import entry_of, missing_parts
from .testing import CHECKS, RuleReport, check_rule
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

_NOT_DIFFERENTIABLE = (
    "the rule declares its derivative not differentiable (`second_order()` is "
    "False), so it has no second derivative to check"
)


def cotangent_scales(rule: Any) -> tuple[float, ...]:
    """The scales the `vjp` check multiplies its random cotangent by for `rule`:
    `1e-3`, `1` and `1e3`, and four times each of the rule's
    `cotangent_thresholds()` (a clipping level), so that its backward pass is
    tried on both sides of every one."""
    crossing = [4 * abs(float(t)) for t in rule.cotangent_thresholds()]
    crossing = [s for s in crossing if math.isfinite(s) and s > 0]
    return tuple(sorted({1e-3, 1.0, 1e3, *crossing}))


def _tangent_space(domain: Any, several: bool) -> tuple[Any, ...] | None:
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
            np.all(np.isfinite(a)) and np.all(np.abs(a) <= _magnitudes(leaf.dtype)[0])
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
    against the references (cotangents scaled by `cotangent_scales(rule)`,
    tangents in the domain's tangent space):

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
            cotangent_scales=cotangent_scales(rule),
            tangent_space=_tangent_space(domain, isinstance(x, Args)),
        )
        if order == 1 or not rule.second_order():
            result = report["second_order"]
            if not rule.second_order() and result.detail != "not selected":
                result.status, result.detail = "unsupported", _NOT_DIFFERENTIABLE
        labels.append(label)
        reports.append(report)
        return report

    def example(i: int, rule: Any) -> None:
        name = f"example {i} ({rule!r})"
        domain = rule.input_domain()
        second = rule.second_order()
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
            checks = None if j == 0 else VALUE_CHECKS
            check(rule, x, f"{name} {where}", False, checks=checks)
        # Where a reference's own formula breaks down (NaN), the rule need not.
        for what, x in domain.degenerate(k_degenerate):
            label = f"{name} at {what}"
            note = _outside(check(rule, x, label, False, "any", VALUE_CHECKS), label)
            skipped.extend([] if note is None else [note])
        for what, x in domain.extremes(k_extreme):
            label = f"{name} at {what}"
            # Second order where a second derivative (a product of two) need not
            # overflow: finite inputs no larger than `1e30` (for float32).
            twice = second and _moderate(x)
            at = (*VALUE_CHECKS, "second_order") if twice else VALUE_CHECKS
            report = check(rule, x, label, False, "any", at, order=2 if twice else 1)
            note = _outside(report, label)
            skipped.extend([] if note is None else [note])
        off_kinks = domain.sample(k_off, off_kinks=True)
        label = f"{name} off its kinks"
        if rule.is_exact():
            check(rule, off_kinks, label, True)
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


@dataclasses.dataclass
class RuleVerification:
    """What [`verify_rule`][eqxrules.verify_rule] found.

    - `rule`: the rule class.
    - `reports`: `(what was checked, RuleReport)` for each
        [`check_rule`][eqxrules.testing.check_rule] call.
    - `problems`: every failure, in words: declaration parts missing, failing
        checks, a forward mode other than declared, an invalid hyperparameter
        accepted, a dtype not kept.
    - `seconds`: wall time.
    - `examples`: the example instances checked (none where the declaration is
        incomplete).
    - `skipped`: the degenerate or extreme inputs (or the checks at one) not
        judged because the references are finite nowhere there, in words: outside
        the rule's domain.
    """

    rule: type
    reports: list[tuple[str, RuleReport]]
    problems: list[str]
    seconds: float
    examples: list[Any] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        """Whether there is no problem."""
        return not self.problems

    def __str__(self) -> str:
        head = f"`{self.rule.__name__}`: "
        if self.passed:
            checked = len(self.reports)
            outside = (
                f", {len(self.skipped)} skipped outside its domain"
                if self.skipped
                else ""
            )
            return (
                f"{head}passed ({checked} check_rule runs{outside}, "
                f"{self.seconds:.1f} s)"
            )
        return (
            head
            + f"{len(self.problems)} problem(s)\n"
            + "\n".join(f"- {p}" for p in self.problems)
        )


class RuleVerificationError(AssertionError):
    """Raised by [`verify_rule`][eqxrules.verify_rule] when a rule fails;
    `verification` holds the [`RuleVerification`][eqxrules.RuleVerification]."""

    def __init__(self, verification: RuleVerification) -> None:
        super().__init__(str(verification))
        self.verification = verification


def _rejects(rule: type, bad: Any) -> str | None:
    """`None` if building `rule(**bad.kwargs)` raises `bad.error` naming the rule and
    the argument, else what happened instead."""
    names = (f"`{rule.__name__}`", f"`{entry_of(rule).name}`")
    try:
        rule(**bad.kwargs)
    except bad.error as e:
        message = str(e)
        if any(n in message for n in names) and f"`{bad.argument}`" in message:
            return None
        return f"its message does not name the rule and `{bad.argument}`: {message}"
    except Exception as e:  # noqa: BLE001  (reported, not raised)
        return f"raised {type(e).__name__} instead of {bad.error.__name__}: {e}"
    return f"was accepted (a {bad.error.__name__} is due)"


def _keeps_dtype(entry: Entry, rule: Any, key: PRNGKeyArray) -> list[str]:
    """An elementwise rule on bfloat16 input gives a bfloat16 value and gradient."""
    x = rule.input_domain().sample(key, jnp.bfloat16, off_kinks=False)
    fn, (m, *xs), _ = entry.check_arguments(rule, x, key)
    try:
        out = fn(m, *xs)
        # In every floating-point input (a rule of several may take a boolean mask).
        grads = eqx.filter_grad(lambda xs: fn(m, *xs).astype(jnp.float32).sum())(xs)
    except Exception as e:  # noqa: BLE001  (reported, not raised)
        return [f"on bfloat16 input it raised {type(e).__name__}: {e}"]
    named = [("value", out)] + [
        ("gradient", g) for g in jax.tree_util.tree_leaves(grads)
    ]
    return [
        f"`{name}` is {a.dtype} for bfloat16 input (it must stay bfloat16)"
        for name, a in named
        if a.dtype != jnp.bfloat16
    ]


def verify_rule(
    rule: type[Rule],
    *,
    key: PRNGKeyArray | None = None,
    raise_on_failure: bool = True,
) -> RuleVerification:
    """Verify a rule class the way eqxrules verifies its own catalogue, without
    adding it to the catalogue.

    The battery, for a [`JVPRule`][eqxrules.JVPRule] or
    [`VJPRule`][eqxrules.VJPRule] subclass:

    1. its declaration is complete: a class docstring, `summary`, the value, the
        derivative, `reference_forward`, `reference_derivative` or `reference_vjp`,
        and every field declared with [`hyperparameter`][eqxrules.hyperparameter]
        (or `parameter`);
    2. every instance of `rule.examples(key)` passes
        [`check_rule`][eqxrules.testing.check_rule] against the references, with
        the Module itself as an argument (so a wrapped model's parameters and the
        rule's learnable fields are checked), on inputs of its domain's shape
        drawn from its `input_domain()` (a range left undeclared covers the
        kinks):
        - at every one of its `kinks()`, however many: as many inputs as it
            takes, each holding the next kinks;
        - at degenerate slices, where a rule that reduces over an axis (a norm, a
            scale from a mean) goes wrong: an all-zero input and a zero slice along
            every axis (where the range holds 0), a constant input and a constant
            slice along every axis, and one `inf`. There it must give what the
            references give wherever they are finite (a masked 0 stays 0); where
            they are NaN it may give anything (`where_reference_nan="any"`);
        - an instance whose `is_exact()`, also against finite differences away
            from its kinks;
    3. it supports forward mode exactly as declared (`JVPRule` yes, `VJPRule` no);
    4. every invalid value its field declarations imply is rejected when the
        Module is built, with the declared `TypeError` or `ValueError` naming the
        rule and the argument;
    5. an `elementwise` rule keeps bfloat16: value and gradient.

    **Arguments:**

    - `rule`: the rule class (not an instance).
    - `key`: a PRNG key for the examples and inputs (default `jax.random.key(0)`).
    - `raise_on_failure`: raise [`RuleVerificationError`][eqxrules.RuleVerificationError]
        (an `AssertionError`) listing every problem, if there is one.

    **Returns:**

    A [`RuleVerification`][eqxrules.RuleVerification].

    !!! Example

        ```python
        from eqxrules import verify_rule

        print(verify_rule(MyRule))  # `MyRule`: passed (14 check_rule runs, 2.1 s)
        ```
    """
    if not (isinstance(rule, type) and issubclass(rule, Rule)):
        shown = type(rule).__name__ if not isinstance(rule, type) else rule.__name__
        hint = " (pass the class, not an instance)" if isinstance(rule, Rule) else ""
        raise TypeError(
            "`verify_rule`: `rule` must be a subclass of `eqxrules.JVPRule` or "
            f"`eqxrules.VJPRule`, not {shown}{hint}."
        )
    if not isinstance(raise_on_failure, bool):
        raise TypeError(
            "`verify_rule`: `raise_on_failure` must be a bool, not "
            f"{type(raise_on_failure).__name__} (={raise_on_failure!r})."
        )
    key = jax.random.key(0) if key is None else key
    start = time.perf_counter()
    problems = [
        f"the declaration lacks {part}"
        for part in missing_parts(rule)
        if not part.startswith("registration")
    ]
    reports: list[tuple[str, RuleReport]] = []
    examples: list[Any] = []
    skipped: list[str] = []
    if not problems:
        entry = entry_of(rule)
        result = verify(entry, key)
        reports = list(zip(result.labels, result.reports))
        examples = list(result.examples)
        skipped = list(result.skipped)
        problems += [
            f"{label}: {r.describe()}"
            for label, report in reports
            for r in report.results
            if r.status == "failed"
        ]
        if not result.modes_match:
            problems.append(
                f"forward mode: declared {entry.forward_mode} (as a "
                f"{'JVPRule' if entry.forward_mode else 'VJPRule'}), but the "
                "checker found otherwise"
            )
        for bad in rule.invalid_hyperparameters(key):
            why = _rejects(rule, bad)
            if why is not None:
                problems.append(f"`{bad.argument}`={bad.value!r}: {why}")
        if entry.elementwise:
            for i, m in enumerate(result.examples):
                problems += [f"example {i}: {p}" for p in _keeps_dtype(entry, m, key)]
    verification = RuleVerification(
        rule, reports, problems, time.perf_counter() - start, examples, skipped
    )
    if raise_on_failure and problems:
        raise RuleVerificationError(verification)
    return verification


__all__ = [
    "CHECKS",
    "EntryResult",
    "RuleVerification",
    "RuleVerificationError",
    "verify",
    "verify_rule",
]
