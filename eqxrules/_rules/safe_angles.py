r"""The NaN-safe angles: [`SafeArccos`][] and [`SafeArcsin`][] (one implementation),
and [`SafeAtan2`][]. What the NaN-safe rules share is in `_safe`."""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._catalogue import Domain, JVPRule
from .._domain import Inputs
from ._safe import (
    _Safe,
    check_inputs,
    safe_inverse,
    wide,
    widened,
    zeros,
)

_PLAIN = {"arccos": jnp.arccos, "arcsin": jnp.arcsin}

# Where |x| exceeds 1 by at most this many epsilons (of its dtype), `arccos` and
# `arcsin` take x as ±1: the rounding error of a cosine computed as the dot product
# of unit vectors (measured in float32: within 3 eps of 1 for `u @ u` with
# `u = v / jnp.linalg.norm(v)`, n from 3 to 1024).
_ROUNDING_ULPS = 4


def _unit_interval(x: Array) -> tuple[Array, Array, Array]:
    """`(w, inside, edge)`: `x` in float32 (at least), `|x| < 1`, and `|x|` within
    rounding of 1 (`1 <= |x| <= 1 + 4 eps`). Neither holds beyond, nor at NaN."""
    x = jnp.asarray(x)  # under `grad`, a Python float arrives as `TypedFloat`
    w = x.astype(wide(x.dtype))
    a = jnp.abs(w)
    band = 1 + _ROUNDING_ULPS * float(jnp.finfo(x.dtype).eps)  # exact in `w`
    return w, a < 1, (a >= 1) & (a <= band)


def _arc_slope(x: Array) -> Array:
    r"""$1/\sqrt{1 - x^2}$ inside, 0 at $\pm 1$ (and within rounding of them), NaN
    beyond or at NaN. $(1 - x)(1 + x)$ is exact-ish near $\pm 1$, where
    $1 - x^2$ cancels."""
    w, _, edge = _unit_interval(x)
    # At the edges `rsqrt` is fed inf: its value there is exactly 0 and so is its
    # derivative, `-u^(-3/2)/2` (one select, where feeding 0 and selecting the
    # inf away would leave `0 · inf = NaN` in reverse over reverse). Beyond them,
    # or at NaN, `rsqrt` of a negative keeps its NaN, in this slope and in its
    # own derivative.
    u = jnp.where(edge, jnp.inf, (1 - w) * (1 + w))
    return jax.lax.rsqrt(u).astype(jnp.result_type(x))


def _reference_arc(x: Array, kind: str, *, derivative: bool) -> Array:
    r"""`arccos` or `arcsin` (`kind`) with the value `jnp.arccos` or `jnp.arcsin`
    gives on $x$ clamped within rounding of $\pm 1$; with `derivative`, a function
    whose plain derivative is the rule's: $\arccos x = 2 \operatorname{atan2}(
    \sqrt{1 - x}, \sqrt{1 + x})$ and $\arcsin x = \operatorname{atan2}(x,
    \sqrt{(1 - x)(1 + x)})$ inside, a constant at the edges, NaN beyond."""
    w, inside, edge = _unit_interval(x)
    beyond = ~(inside | edge)
    plain = _PLAIN[kind]
    if derivative:
        s = jnp.where(inside, w, 0)
        if kind == "arccos":
            value = 2 * jnp.arctan2(jnp.sqrt(1 - s), jnp.sqrt(1 + s))
        else:
            value = jnp.arctan2(s, jnp.sqrt((1 - s) * (1 + s)))
    else:
        value = plain(jnp.clip(w, -1, 1))
    ends = plain(jnp.sign(w)) + 0 * w
    nan = plain(jnp.where(beyond, w, 0))
    return jnp.where(inside, value, jnp.where(edge, ends, nan)).astype(x.dtype)


class _Arc(_Safe):
    """`arccos` or `arcsin` (`kind`), one implementation: the value at `x` taken as
    ±1 within rounding of ±1, and the slope `∓1/√((1 − x)(1 + x))`, 0 there."""

    _kind: ClassVar[str]
    domain: ClassVar[Domain] = Domain(low=-1.0, high=1.0, kinks=(-1.0, 1.0))

    def primal(self, x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        w, _, edge = _unit_interval(x)
        # Within rounding of ±1, exactly ±1 (`sign`); elsewhere `x` itself.
        return _PLAIN[self._kind](jnp.where(edge, jnp.sign(w), w)).astype(x.dtype)

    def slope(self, x: Array) -> Array:
        slope = _arc_slope(x)
        return -slope if self._kind == "arccos" else slope

    def reference_forward(self, x: Array) -> Array:
        return _reference_arc(x, self._kind, derivative=False)

    def reference_derivative(self, x: Array) -> Array:
        return _reference_arc(x, self._kind, derivative=True)


class SafeArccos(_Arc):
    r"""`arccos`, whose derivative at $\pm 1$ is 0 instead of $-\infty$: the angle
    between unit vectors $u, v$ as `safe_arccos(u @ v)`.

    $$y = \arccos x, \qquad \dot y = \begin{cases} -t / \sqrt{1 - x^2} &
    \lvert x \rvert < 1 \\ 0 & \lvert x \rvert = 1 \end{cases}$$

    At $x = 1$ the value is exactly 0 and at $x = -1$ it is $\pi$ (rounded to the
    dtype); the derivative is 0 in both modes, and so is every higher derivative.
    Why 0: as a function of the vectors, the angle $\arccos(u \cdot v)$ has a
    cone-shaped minimum at $u = v$ (and maximum at $u = -v$), whose minimum-norm
    subgradient is 0, as [`SafeNorm`][]'s at 0; near $1$,
    $\arccos x \approx \sqrt{2(1 - x)}$ and 0 is [`SafeSqrt`][]'s convention; and
    it is finite in every dtype.

    Beyond $\pm 1$: a cosine computed from unit vectors rounds past 1, and the
    plain `jnp.arccos` then gives NaN. Within 4 epsilons of the input's dtype
    ($\lvert x \rvert \le 1 + 4\varepsilon$) the input is taken as $\pm 1$ (value 0
    or $\pi$, derivative 0). Farther beyond, value and derivative are NaN, as
    `jnp.arccos`: such an input is no cosine (vectors that were not normalised),
    and a clamp would hide that. Clamp explicitly where it is intended:
    `safe_arccos(jnp.clip(c, -1, 1))`.

    Inside, the value is `jnp.arccos`'s; the derivative is computed as
    $-1/\sqrt{(1 - x)(1 + x)}$, which does not cancel near $\pm 1$ (where
    $1 - x^2$ rounded in float32 is up to $3 \times 10^{-5}$ off, relatively,
    within 1000 epsilons of 1).

    !!! Example

        ```python
        u = jnp.array([0.6, 0.8])
        jax.grad(lambda u: eqxrules.safe_arccos(u @ u))(u)  # [0, 0], not NaN
        ```
    """

    summary: ClassVar[str] = (
        "arccos(x); derivative `−t/√(1 − x²)`, 0 at |x| = 1; "
        "|x| <= 1 + 4ε taken as ±1, NaN beyond"
    )
    _kind: ClassVar[str] = "arccos"


class SafeArcsin(_Arc):
    r"""`arcsin`, whose derivative at $\pm 1$ is 0 instead of $+\infty$.

    $$y = \arcsin x, \qquad \dot y = \begin{cases} t / \sqrt{1 - x^2} &
    \lvert x \rvert < 1 \\ 0 & \lvert x \rvert = 1 \end{cases}$$

    At $x = \pm 1$ the value is exactly $\pm\pi/2$ (rounded to the dtype) and every
    derivative is 0, in both modes: [`SafeArccos`][]'s convention, since
    $\arcsin x = \pi/2 - \arccos x$. As there, $\lvert x \rvert \le 1 +
    4\varepsilon$ (the input dtype's epsilon) is taken as $\pm 1$, and farther
    beyond value and derivative are NaN, as `jnp.arcsin`.

    !!! Example

        ```python
        jax.grad(eqxrules.safe_arcsin)(1.0)  # 0.0, where jax.grad(jnp.arcsin) is inf
        ```
    """

    summary: ClassVar[str] = (
        "arcsin(x); derivative `t/√(1 − x²)`, 0 at |x| = 1; "
        "|x| <= 1 + 4ε taken as ±1, NaN beyond"
    )
    _kind: ClassVar[str] = "arcsin"


class SafeAtan2(JVPRule):
    r"""`arctan2(y, x)`, the angle of the point $(x, y)$, whose derivative at the
    origin is 0 instead of NaN.

    $$\theta = \operatorname{atan2}(y, x), \qquad \dot\theta = \begin{cases}
    (x\,\dot y - y\,\dot x) / (x^2 + y^2) & (x, y) \neq (0, 0) \\
    0 & (x, y) = (0, 0) \end{cases}$$

    with `y` and `x` broadcast together. The value is `jnp.arctan2`'s everywhere,
    the origin included (where it is 0 or $\pm\pi$ by the signs of the zeros, as
    IEEE says). At the origin ($-0.0$ counts as zero) every derivative, of every
    order, in both modes, is 0: the angle has no limit there, and 0 is the
    minimum-norm subgradient convention of [`SafeNorm`][] (the norm and the angle
    of a 2-D vector both meet the origin). The plain `jnp.arctan2` gives NaN
    there (JAX #1052).

    Elsewhere the derivative is JAX's, computed as JAX's is from $x^2 + y^2$:
    for points nearer the origin than about `1e-19` in float32 (other than the
    origin itself) that square underflows and the derivative is infinite, as
    JAX's; beyond about `1e19` it overflows and the derivative is 0 (the true
    one is below `1e-19` there). Dividing by $\lvert x \rvert + \lvert y
    \rvert$ first would keep it right at every scale, at about 1.15 times the
    flops of the hand-written double where (measured), which the rule must not
    exceed. A NaN in `x` or `y` makes its element NaN, value and derivatives,
    and no other.

    The dtype is that of `y` and `x` together (`jnp.result_type`); bfloat16 and
    float16 are computed in float32 and cast back.

    !!! Example

        ```python
        jax.grad(eqxrules.safe_atan2, (0, 1))(0.0, 0.0)  # (0, 0), not (NaN, NaN)
        ```
    """

    elementwise: ClassVar[bool] = False
    exact: ClassVar[bool] = True
    domain: ClassVar[Any] = Inputs(y=Domain(kinks=(0.0,)), x=Domain(kinks=(0.0,)))

    summary: ClassVar[str] = (
        "atan2(y, x); derivative `(x ẏ − y ẋ)/(x² + y²)`, 0 at the origin"
    )

    def _check_call(self, args: tuple[Any, ...]) -> None:
        check_inputs(self.rule_name(), args, {"y": "float", "x": "float"})

    def primal(self, y: Float[Array, "*y"], x: Float[Array, "*x"]) -> Array:
        dtype, (wy, wx) = widened(y, x)
        return jnp.arctan2(wy, wx).astype(dtype)

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        **kwargs: Any,
    ) -> Any:
        (y, x), (t_y, t_x) = args, t_args
        if t_y is None and t_x is None:
            return None
        w = wide(out.dtype)
        wy, wx = jnp.asarray(y, w), jnp.asarray(x, w)
        # `1/(x² + y²)`, 0 at the origin, where the sum of squares is fed 1: no
        # `1/0` in this or in its own derivative (second order). Where it is 0
        # (the origin, and a point at infinity) the tangent is selected to 0, not
        # multiplied (one select for both inputs): an inf or NaN tangent there
        # gives 0.
        origin = (wx == 0) & (wy == 0)
        k = safe_inverse(wx * wx + wy * wy, origin)
        num = jnp.zeros(out.shape, w)
        if t_y is not None:
            num = num + wx * t_y.astype(w)
        if t_x is not None:
            num = num - wy * t_x.astype(w)
        return jnp.where(k == 0, zeros(num), num * k).astype(out.dtype)

    def reference_forward(self, y: Array, x: Array) -> Array:
        dtype, (wy, wx) = widened(y, x)
        return jnp.arctan2(wy, wx).astype(dtype)

    def reference_derivative(self, y: Array, x: Array) -> Array:
        """The double where around `jnp.arctan2`: the origin fed `(0, 1)` and
        selected away; its plain derivative is the rule's."""
        dtype, (wy, wx) = widened(y, x)
        origin = (wx == 0) & (wy == 0)
        angle = jnp.arctan2(jnp.where(origin, 0, wy), jnp.where(origin, 1, wx))
        at_origin = jax.lax.stop_gradient(jnp.arctan2(wy, wx))  # ±0 or ±π
        return jnp.where(origin, at_origin, angle).astype(dtype)
