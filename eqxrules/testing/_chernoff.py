"""The arithmetic of `check_unbiased`'s test, whose docstring gives the bound: the
Bernoulli KL divergence, its inversion by bisection, and the bias the test detects
(`detectable_bias`, `draws_to_detect_bias`). NumPy in float64 on the host; nothing
needs scipy."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np
from jaxtyping import ArrayLike

_ITERATIONS = 64  # bisection steps: a bracket in [0, 1] narrower than 1e-19


def _kl(a: Any, p: Any) -> np.ndarray:
    r"""$\mathrm{KL}(a \| p)$ of Bernoulli laws, elementwise: $0 \log 0 = 0$, and
    infinite where $a$ puts mass where $p$ puts none."""
    a, p = np.asarray(a, np.float64), np.asarray(p, np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        up = np.where(a > 0, a * np.log(a / p), 0.0)
        down = np.where(a < 1, (1 - a) * np.log((1 - a) / (1 - p)), 0.0)
    return up + down


def _solve(f: Callable[[np.ndarray], np.ndarray], near, far, t) -> np.ndarray:
    """Bisection for where `f`, growing from `near` towards `far`, passes `t`; given
    `f(near) <= t < f(far)`, returns the far end of the last bracket, so the answer
    errs away from `near` (the conservative side for every use here)."""
    near, far = np.array(near, np.float64), np.array(far, np.float64)
    for _ in range(_ITERATIONS):
        mid = (near + far) / 2
        over = f(mid) > t
        far, near = np.where(over, mid, far), np.where(over, near, mid)
    return far


def _envelope(p: Any, draws: int, c: float, b: float) -> tuple[np.ndarray, ...]:
    r"""Per `p`: the fractions below and above it past which the check fails
    ($n\,\mathrm{KL} = c$; 0 or 1 where a side never fails), and the detectable
    shift of $P(U)$ for $b = \log(1/\beta)$ (see `detectable_bias`)."""
    p = np.asarray(p, np.float64)
    edges, worst = [], np.zeros_like(p)
    for end in (0.0, 1.0):
        far = np.full_like(p, end)
        reachable = _kl(far, p) > c / draws
        edge = np.where(reachable, _solve(lambda a: _kl(a, p), p, far, c / draws), far)
        # The true fraction `alt` beyond the edge at which the tail on `p`'s side,
        # P(q <= edge) <= exp(-n KL(edge || alt)) (or >=), is at most beta.
        alt = _solve(lambda a: _kl(edge, a), edge, far, b / draws)
        worst = np.maximum(worst, np.abs(np.where(reachable, alt, far) - p))
        edges.append(edge)
    return edges[0], edges[1], worst


def _as_int(name: str, fn: str, value: Any, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"`{fn}`: `{name}` must be an int, not {type(value).__name__} (={value!r})."
        )
    if value < least:
        raise ValueError(f"`{fn}`: `{name}` (={value!r}) must be >= {least}.")
    return int(value)


def _as_rate(name: str, fn: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{fn}`: `{name}` must be a float, not {type(value).__name__} (={value!r})."
        )
    rate = float(value)
    if not 0 < rate < 1:
        raise ValueError(f"`{fn}`: `{name}` (={value!r}) must lie in (0, 1).")
    return rate


def _as_fraction(name: str, fn: str, value: Any, low: float) -> np.ndarray:
    out = np.asarray(value, np.float64)
    if not np.all((out >= low) & (out <= 1)):  # NaN fails too
        raise ValueError(
            f"`{fn}`: `{name}` (={value!r}) must lie in "
            f"{'[0, 1]' if low == 0 else '(0, 1]'}."
        )
    return out


def detectable_bias(
    draws: int,
    p: ArrayLike = 0.5,
    *,
    elements: int = 1,
    false_fail_rate: float = 1e-6,
    false_pass_rate: float = 0.5,
) -> np.ndarray:
    r"""The smallest bias [`check_unbiased`][] detects, as a fraction of $U - L$.

    With $n$ = `draws`, $m$ = `elements`, $\alpha$ = `false_fail_rate`,
    $\beta$ = `false_pass_rate` and $c = \log(2m/\alpha)$, the check fails at an
    element once $\hat q$ passes $q_+ > p$ with $n\,\mathrm{KL}(q_+ \| p) = c$ (or
    $q_- < p$, alike). If the rounding's true $P(U)$ is $p' > q_+$, the lower tail
    gives $P(\hat q \le q_+) \le e^{-n\,\mathrm{KL}(q_+ \| p')}$, which is at most
    $\beta$ once $n\,\mathrm{KL}(q_+ \| p') \ge \log(1/\beta)$. So every $p'$ at
    least as far from $p$ as that is caught with probability at least $1 - \beta$
    (the power), and likewise below. Returned is the larger of the two distances
    $\lvert p' - p\rvert$. A side the test can never fail on counts its whole
    reach ($1 - p$ or $p$): no bias larger than that exists there. For
    $p \in \{0, 1\}$ a single wrong draw fails, and the answer is
    $1 - \beta^{1/n}$.

    Like TensorFlow Probability's `min_discrepancy_of_true_means_detectable_by_dkwm`,
    it is the sum of two envelopes: the test's own at $\alpha/m$ and the sampling
    one at $\beta$. Roughly $\bigl(\sqrt{2c} + \sqrt{2\log(1/\beta)}\bigr)
    \sqrt{p(1 - p)/n}$, so it falls as $1/\sqrt{n}$.

    **Arguments:**

    - `draws`: the number of draws $n$.
    - `p`: $P(U)$ of an unbiased rounding, $(x - L)/(U - L)$ (any array shape).
    - `elements`: how many elements are tested at once, $m$ (the union bound).
    - `false_fail_rate`: $\alpha$, over all the elements.
    - `false_pass_rate`: $\beta$; the power is $1 - \beta$.

    **Returns:** the detectable shift of $P(U)$, the shape of `p`. Times $U - L$,
    the detectable bias of the mean. A relative bias $r$ (a rounding up with
    probability $p(1 + r)$) shifts $P(U)$ by $rp$.
    """
    name = "detectable_bias"
    draws = _as_int("draws", name, draws)
    m = _as_int("elements", name, elements)
    alpha = _as_rate("false_fail_rate", name, false_fail_rate)
    beta = _as_rate("false_pass_rate", name, false_pass_rate)
    p = _as_fraction("p", name, p, 0.0)
    return _envelope(p, draws, math.log(2 * m / alpha), math.log(1 / beta))[2]


def draws_to_detect_bias(
    bias: ArrayLike,
    p: ArrayLike = 0.5,
    *,
    elements: int = 1,
    false_fail_rate: float = 1e-6,
    false_pass_rate: float = 0.5,
) -> int:
    r"""The fewest draws with which [`check_unbiased`][] detects a shift of $P(U)$
    by `bias` (a fraction of $U - L$) at every given `p`, with probability at
    least $1 - $ `false_pass_rate`: the smallest $n$ with
    [`detectable_bias`][]`(n, p) <= bias`, found by bisection (it falls with $n$).
    Like TensorFlow Probability's `min_num_samples_for_dkwm_mean_test`; it grows as
    $\log(m/\alpha)/\text{bias}^2$.

    !!! Example
        A rounding up with probability $1.03\,p$ (a 3% relative bias) at
        $p = 1/2$, among 1000 elements, at a false-fail rate of $10^{-6}$:
        `draws_to_detect_bias(0.03 * 0.5, 0.5, elements=1000)` is 66,243.
    """
    name = "draws_to_detect_bias"
    bias = _as_fraction("bias", name, bias, np.nextafter(0.0, 1.0))
    p = np.asarray(p, np.float64)

    def caught(n: int) -> bool:
        shift = detectable_bias(
            n,
            p,
            elements=elements,
            false_fail_rate=false_fail_rate,
            false_pass_rate=false_pass_rate,
        )
        return bool(np.all(shift <= bias))

    low, high = 0, 1
    while not caught(high):
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if caught(mid) else (mid, high)
    return high
