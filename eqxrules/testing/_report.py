"""What [`check_rule`][] returns: a result per check, gathered in a report."""

from __future__ import annotations

import dataclasses
from typing import Literal

Status = Literal["passed", "failed", "unsupported", "skipped"]


@dataclasses.dataclass
class CheckResult:
    """The outcome of one check.

    - `name`: one of [`CHECKS`][].
    - `status`: `"passed"`, `"failed"`, `"unsupported"` (forward-mode checks of a
        reverse-only rule) or `"skipped"` (not selected, no reference given, or mode
        not asked for).
    - `detail`: why it failed or was skipped.
    - `path`: the leaf where the largest error was (`jax.tree_util.keystr`).
    - `max_abs_error`, `max_rel_error`, `rtol`, `atol`: the figures behind it.
    - `index`, `actual`, `expected`: the worst element of that leaf (the largest
        error out of tolerance, on a failure), and the rule's and the reference's
        values there. For the checks that compare inner products (`transpose`,
        `finite_differences` through the VJP) `index` is `None` and `actual` and
        `expected` are the two inner products.
    - `inputs`: on a failure at an element, the input elements behind it, by the
        name of the argument as `fn`'s signature gives it (`x`,
        `m.sub_model.weight`; `args[1]` where it gives none, as for `*args`). For a
        cotangent, its argument's element at `index`; for an output leaf, the
        element at `index` of each input of the leaf's shape (the input element of
        an elementwise rule; a Module argument's parameters are left out), and
        `{}` when no input has that shape, so that no input element maps to the
        index. `None` where there is no element.
    - `compared`: how many elements the check compared (finite in both the rule's
        values and the reference's), for the checks that compare values; `0` on
        a failure that compared nothing, which would otherwise pass whatever the
        rule gave (NaN or infinite wherever the reference is). `None` where the
        check compares no values (`zero_cotangent`, `dtype`).
    - `seconds`: wall time of the check.
    - `exception`: the exception the rule raised inside the check, if any.
    """

    name: str
    status: Status
    detail: str = ""
    path: str = ""
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    rtol: float = 0.0
    atol: float = 0.0
    index: tuple[int, ...] | None = None
    actual: complex | float | None = None
    expected: complex | float | None = None
    inputs: dict[str, complex | float] | None = None
    compared: int | None = None
    seconds: float = 0.0
    exception: BaseException | None = None

    def describe(self) -> str:
        """One line: the check, its status, where, and the figures behind it."""
        where = f" at `{self.path}`" if self.path else ""
        figures = ""
        if self.status == "failed" and self.exception is None:
            if self.index:
                figures += f" index {self.index}"
            if self.inputs is not None:
                figures += f" {_describe_inputs(self.inputs)}"
            if self.actual is not None and self.expected is not None:
                figures += f": {self.actual:.6g} where the reference has "
                figures += f"{self.expected:.6g}"
            if self.max_abs_error or self.max_rel_error:
                figures += (
                    f"{';' if self.actual is not None else ':'} max abs error "
                    f"{self.max_abs_error:.3g}, max rel error {self.max_rel_error:.3g}"
                )
                if self.rtol or self.atol:
                    figures += f" (rtol={self.rtol:g}, atol={self.atol:g})"
        detail = f". {self.detail}" if self.detail else ""
        return f"check `{self.name}` {self.status}{where}{figures}{detail}"


_SHOWN_INPUTS = 4


def _describe_inputs(inputs: dict[str, complex | float]) -> str:
    if not inputs:
        return "(no input has this leaf's shape, so no input element maps to the index)"
    shown = [f"`{name}` = {value:.6g}" for name, value in inputs.items()]
    if len(shown) > _SHOWN_INPUTS:
        more = len(shown) - _SHOWN_INPUTS
        shown = [*shown[:_SHOWN_INPUTS], f"and {more} more"]
    return f"({'input' if len(inputs) == 1 else 'inputs'} {', '.join(shown)})"


@dataclasses.dataclass
class RuleReport:
    """Every [`CheckResult`][] of one [`check_rule`][] call, in [`CHECKS`][] order.

    `forward_mode` is whether the rule supports forward mode (`False` when forward
    mode was not asked for). `warnings` holds each distinct warning the rule raised
    while being checked, once (`"Category: message"`); `check_rule` also re-emits
    each once.
    """

    results: list[CheckResult]
    forward_mode: bool
    warnings: list[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        """Whether no check failed."""
        return not self.failed

    @property
    def failed(self) -> list[str]:
        """The names of the failed checks."""
        return [r.name for r in self.results if r.status == "failed"]

    @property
    def seconds(self) -> float:
        """The wall time of every check together."""
        return sum(r.seconds for r in self.results)

    def __getitem__(self, name: str) -> CheckResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(name)

    def __str__(self) -> str:
        lines = [r.describe() for r in self.results]
        lines += [f"the rule warned: {w}" for w in self.warnings]
        return "\n".join(lines)


class RuleCheckError(AssertionError):
    """Raised by [`check_rule`][] when a check fails. `report` holds every result,
    `failed` the names of the failing checks."""

    def __init__(self, message: str, report: RuleReport) -> None:
        super().__init__(message)
        self.report = report
        self.failed = report.failed
