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
from jaxtyping import PRNGKeyArray

from ._catalogue import Entry, Rule
from ._registry import entry_of, missing_parts
from .testing import CHECKS, RuleReport, check_rule


@dataclasses.dataclass
class EntryResult:
    """The reports of every check of one entry, and a status per check: `"passed"`
    if it passed somewhere and failed nowhere, `"failed"` if it failed anywhere,
    else `"unsupported"` or `"skipped"`."""

    entry: Entry
    reports: list[RuleReport]
    seconds: float
    labels: list[str] = dataclasses.field(default_factory=list)  # one per report
    examples: list[Any] = dataclasses.field(default_factory=list)  # those checked

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
            result.describe()
            for report in self.reports
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


def verify(
    entry: Entry,
    key: PRNGKeyArray | None = None,
    *,
    indices: Sequence[int] | None = None,
) -> EntryResult:
    """Check every example of `entry` (or those at `indices`, as built from the
    same key); never raises on a failing check.

    For each example `rule`, with `domain = rule.input_domain()`, `check_rule`
    against the references:

    - at every kink: one input of `domain.shape` per `n` kinks (`n` elements per
        input), from `domain.on_kinks`; the first with every check, the others
        with those whose outcome depends on the input's values (`VALUE_CHECKS`:
        the value, the JVP and the VJP);
    - at each degenerate input of `domain.degenerate` (a zero, a constant and a
        non-finite slice), where a rule that reduces over an axis goes wrong and
        must still agree with its references (the value, the JVP and the VJP):
        finite where they are finite, NaN only where they are;
    - for an example whose `is_exact()`, against finite differences off its
        kinks."""
    key = jax.random.key(0) if key is None else key
    k_examples, k_on, k_off, k_call, k_degenerate = jax.random.split(key, 5)
    start = time.perf_counter()
    reports = []
    labels = []
    examples = list(entry.examples(k_examples))
    if indices is not None:
        examples = [examples[i] for i in indices]

    def check(
        rule: Any,
        x: Any,
        label: str,
        finite_differences: bool,
        nan: str = "nan",
        checks: tuple[str, ...] | None = None,
    ) -> None:
        fn, args, refs = entry.check_arguments(rule, x, k_call)
        labels.append(label)
        reports.append(
            check_rule(
                fn,
                *args,
                **refs,
                finite_differences=finite_differences,
                raise_on_failure=False,
                where_reference_nan=nan,
                checks=checks,
            )
        )

    for i, rule in zip(
        range(len(examples)) if indices is None else indices, examples, strict=True
    ):
        domain = rule.input_domain()
        on_kinks = domain.on_kinks(k_on)
        size, n = math.prod(domain.shape), len(domain.kinks)
        for j, x in enumerate(on_kinks):
            part = (
                f" {j * size + 1} to {min(n, (j + 1) * size)} of {n}"
                if len(on_kinks) > 1
                else ""
            )
            # The first input gets the whole battery; the others the checks whose
            # outcome depends on the input's values.
            checks = None if j == 0 else VALUE_CHECKS
            label = f"example {i} ({rule!r}) at its kinks{part}"
            check(rule, x, label, False, checks=checks)
        for what, x in domain.degenerate(k_degenerate):
            # Where a reference's own formula breaks down (NaN), the rule need not.
            label = f"example {i} ({rule!r}) at {what}"
            check(rule, x, label, False, "any", VALUE_CHECKS)
        if rule.is_exact():
            off_kinks = domain.sample(k_off, off_kinks=True)
            check(rule, off_kinks, f"example {i} ({rule!r}) off its kinks", True)
    seconds = time.perf_counter() - start
    return EntryResult(entry, reports, seconds, labels, examples)


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
    """

    rule: type
    reports: list[tuple[str, RuleReport]]
    problems: list[str]
    seconds: float
    examples: list[Any] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        """Whether there is no problem."""
        return not self.problems

    def __str__(self) -> str:
        head = f"`{self.rule.__name__}`: "
        if self.passed:
            checked = len(self.reports)
            return f"{head}passed ({checked} check_rule runs, {self.seconds:.1f} s)"
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
    out = fn(m, *xs)
    # In every floating-point input (a rule of several may take a boolean mask).
    grads = eqx.filter_grad(lambda xs: fn(m, *xs).astype(jnp.float32).sum())(xs)
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
    if not problems:
        entry = entry_of(rule)
        result = verify(entry, key)
        reports = list(zip(result.labels, result.reports))
        examples = list(result.examples)
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
        rule, reports, problems, time.perf_counter() - start, examples
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
