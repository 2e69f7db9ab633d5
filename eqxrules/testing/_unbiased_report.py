"""What `check_unbiased` reports, and the error it raises."""

from __future__ import annotations

import dataclasses

import numpy as np

TEST = (
    "two-sided Chernoff-KL bound per element (Hoeffding 1963, Theorem 1), "
    "union bound over the elements"
)


@dataclasses.dataclass(frozen=True, eq=False)
class UnbiasedReport:
    r"""What [`check_unbiased`][] found. With $n$ = `draws`:

    - `passed`, `detail`: whether it passed; why not (the failure's message).
    - `test`, `draws`, `elements`, `false_fail_rate`, `false_pass_rate`,
        `threshold`: the test; the elements $m$ with $0 < p < 1$ (the union bound's
        count; without `neighbours`, those that drew a value other than `x`);
        $\alpha$; $\beta$; $c = \log(2m/\alpha)$, the bound on
        $n\,\mathrm{KL}(\hat q \| p)$.
    - `index`, `x`, `mean`, `interval`, `statistic`, `p_value`: the worst element
        (the one failing, or the nearest to failing): its index, `x` there, the
        observed mean of its draws, the interval an unbiased rounding keeps that
        mean in (but for probability $\alpha$ over all elements; NaN where one
        neighbour was not drawn), its $n\,\mathrm{KL}(\hat q \| p)$, and the
        bound $\min(1, 2m\,e^{-n\mathrm{KL}})$ on its union-bound p-value (the
        check fails when it is below $\alpha$). With stray draws, the element with
        the most.
    - `stray_draws`: draws that were neither neighbour given, a third value drawn
        at an element, not finite, or outside `bounds` or `within`.
    - `lower`, `upper`: per element, the neighbours $L \le U$ the test used:
        given, or the values drawn (NaN for one not drawn); with `within`, the
        range.
    - `detectable`: the detectable bias ([`detectable_bias`][]) as a fraction of
        each element's own gap $U - L$ (of its range, with `within`), the worst
        over the elements with $L < U$ ($0$ if none).
    - `detectable_fractions`, `detectable_biases`, `means`: per element, the
        detectable bias as a fraction of its gap and in `x`'s units (that times
        $U - L$; $0$ where $L = U$, NaN where the gap is not known), and the
        observed mean.
    - `one_valued`: elements that drew one value other than `x` in every draw
        and passed, `bounds` allowing the other neighbour so far away that this
        is chance: the test says nothing of their bias.
    """

    passed: bool
    detail: str
    test: str
    draws: int
    elements: int
    false_fail_rate: float
    false_pass_rate: float
    threshold: float
    index: tuple[int, ...]
    x: float
    mean: float
    interval: tuple[float, float]
    statistic: float
    p_value: float
    stray_draws: int
    lower: np.ndarray
    upper: np.ndarray
    detectable: float
    detectable_fractions: np.ndarray
    detectable_biases: np.ndarray
    means: np.ndarray
    one_valued: int

    def __str__(self) -> str:
        verdict = "passed" if self.passed else f"failed: {self.detail}"
        blind = (
            f" {self.one_valued} element(s) drew one value only, the other "
            "neighbour unseen: no bias is stated there."
            if self.one_valued
            else ""
        )
        return (
            f"check_unbiased {verdict}\n{self.draws} draws, {self.test} over "
            f"{self.elements} element(s) at false-fail rate {self.false_fail_rate:g}. "
            f"Worst element {self.index}: mean {self.mean:.9g} where x = {self.x:.9g} "
            f"(bound [{self.interval[0]:.9g}, {self.interval[1]:.9g}], p-value at "
            f"most {self.p_value:.3g}). Detectable bias {self.detectable:.3g} of an "
            f"element's gap between its neighbours (the worst element), with power "
            f"{1 - self.false_pass_rate:g}.{blind}"
        )


class UnbiasedCheckError(AssertionError):
    """Raised by [`check_unbiased`][] when the draws are biased or stray; `report`
    is its [`UnbiasedReport`][]."""

    def __init__(self, message: str, report: UnbiasedReport) -> None:
        super().__init__(message)
        self.report = report
