"""A user's own rule class on the command line: `python -m eqxrules verify
mymod:MyRule` runs [`verify_rule`][eqxrules.verify_rule]'s battery on it, and
`check mymod:MyRule` builds it with its defaults, as the catalogue's classes are
built."""

from __future__ import annotations

import dataclasses
from typing import Any

from ._catalogue import Entry, Rule, catalogue
from ._verify import combined_status
from ._verify_rule import RuleVerification, verify_rule
from .testing import RuleReport


def rule_class(obj: Any) -> type[Rule] | None:
    """`obj` if it is a rule class (a `JVPRule` or `VJPRule` subclass), else
    `None`."""
    return obj if isinstance(obj, type) and issubclass(obj, Rule) else None


def spec_of(rule: type) -> str:
    """Where `rule` is imported from, as `PKG.MODULE:NAME`."""
    return f"{rule.__module__}:{rule.__qualname__}"


def modes_of(forward_mode: bool) -> tuple[str, ...]:
    return ("fwd", "rev") if forward_mode else ("rev",)


def built_with_defaults(rule: type[Rule], spec: str, command: str) -> Rule:
    """`rule()`, or a `SystemExit` saying that it needs arguments."""
    try:
        return rule()
    except (TypeError, ValueError) as err:
        raise SystemExit(
            f"eqxrules {command}: {spec!r} is a Module class that cannot be built "
            f"with its defaults ({err}); point at an instance instead"
        ) from None


def verify_target(obj: Any, spec: str, command: str = "verify") -> Entry | type[Rule]:
    """What `verify PKG.MODULE:NAME` (or `plot`) takes: the catalogue entry of a
    library rule class, or a user's rule class itself."""
    cls = rule_class(obj)
    if cls is not None:
        found = [e for e in catalogue() if e.module is cls]
        return found[0] if found else cls
    if isinstance(obj, Rule):
        raise SystemExit(
            f"eqxrules {command}: {spec!r} is an instance of `{type(obj).__name__}`: "
            f"point at its class ({spec_of(type(obj))}), whose `examples` are "
            f"{'verified' if command == 'verify' else 'used'}; or check this "
            f"instance with `python -m eqxrules check {spec}`"
        )
    raise SystemExit(
        f"eqxrules {command}: {spec!r} is not a rule class: `{command}` takes "
        "catalogue names, or a subclass of `eqxrules.JVPRule` or `eqxrules.VJPRule` "
        f"as PKG.MODULE:NAME; check a function with `python -m eqxrules check "
        f"{spec} --derivative ...`"
    )


@dataclasses.dataclass
class UserResult:
    """A user's rule class verified by `verify_rule`, with the face of an
    [`EntryResult`][eqxrules._verify.EntryResult] that the command line reads."""

    name: str  # as given: PKG.MODULE:NAME
    verification: RuleVerification

    @property
    def module(self) -> type:
        return self.verification.rule

    @property
    def modes(self) -> tuple[str, ...]:
        return modes_of(self.verification.rule.forward_mode)

    @property
    def reports(self) -> list[RuleReport]:
        return [r for _, r in self.verification.reports]

    @property
    def examples(self) -> list[Any]:
        return self.verification.examples

    @property
    def seconds(self) -> float:
        return self.verification.seconds

    @property
    def passed(self) -> bool:
        return self.verification.passed

    def status(self, check: str) -> str:
        return combined_status(self.reports, check)

    def failures(self) -> list[str]:
        return list(self.verification.problems)


def verify_user(name: str, rule: type[Rule]) -> UserResult:
    """`verify_rule(rule)`'s battery, never raising on a failing check."""
    return UserResult(name, verify_rule(rule, raise_on_failure=False))
