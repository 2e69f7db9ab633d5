"""What verifying a catalogue entry means, shared by `python -m eqxrules` and the
test suite: every example instance is checked with `check_rule` at a point that
includes its kinks (where straight-through estimators go wrong; `rule.kinks()`,
from its hyperparameters), and, for instances whose derivative is the true one,
against finite differences off the kinks."""

from __future__ import annotations

import dataclasses
import time

import jax
from jaxtyping import PRNGKeyArray

from ._catalogue import Entry
from .testing import CHECKS, RuleReport, check_rule


@dataclasses.dataclass
class EntryResult:
    """The reports of every check of one entry, and a status per check: `"passed"`
    if it passed somewhere and failed nowhere, `"failed"` if it failed anywhere,
    else `"unsupported"` or `"skipped"`."""

    entry: Entry
    reports: list[RuleReport]
    seconds: float

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.reports) and self.modes_match

    @property
    def modes_match(self) -> bool:
        """The checker found forward mode exactly where the entry declares it."""
        return all(r.forward_mode == self.entry.forward_mode for r in self.reports)

    def status(self, check: str) -> str:
        statuses = {r[check].status for r in self.reports}
        for s in ("failed", "passed", "unsupported", "skipped"):
            if s in statuses:
                return s
        return "skipped"

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


def verify(entry: Entry, key: PRNGKeyArray | None = None) -> EntryResult:
    """Check every example of `entry`; never raises on a failing check."""
    key = jax.random.key(0) if key is None else key
    k_examples, k_on, k_off, k_call = jax.random.split(key, 4)
    start = time.perf_counter()
    reports = []
    for rule in entry.examples(k_examples):
        domain = rule.input_domain()
        on_kinks = domain.sample(k_on, off_kinks=False)
        fn, args, refs = entry.check_arguments(rule, on_kinks, k_call)
        reports.append(
            check_rule(
                fn, *args, **refs, finite_differences=False, raise_on_failure=False
            )
        )
        if rule.is_exact():
            off_kinks = domain.sample(k_off, off_kinks=True)
            fn, args, refs = entry.check_arguments(rule, off_kinks, k_call)
            reports.append(
                check_rule(
                    fn, *args, **refs, finite_differences=True, raise_on_failure=False
                )
            )
    return EntryResult(entry, reports, time.perf_counter() - start)


__all__ = ["CHECKS", "EntryResult", "verify"]
