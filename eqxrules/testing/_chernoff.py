r"""The bound behind [`check_unbiased`][], and what it can detect.

The statistics, once: an element with neighbours $L \le x \le U$ is rounded up with
probability $p = (x - L)/(U - L)$ when the rounding is unbiased. Over $n$
independent draws, let $\hat q$ be the fraction rounded up. Chernoff's bound, in
Hoeffding's form (1963, Theorem 1, which holds for any independent variables in
$[0, 1]$, not only for Bernoulli ones), bounds either tail:

$$P(\hat q \ge a) \le e^{-n\,\mathrm{KL}(a \,\|\, p)}\ (a \ge p), \qquad
P(\hat q \le a) \le e^{-n\,\mathrm{KL}(a \,\|\, p)}\ (a \le p),$$

$$\mathrm{KL}(a \,\|\, p) = a \log\frac{a}{p} + (1 - a) \log\frac{1 - a}{1 - p}.$$

The statistic is the same in both of `check_unbiased`'s modes: with neighbours,
$\hat q$ is a count; with bounds $[lo, hi]$, $\hat q$ is the mean of the draws
mapped onto $[0, 1]$. Host arithmetic is NumPy in float64; nothing needs scipy.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np
from jaxtyping import ArrayLike

_ITERATIONS = 100  # bisection steps: enough to reach adjacent float64 values


def _kl(a: Any, p: Any) -> np.ndarray:
    """$\\mathrm{KL}(a \\| p)$ of Bernoulli laws, elementwise: $0 \\log 0 = 0$, and
    infinite where $a$ puts mass where $p$ puts none."""
    a, p = np.broadcast_arrays(np.asarray(a, np.float64), np.asarray(p, np.float64))
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


def _threshold(p: np.ndarray, t: Any, end: float) -> tuple[np.ndarray, np.ndarray]:
    """The fraction beyond `p`, towards `end` (0 or 1), past which $\\mathrm{KL}$
    exceeds `t`, and whether there is one (else `end`: that side never fails)."""
    p = np.asarray(p, np.float64)
    reachable = _kl(end, p) > t
    beyond = _solve(lambda a: _kl(a, p), p, np.full_like(p, end), t)
    return np.where(reachable, beyond, end), reachable


def _shifts(p: Any, draws: int, c: float, b: float) -> np.ndarray:
    """The detectable shift of $P(U)$ at each `p`: the larger of the two directions'
    (see `detectable_bias`), for the threshold `c` and $b = \\log(1/\\beta)$."""
    p = np.asarray(p, np.float64)
    worst = np.zeros_like(p)
    for end in (1.0, 0.0):
        edge, reachable = _threshold(p, c / draws, end)
        # The true fraction `alt` past the threshold at which the other tail,
        # P(q <= edge) <= exp(-n KL(edge || alt)), is at most beta.
        alt = _solve(lambda a: _kl(edge, a), edge, np.full_like(p, end), b / draws)
        worst = np.maximum(worst, np.abs(np.where(reachable, alt, end) - p))
    return worst


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
    return _shifts(p, draws, math.log(2 * m / alpha), math.log(1 / beta))


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
        `draws_to_detect_bias(0.03 * 0.5, 0.5, elements=1000)`.
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
