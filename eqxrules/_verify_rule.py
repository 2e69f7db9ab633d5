"""[`verify_rule`][eqxrules.verify_rule]: the catalogue's battery (`_verify.verify`)
on a user's rule class, and the checks of its declaration that the catalogue's own
tests make for the library's rules: declared parts, invalid hyperparameters
rejected, bfloat16 kept."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from ._catalogue import Entry, Rule
from ._registry import entry_of, missing_parts
from ._verify import verify
from .testing import RuleReport


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
        rule's learnable fields are checked), on inputs drawn from its
        `input_domain()` (a range left undeclared covers the kinks; a structured
        domain draws its own, and its `project` gives the tangents), with the
        cotangent also scaled by `1e-3`, `1e3` and to either side of its
        `cotangent_thresholds()`:
        - at every one of its `kinks()`, however many: as many inputs as it
            takes, each holding the next kinks;
        - at degenerate slices, where a rule that reduces over an axis (a norm, a
            scale from a mean) goes wrong: an all-zero input and a zero slice along
            every axis (where the range holds 0), a constant input and a constant
            slice along every axis, and one `inf`; and at the extremes of the
            dtype's range as the domain allows (`Domain.extremes`: every element
            `±1e30`, `±1e-30` or a quarter of the largest float32, one `-inf`, a
            masked row). There it must give what the references give wherever
            they are finite (a masked 0 stays 0; an infinite value or derivative
            where theirs is finite fails, naming the input); where they are NaN
            it may give anything (`where_reference_nan="any"`), and an input where
            they are finite nowhere is skipped, saying so (`skipped`);
        - an instance whose `is_exact()`, also against finite differences away
            from its kinks;
        - one whose `second_order()` (the default), at second order off its
            kinks and at the extremes up to `1e30`;
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


__all__ = ["RuleVerification", "RuleVerificationError", "verify_rule"]
