r"""Straight-through estimators: a step function forward, a surrogate derivative
backward. The larq catalogue, correct at every boundary, and what it lacks.

Notation in the docstrings: $t$ is the incoming tangent, $[\cdot]$ is 1 where the
condition holds and 0 elsewhere, and $\operatorname{sign}(x)$ is $+1$ for $x \ge 0$
and $-1$ for $x < 0$ (so $\operatorname{sign}(0) = +1$ and outputs are only $\pm 1$).

NaN inputs give NaN values: $\operatorname{sign}(\mathrm{NaN}) = \mathrm{NaN}$, and
every step and quantiser here propagates NaN likewise (a categorical rule makes the
whole row along `axis` NaN), so a NaN is never silently turned into a finite
level. The derivative at NaN is what the formula gives: a mask such as
$[\lvert x \rvert \le c]$ is false there (0), an identity derivative passes $t$, a
smooth surrogate is NaN. At $\pm\infty$ the values are the limits ($\pm 1$, the end
levels) and the derivatives the surrogates' limits (0 outside a clip), except the
softmax derivative of a categorical rule, which is NaN along a row holding $+\infty$
(softmax has no value there) while the value is one-hot.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, ArrayLike, PRNGKeyArray, PyTree

from .._catalogue import (
    BadHyperparameter,
    Domain,
    JVPRule,
    check_axis,
    check_float_array,
    functional,
    partial_jvp,
    validate_positive,
)

_sg = jax.lax.stop_gradient
_NAN, _INF = float("nan"), float("inf")


def _check_number(rule: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise TypeError(f"`{rule}`: `{name}` (={value!r}) must be a real number.")


def _check_clip_value(rule: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    _check_number(rule, "clip_value", value)
    validate_positive(rule, "clip_value", value, allow_zero=True)


def _check_bits(rule: str, bits: Any) -> None:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or bits < 1:
        raise ValueError(f"`{rule}`: `bits` (={bits!r}) must be an integer >= 1.")


def _check_axis(rule: str, axis: Any) -> None:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"`{rule}`: `axis` (={axis!r}) must be an integer.")


def _check_logits(rule: str, axis: int, args: tuple[Any, ...]) -> None:
    check_float_array(rule, args)
    check_axis(rule, axis, jnp.shape(args[0]), "logits")


def _wide(dtype: Any) -> Any:
    # Values of the quantisers are computed in at least float32 and cast back: the
    # nearest level of a bf16 input is then found exactly, and only rounded once.
    return jnp.promote_types(dtype, jnp.float32)


def _inclusive(x: Array, clip_value: float | None) -> Array | None:
    """`[abs(x) <= clip_value]` in `x`'s dtype; `None` (all ones) for no clip."""
    if clip_value is None:
        return None
    return (jnp.abs(x) <= clip_value).astype(x.dtype)


def _masked_identity(x: Array, mask: Array) -> Array:
    """A function whose autodiff derivative is `mask` (boolean), value irrelevant."""
    return jnp.where(mask, x, jnp.zeros_like(x))


class _Elementwise(JVPRule):
    """An elementwise rule whose tangent is `t * slope(x)`, the slope computed in the
    input's dtype. `slope` returning `None` means the identity (`t` passes through)."""

    def slope(self, x: Array) -> Array | None:
        raise NotImplementedError

    def tangent(self, args, t_args, t_self, out, **kwargs):
        (x,) = args
        (t,) = t_args
        if t is None:
            return None
        s = self.slope(x)
        return t if s is None else t * s


_SIGN_DOMAIN = Domain(low=-2.0, high=2.0, kinks=(-1.0, -0.5, 0.0, 0.5, 1.0))


def _sign(x: Array) -> Array:
    return jnp.where(jnp.isnan(x), x, jnp.where(x >= 0, 1, -1).astype(x.dtype))


def _reference_sign(x: Array) -> Array:
    # A NaN fails both comparisons and falls through to itself.
    one = jnp.ones_like(x)
    return jnp.where(x < 0, -one, jnp.where(x >= 0, one, x))


class SteSign(_Elementwise):
    r"""Sign with the straight-through estimator: the workhorse of binarised networks.

    $$q = \operatorname{sign}(x), \qquad
    \dot q = t \cdot [\lvert x \rvert \le c]$$

    with $c$ = `clip_value`, inclusive at $\pm c$ (the `stop_gradient` trick built on
    `jnp.clip` gives half the gradient there). With `clip_value=None` the derivative
    is $t$ everywhere. Note $\operatorname{sign}(0) = +1$: outputs are only $\pm 1$,
    and NaN for a NaN input.

    **Arguments:**

    - `clip_value`: a non-negative number, or `None` for no clipping. Default `1.0`.

    !!! Example

        ```python
        q = eqxrules.SteSign()(jnp.array([-2.0, -1.0, 0.0, 0.5]))  # [-1, -1, 1, 1]
        g = jax.grad(lambda x: eqxrules.ste_sign(x).sum())(jnp.array([1.0, 1.5]))
        # [1, 0]: abs(x) <= 1 passes the gradient, inclusive at the boundary
        ```
    """

    clip_value: float | None = eqx.field(static=True, default=1.0)

    summary: ClassVar[str] = (
        "sign(x) (sign(0) = +1); derivative `t·[|x| <= clip_value]`, inclusive"
    )
    exact: ClassVar[bool] = False
    elementwise: ClassVar[bool] = True
    domain: ClassVar[Domain] = _SIGN_DOMAIN

    def __check_init__(self):
        _check_clip_value("ste_sign", self.clip_value, allow_none=True)

    def primal(self, x: Array) -> Array:
        return _sign(x)

    def slope(self, x: Array) -> Array | None:
        return _inclusive(x, self.clip_value)

    def reference_forward(self, x: Array) -> Array:
        return _reference_sign(x)

    def reference_derivative(self, x: Array) -> Array:
        if self.clip_value is None:
            return x
        return _masked_identity(x, jnp.abs(x) <= self.clip_value)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[SteSign]:
        return [cls(), cls(clip_value=0.5), cls(clip_value=None)]

    @classmethod
    def invalid_hyperparameters(cls, key: PRNGKeyArray) -> Sequence[BadHyperparameter]:
        return [
            BadHyperparameter((), {"clip_value": -1.0}, ValueError, "clip_value", -1.0),
            BadHyperparameter((), {"clip_value": _NAN}, ValueError, "clip_value", _NAN),
            BadHyperparameter((), {"clip_value": "1"}, TypeError, "clip_value", "1"),
            BadHyperparameter((), {"clip_value": True}, TypeError, "clip_value", True),
        ]


@functional(SteSign)
def ste_sign(x: ArrayLike, clip_value: float | None = 1.0) -> Array:
    """Functional form of [`SteSign`][]: `sign(x)` forward (`sign(0) = +1`),
    `t·[abs(x) <= clip_value]` backward (`clip_value=None`: `t`)."""
    return SteSign(clip_value=clip_value)(x)


class ApproxSign(_Elementwise):
    r"""Sign with the piecewise-polynomial derivative of Bi-Real Net (Liu et al.,
    2018): the derivative of a quadratic approximation of the sign.

    $$q = \operatorname{sign}(x), \qquad
    \dot q = t \cdot (2 - 2\lvert x \rvert) \cdot [\lvert x \rvert \le 1]$$

    **Arguments:** none.

    !!! Example

        ```python
        g = jax.vmap(jax.grad(eqxrules.approx_sign))(jnp.array([0.0, 0.5, 1.0]))
        # [2, 1, 0]
        ```
    """

    summary: ClassVar[str] = (
        "sign(x); derivative `t·(2 − 2|x|)·[|x| <= 1]` (Bi-Real Net)"
    )
    exact: ClassVar[bool] = False
    elementwise: ClassVar[bool] = True
    domain: ClassVar[Domain] = Domain(low=-2.0, high=2.0, kinks=(-1.0, 0.0, 1.0))

    def primal(self, x: Array) -> Array:
        return _sign(x)

    def slope(self, x: Array) -> Array:
        a = jnp.abs(x)
        return jnp.where(a <= 1, 2 - 2 * a, jnp.zeros_like(x))

    def reference_forward(self, x: Array) -> Array:
        return _reference_sign(x)

    def reference_derivative(self, x: Array) -> Array:
        # d/dx (2x - x|x|) = 2 - 2|x|. Outside [-1, 1] (NaN and inf included) the
        # polynomial sees 0, so its derivative there is never `0 * inf`.
        u = jnp.where(jnp.abs(x) <= 1, x, jnp.zeros_like(x))
        return 2 * u - u * jnp.abs(u)


@functional(ApproxSign)
def approx_sign(x: ArrayLike) -> Array:
    """Functional form of [`ApproxSign`][]: `sign(x)` forward,
    `t·(2 − 2·abs(x))·[abs(x) <= 1]` backward."""
    return ApproxSign()(x)


class SwishSign(_Elementwise):
    r"""Sign with the derivative of the SignSwish function (Darabi et al., 2018): a
    smooth surrogate whose sharpness is set by $\beta$.

    $$q = \operatorname{sign}(x), \qquad
    \dot q = t \cdot \frac{\beta\,(2 - \beta x \tanh(\beta x / 2))}
    {1 + \cosh(\beta x)}$$

    That is the derivative of $2\sigma(\beta x)(1 + \beta x(1 - \sigma(\beta x))) - 1$.

    **Arguments:**

    - `beta`: a positive number. Default `5.0`.

    !!! Example

        ```python
        g = jax.grad(eqxrules.swish_sign)(jnp.array(0.0))  # beta = 5.0
        ```
    """

    beta: float = eqx.field(static=True, default=5.0)

    summary: ClassVar[str] = (
        "sign(x); derivative `t·β(2 − βx·tanh(βx/2)) / (1 + cosh(βx))` (SignSwish)"
    )
    exact: ClassVar[bool] = False
    elementwise: ClassVar[bool] = True
    domain: ClassVar[Domain] = Domain(low=-2.0, high=2.0, kinks=(0.0,))

    def __check_init__(self):
        _check_number("swish_sign", "beta", self.beta)
        validate_positive("swish_sign", "beta", self.beta, allow_zero=False)

    def primal(self, x: Array) -> Array:
        return _sign(x)

    def slope(self, x: Array) -> Array:
        b = float(self.beta)
        # Clamped to the largest finite number, so that at +-inf the ratio is
        # finite / inf = 0 (its limit), not -inf / inf = NaN.
        big = float(jnp.finfo(x.dtype).max)
        bx = jnp.clip(b * x, -big, big)
        return b * ((2 - bx * jnp.tanh(bx / 2)) / (1 + jnp.cosh(bx)))

    def reference_forward(self, x: Array) -> Array:
        return _reference_sign(x)

    def reference_derivative(self, x: Array) -> Array:
        # In float32 at least: in float16 the derivative is wrong, even in sign, for
        # |x| above about 1.1 (beta = 5). 1 - sigma(y) is sigma(-y), so autodiff
        # neither cancels nor overflows for large |y|. At +-inf, where `y * (1 -
        # sigma(y))` is inf * 0, the derivative is 0 (its limit): `y` is cut from
        # `x` there.
        w = x.astype(_wide(x.dtype))
        y = self.beta * jnp.where(jnp.isinf(w), _sg(w), w)
        s, s_minus = jax.nn.sigmoid(y), jax.nn.sigmoid(-y)
        return (2 * s * (1 + y * s_minus) - 1).astype(x.dtype)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[SwishSign]:
        return [cls(), cls(beta=1.5)]

    @classmethod
    def invalid_hyperparameters(cls, key: PRNGKeyArray) -> Sequence[BadHyperparameter]:
        return [
            BadHyperparameter((), {"beta": 0.0}, ValueError, "beta", 0.0),
            BadHyperparameter((), {"beta": -5.0}, ValueError, "beta", -5.0),
            BadHyperparameter((), {"beta": _INF}, ValueError, "beta", _INF),
            BadHyperparameter((), {"beta": "5"}, TypeError, "beta", "5"),
        ]


@functional(SwishSign)
def swish_sign(x: ArrayLike, beta: float = 5.0) -> Array:
    """Functional form of [`SwishSign`][]: `sign(x)` forward,
    `t·β(2 − βx·tanh(βx/2)) / (1 + cosh(βx))` backward."""
    return SwishSign(beta=beta)(x)


def _magnitude(x: Array) -> Array:
    """`mean(abs(x))` over all axes but the last, kept for broadcasting."""
    return jnp.mean(jnp.abs(x), axis=tuple(range(x.ndim - 1)), keepdims=True)


class MagnitudeAwareSign(JVPRule):
    r"""Sign scaled by the mean magnitude, as in Bi-Real Net's weight binarisation:
    the scale is per output channel (the last axis) and is not differentiated.

    $$\alpha = \operatorname{stop\_gradient}(\operatorname{mean}\lvert x \rvert)
    \text{ over all axes but the last}, \qquad
    q = \alpha \operatorname{sign}(x), \qquad
    \dot q = \alpha \cdot t \cdot [\lvert x \rvert \le c]$$

    A 1-D input has no axis to average over, so $\alpha = \lvert x \rvert$ elementwise
    (as in larq). Not elementwise: takes one floating-point array.

    **Arguments:**

    - `clip_value`: a non-negative number. Default `1.0`.

    !!! Example

        ```python
        w = jnp.array([[0.5, -2.0], [-0.5, 1.0]])
        eqxrules.magnitude_aware_sign(w)  # [[0.5, -1.5], [-0.5, 1.5]]
        ```
    """

    clip_value: float = eqx.field(static=True, default=1.0)

    summary: ClassVar[str] = (
        "stop_gradient(mean |x| over all axes but the last)·sign(x); derivative "
        "that scale·`t·[|x| <= clip_value]`"
    )
    exact: ClassVar[bool] = False
    elementwise: ClassVar[bool] = False
    domain: ClassVar[Domain] = _SIGN_DOMAIN

    def __check_init__(self):
        _check_clip_value("magnitude_aware_sign", self.clip_value)

    def _check_call(self, args: tuple[Any, ...]) -> None:
        check_float_array("magnitude_aware_sign", args)

    def primal(self, x: Array) -> Array:
        # No NaN select: the magnitude is already NaN wherever `x` is.
        return _magnitude(x) * jnp.where(x >= 0, 1, -1).astype(x.dtype)

    def tangent(self, args, t_args, t_self, out, **kwargs):
        (x,) = args
        (t,) = t_args
        if t is None:
            return None
        mask = _inclusive(x, self.clip_value)
        assert mask is not None
        return t * (_magnitude(x) * mask)

    def reference_forward(self, x: Array) -> Array:
        axes = tuple(range(x.ndim - 1))
        scale = jnp.sum(jnp.abs(x), axis=axes, keepdims=True) / math.prod(x.shape[:-1])
        return scale * _reference_sign(x)

    def reference_derivative(self, x: Array) -> Array:
        return _sg(_magnitude(x)) * _masked_identity(x, jnp.abs(x) <= self.clip_value)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[MagnitudeAwareSign]:
        return [cls(), cls(clip_value=0.5)]

    @classmethod
    def invalid_hyperparameters(cls, key: PRNGKeyArray) -> Sequence[BadHyperparameter]:
        return [
            BadHyperparameter((), {"clip_value": -0.5}, ValueError, "clip_value", -0.5),
            BadHyperparameter((), {"clip_value": None}, TypeError, "clip_value", None),
        ]


@functional(MagnitudeAwareSign)
def magnitude_aware_sign(x: ArrayLike, clip_value: float = 1.0) -> Array:
    """Functional form of [`MagnitudeAwareSign`][]: `stop_gradient(mean(abs(x)))`
    (over all axes but the last) `· sign(x)` forward, that scale
    `· t·[abs(x) <= clip_value]` backward."""
    return MagnitudeAwareSign(clip_value=clip_value)(x)


class SteTernary(_Elementwise):
    r"""Ternarisation with the straight-through estimator (Ternary Weight Networks).

    $$q = \begin{cases} +1 & x \ge \theta \\ -1 & x \le -\theta \\ 0 & \text{else}
    \end{cases}, \qquad \dot q = t \cdot [\lvert x \rvert \le c]$$

    with $\theta$ = `threshold_value` and $c$ = `clip_value`, both inclusive. A NaN
    input gives NaN.

    **Arguments:**

    - `threshold_value`: a positive number (at zero, $x = 0$ would be both $+1$ and
        $-1$). Default `0.05`.
    - `clip_value`: a non-negative number. Default `1.0`.

    !!! Example

        ```python
        eqxrules.ste_ternary(jnp.array([-0.05, 0.0, 0.05, 0.3]))  # [-1, 0, 1, 1]
        ```
    """

    threshold_value: float = eqx.field(static=True, default=0.05)
    clip_value: float = eqx.field(static=True, default=1.0)

    summary: ClassVar[str] = (
        "+1 where x >= threshold, −1 where x <= −threshold, else 0; derivative "
        "`t·[|x| <= clip_value]`"
    )
    exact: ClassVar[bool] = False
    elementwise: ClassVar[bool] = True
    domain: ClassVar[Domain] = Domain(
        low=-2.0,
        high=2.0,
        kinks=(-1.5, -1.0, -0.5, -0.05, 0.0, 0.05, 0.5, 1.0, 1.5),
    )

    def __check_init__(self):
        _check_number("ste_ternary", "threshold_value", self.threshold_value)
        validate_positive(
            "ste_ternary", "threshold_value", self.threshold_value, allow_zero=False
        )
        _check_clip_value("ste_ternary", self.clip_value)

    def primal(self, x: Array) -> Array:
        th = self.threshold_value
        q = jnp.where(x >= th, 1, jnp.where(x <= -th, -1, 0)).astype(x.dtype)
        return jnp.where(jnp.isnan(x), x, q)

    def slope(self, x: Array) -> Array | None:
        return _inclusive(x, self.clip_value)

    def reference_forward(self, x: Array) -> Array:
        th = self.threshold_value
        q = (x >= th).astype(x.dtype) - (x <= -th).astype(x.dtype)
        return jnp.where(x == x, q, x)

    def reference_derivative(self, x: Array) -> Array:
        return _masked_identity(x, jnp.abs(x) <= self.clip_value)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[SteTernary]:
        return [cls(), cls(threshold_value=0.5, clip_value=1.5)]

    @classmethod
    def invalid_hyperparameters(cls, key: PRNGKeyArray) -> Sequence[BadHyperparameter]:
        return [
            BadHyperparameter(
                (), {"threshold_value": 0.0}, ValueError, "threshold_value", 0.0
            ),
            BadHyperparameter(
                (), {"threshold_value": -0.1}, ValueError, "threshold_value", -0.1
            ),
            BadHyperparameter(
                (), {"threshold_value": "a"}, TypeError, "threshold_value", "a"
            ),
            BadHyperparameter((), {"clip_value": -1.0}, ValueError, "clip_value", -1.0),
        ]


@functional(SteTernary)
def ste_ternary(
    x: ArrayLike, threshold_value: float = 0.05, clip_value: float = 1.0
) -> Array:
    """Functional form of [`SteTernary`][]: +1 where `x >= threshold_value`, −1 where
    `x <= -threshold_value`, else 0 forward; `t·[abs(x) <= clip_value]` backward."""
    return SteTernary(threshold_value=threshold_value, clip_value=clip_value)(x)


class SteHeaviside(_Elementwise):
    r"""The Heaviside step with the straight-through estimator: binary $\{0, 1\}$
    activations.

    $$q = [x > 0], \qquad \dot q = t \cdot [\lvert x \rvert \le c]$$

    A NaN input gives NaN.

    **Arguments:**

    - `clip_value`: a non-negative number. Default `1.0`.

    !!! Example

        ```python
        eqxrules.ste_heaviside(jnp.array([-1.0, 0.0, 0.5]))  # [0, 0, 1]
        ```
    """

    clip_value: float = eqx.field(static=True, default=1.0)

    summary: ClassVar[str] = "1 where x > 0, else 0; derivative `t·[|x| <= clip_value]`"
    exact: ClassVar[bool] = False
    elementwise: ClassVar[bool] = True
    domain: ClassVar[Domain] = Domain(low=-2.0, high=2.0, kinks=(-1.0, 0.0, 1.0))

    def __check_init__(self):
        _check_clip_value("ste_heaviside", self.clip_value)

    def primal(self, x: Array) -> Array:
        return jnp.where(jnp.isnan(x), x, (x > 0).astype(x.dtype))

    def slope(self, x: Array) -> Array | None:
        return _inclusive(x, self.clip_value)

    def reference_forward(self, x: Array) -> Array:
        return jnp.floor((jnp.sign(x) + 1) / 2)

    def reference_derivative(self, x: Array) -> Array:
        return _masked_identity(x, jnp.abs(x) <= self.clip_value)

    @classmethod
    def invalid_hyperparameters(cls, key: PRNGKeyArray) -> Sequence[BadHyperparameter]:
        return [
            BadHyperparameter((), {"clip_value": -1.0}, ValueError, "clip_value", -1.0),
            BadHyperparameter((), {"clip_value": _INF}, ValueError, "clip_value", _INF),
        ]


@functional(SteHeaviside)
def ste_heaviside(x: ArrayLike, clip_value: float = 1.0) -> Array:
    """Functional form of [`SteHeaviside`][]: `[x > 0]` forward,
    `t·[abs(x) <= clip_value]` backward."""
    return SteHeaviside(clip_value=clip_value)(x)


def _reference_round(x: Array) -> Array:
    # Round half to even, written out: ties go to the even neighbour.
    f = jnp.floor(x)
    d = x - f
    even = jnp.remainder(f, 2) == 0
    return jnp.where(d > 0.5, f + 1, jnp.where(d < 0.5, f, jnp.where(even, f, f + 1)))


class SteRound(_Elementwise):
    r"""Rounding with the identity derivative.

    $$q = \operatorname{round}(x), \qquad \dot q = t$$

    `round` is `jnp.round`: halves go to the even neighbour ($0.5 \to 0$,
    $1.5 \to 2$).

    **Arguments:** none.

    !!! Example

        ```python
        eqxrules.ste_round(jnp.array([0.5, 1.5, 2.2]))  # [0, 2, 2]
        ```
    """

    summary: ClassVar[str] = "`jnp.round(x)` (half to even); derivative `t`"
    exact: ClassVar[bool] = False
    elementwise: ClassVar[bool] = True
    domain: ClassVar[Domain] = Domain(
        low=-2.0, high=2.0, kinks=(-1.5, -0.5, 0.0, 0.5, 1.5)
    )

    def primal(self, x: Array) -> Array:
        return jnp.round(x)

    def slope(self, x: Array) -> None:
        return None

    def reference_forward(self, x: Array) -> Array:
        return _reference_round(x)

    def reference_derivative(self, x: Array) -> Array:
        return x


@functional(SteRound)
def ste_round(x: ArrayLike) -> Array:
    """Functional form of [`SteRound`][]: `jnp.round(x)` (half to even) forward, `t`
    backward."""
    return SteRound()(x)


class SteQuantize(_Elementwise):
    r"""Uniform quantisation onto $2^b$ levels from `lo` to `hi`, with the
    straight-through estimator inside the range.

    $$n = 2^b - 1, \qquad
    q = \mathrm{lo} + (\mathrm{hi} - \mathrm{lo}) \cdot
    \frac{\operatorname{round}\!\big(n\,(\operatorname{clip}(x, \mathrm{lo},
    \mathrm{hi}) - \mathrm{lo}) / (\mathrm{hi} - \mathrm{lo})\big)}{n}, \qquad
    \dot q = t \cdot [\mathrm{lo} \le x \le \mathrm{hi}]$$

    `round` goes half to even. The value is computed in at least float32 and cast to
    the input's dtype.

    **Arguments:**

    - `bits`: an integer $b \ge 1$. Default `8`.
    - `lo`, `hi`: the lowest and highest level, `lo < hi`. Default `-1.0`, `1.0`.

    !!! Example

        ```python
        eqxrules.ste_quantize(jnp.array([-2.0, 0.1, 0.4]), bits=2)  # [-1, 1/3, 1/3]
        ```
    """

    bits: int = eqx.field(static=True, default=8)
    lo: float = eqx.field(static=True, default=-1.0)
    hi: float = eqx.field(static=True, default=1.0)

    summary: ClassVar[str] = (
        "uniform quantisation of clip(x, lo, hi) onto 2^bits levels; derivative "
        "`t·[lo <= x <= hi]`"
    )
    exact: ClassVar[bool] = False
    elementwise: ClassVar[bool] = True
    domain: ClassVar[Domain] = Domain(
        low=-2.0, high=2.0, kinks=(-1.0, -0.5, 0.0, 0.5, 1.0, 1.5)
    )

    def __check_init__(self):
        _check_bits("ste_quantize", self.bits)
        _check_number("ste_quantize", "lo", self.lo)
        _check_number("ste_quantize", "hi", self.hi)
        if not (math.isfinite(self.lo) and math.isfinite(self.hi)):
            raise ValueError(
                f"`ste_quantize`: `lo` (={self.lo!r}) and `hi` (={self.hi!r}) must be "
                "finite."
            )
        if not self.lo < self.hi:
            raise ValueError(
                f"`ste_quantize`: `lo` (={self.lo!r}) must be less than `hi` "
                f"(={self.hi!r})."
            )

    def primal(self, x: Array) -> Array:
        lo, hi, n = float(self.lo), float(self.hi), 2**self.bits - 1
        u = jnp.clip(x.astype(_wide(x.dtype)), lo, hi)
        k = jnp.round((u - lo) * (n / (hi - lo)))
        return (lo + (hi - lo) * (k / n)).astype(x.dtype)

    def slope(self, x: Array) -> Array:
        return ((x >= self.lo) & (x <= self.hi)).astype(x.dtype)

    def reference_forward(self, x: Array) -> Array:
        lo, hi, n = float(self.lo), float(self.hi), 2**self.bits - 1
        w = x.astype(_wide(x.dtype))
        u = jnp.where(w < lo, lo, jnp.where(w > hi, hi, w))
        k = _reference_round((u - lo) * (n / (hi - lo)))
        return (lo + (hi - lo) * (k / n)).astype(x.dtype)

    def reference_derivative(self, x: Array) -> Array:
        return _masked_identity(x, (x >= self.lo) & (x <= self.hi))

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[SteQuantize]:
        return [cls(), cls(bits=2, lo=-0.5, hi=1.5)]

    @classmethod
    def invalid_hyperparameters(cls, key: PRNGKeyArray) -> Sequence[BadHyperparameter]:
        return [
            BadHyperparameter((), {"bits": 0}, ValueError, "bits", 0),
            BadHyperparameter((), {"bits": 2.5}, ValueError, "bits", 2.5),
            BadHyperparameter((), {"bits": True}, ValueError, "bits", True),
            BadHyperparameter((), {"lo": 1.0, "hi": 1.0}, ValueError, "lo", 1.0),
            BadHyperparameter((), {"lo": 2.0, "hi": 1.0}, ValueError, "hi", 1.0),
            BadHyperparameter((), {"lo": _NAN}, ValueError, "lo", _NAN),
            BadHyperparameter((), {"hi": _INF}, ValueError, "hi", _INF),
            BadHyperparameter((), {"lo": "a"}, TypeError, "lo", "a"),
        ]


@functional(SteQuantize)
def ste_quantize(
    x: ArrayLike, bits: int = 8, lo: float = -1.0, hi: float = 1.0
) -> Array:
    """Functional form of [`SteQuantize`][]: uniform quantisation of
    `clip(x, lo, hi)` onto `2**bits` levels from `lo` to `hi` forward,
    `t·[lo <= x <= hi]` backward."""
    return SteQuantize(bits=bits, lo=lo, hi=hi)(x)


class DoReFa(_Elementwise):
    r"""The DoReFa-Net quantiser (Zhou et al., 2016): $2^b$ levels on $[0, 1]$.

    $$n = 2^b - 1, \qquad q = \operatorname{round}(n \operatorname{clip}(x, 0, 1)) / n,
    \qquad \dot q = t \cdot [0 \le x \le 1]$$

    `round` goes half to even. The value is computed in at least float32 and cast to
    the input's dtype.

    **Arguments:**

    - `bits`: an integer $b \ge 1$. Default `2`.

    !!! Example

        ```python
        eqxrules.dorefa_quantize(jnp.array([-0.5, 0.4, 2.0]))  # [0, 1/3, 1]
        ```
    """

    bits: int = eqx.field(static=True, default=2)

    summary: ClassVar[str] = (
        "round(clip(x, 0, 1)·n)/n with n = 2^bits − 1; derivative `t·[0 <= x <= 1]`"
    )
    exact: ClassVar[bool] = False
    elementwise: ClassVar[bool] = True
    domain: ClassVar[Domain] = Domain(low=-1.0, high=2.0, kinks=(0.0, 0.5, 1.0))

    def __check_init__(self):
        _check_bits("dorefa_quantize", self.bits)

    def primal(self, x: Array) -> Array:
        n = 2**self.bits - 1
        u = jnp.clip(x.astype(_wide(x.dtype)), 0, 1)
        return (jnp.round(u * n) / n).astype(x.dtype)

    def slope(self, x: Array) -> Array:
        return ((x >= 0) & (x <= 1)).astype(x.dtype)

    def reference_forward(self, x: Array) -> Array:
        n = 2**self.bits - 1
        w = x.astype(_wide(x.dtype))
        u = jnp.where(w < 0, 0.0, jnp.where(w > 1, 1.0, w))
        return (_reference_round(u * n) / n).astype(x.dtype)

    def reference_derivative(self, x: Array) -> Array:
        return _masked_identity(x, (x >= 0) & (x <= 1))

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[DoReFa]:
        return [cls(), cls(bits=1)]

    @classmethod
    def invalid_hyperparameters(cls, key: PRNGKeyArray) -> Sequence[BadHyperparameter]:
        return [
            BadHyperparameter((), {"bits": 0}, ValueError, "bits", 0),
            BadHyperparameter((), {"bits": "2"}, ValueError, "bits", "2"),
        ]


@functional(DoReFa)
def dorefa_quantize(x: ArrayLike, bits: int = 2) -> Array:
    """Functional form of [`DoReFa`][]: `round(clip(x, 0, 1)·n)/n` with
    `n = 2**bits − 1` forward, `t·[0 <= x <= 1]` backward."""
    return DoReFa(bits=bits)(x)


class StochasticRound(_Elementwise):
    r"""Stochastic rounding, unbiased, with the identity derivative. Called as
    `m(x, key=key)`.

    $$q = \lfloor x + u \rfloor,\ u \sim U[0, 1), \qquad
    \mathbb{E}[q] = x, \qquad \dot q = t$$

    The value is computed in at least float32 and cast to the input's dtype.

    **Arguments:** none. At call: `key`, a PRNG key.

    !!! Example

        ```python
        q = eqxrules.stochastic_round(jnp.full(1000, 0.25), jax.random.key(0))
        q.mean()  # about 0.25
        ```
    """

    summary: ClassVar[str] = "floor(x + u), u ~ U[0, 1) (so E[q] = x); derivative `t`"
    exact: ClassVar[bool] = False
    elementwise: ClassVar[bool] = True
    domain: ClassVar[Domain] = Domain(low=-2.0, high=2.0, kinks=(-1.0, 0.0, 1.0))

    def primal(self, x: Array, *, key: PRNGKeyArray) -> Array:
        wide = _wide(x.dtype)
        u = jax.random.uniform(key, x.shape, wide)
        return jnp.floor(x.astype(wide) + u).astype(x.dtype)

    def slope(self, x: Array) -> None:
        return None

    def reference_forward(self, x: Array, *, key: PRNGKeyArray) -> Array:
        wide = _wide(x.dtype)
        w = x.astype(wide) + jax.random.uniform(key, x.shape, wide)
        c = jnp.ceil(w)
        return jnp.where(c == w, c, c - 1).astype(x.dtype)

    def reference_derivative(self, x: Array, *, key: PRNGKeyArray) -> Array:
        return x

    def call_kwargs(self, key: PRNGKeyArray) -> dict[str, Any]:
        return {"key": key}


@functional(StochasticRound)
def stochastic_round(x: ArrayLike, key: PRNGKeyArray) -> Array:
    """Functional form of [`StochasticRound`][]: `floor(x + u)`, `u ~ U[0, 1)`
    forward (unbiased), `t` backward."""
    return StochasticRound()(x, key=key)


class _Shown:
    def __init__(self, leaf: jax.ShapeDtypeStruct):
        self.text = f"{leaf.dtype}{list(leaf.shape)}"

    def __repr__(self) -> str:
        return self.text


def _describe(tree: PyTree[jax.ShapeDtypeStruct]) -> str:
    """`float32[4, 3]`, or a pytree of those, for error messages."""
    return repr(jtu.tree_map(_Shown, tree))


def _heaviside(x: Array) -> Array:
    return (x > 0).astype(x.dtype)


def _identity(x: Array) -> Array:
    return x


class StraightThrough(JVPRule):
    r"""Any straight-through estimator: the value of `forward`, the derivative of
    `surrogate`.

    $$q = \mathrm{forward}(x), \qquad \dot q = \partial\,\mathrm{surrogate}(x)\, t$$

    Unlike `surrogate(x) + stop_gradient(forward(x) - surrogate(x))`, the value is
    exactly `forward(x)`, and `surrogate` is only differentiated, never added.

    If `surrogate` is an `eqx.Module`, its parameters get their true derivatives.
    `forward`'s parameters are treated as constants: its derivative is replaced
    entirely by the surrogate's.

    **Arguments:**

    - `forward`: a callable giving the value.
    - `surrogate`: a callable whose derivative is used. At call, its output must have
        the same pytree structure, shapes and dtypes as `forward`'s, else a
        `ValueError` names both.

    !!! Example

        ```python
        ste = eqxrules.StraightThrough(jnp.floor, jax.nn.softplus)
        jax.grad(ste)(jnp.array(0.0))  # sigmoid(0) = 0.5
        ```
    """

    forward: Callable[[Array], PyTree[Array]]
    surrogate: Callable[[Array], PyTree[Array]]

    summary: ClassVar[str] = (
        "`forward(x)`; derivative that of `surrogate` at x (shapes and dtypes must "
        "match)"
    )
    exact: ClassVar[bool] = False
    elementwise: ClassVar[bool] = True
    domain: ClassVar[Domain] = Domain(low=-2.0, high=2.0, kinks=(0.0,))

    def __check_init__(self):
        for name in ("forward", "surrogate"):
            value = getattr(self, name)
            if not callable(value):
                raise TypeError(
                    f"`straight_through`: `{name}` (={value!r}) must be callable."
                )

    def _check_call(self, args: tuple[Any, ...]) -> None:
        super()._check_call(args)
        f = jax.eval_shape(self.forward, args[0])
        s = jax.eval_shape(self.surrogate, args[0])
        if jtu.tree_structure(f) != jtu.tree_structure(s) or any(
            (a.shape, a.dtype) != (b.shape, b.dtype)
            for a, b in zip(jtu.tree_leaves(f), jtu.tree_leaves(s))
        ):
            raise ValueError(
                f"`straight_through`: `forward` gives {_describe(f)} but `surrogate` "
                f"gives {_describe(s)}; their shapes and dtypes must match."
            )

    def primal(self, x: Array) -> PyTree[Array]:
        return self.forward(x)

    def tangent(self, args, t_args, t_self, out, **kwargs):
        (x,) = args
        (t_x,) = t_args
        return partial_jvp(
            lambda s, x: s(x), (self.surrogate, x), (t_self.surrogate, t_x)
        )

    def reference_forward(self, x: Array) -> PyTree[Array]:
        return self.forward(x)

    def reference_derivative(self, x: Array) -> PyTree[Array]:
        return self.surrogate(x)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[StraightThrough]:
        return [cls(_heaviside, jax.nn.sigmoid), cls(jnp.floor, _identity)]

    @classmethod
    def invalid_hyperparameters(cls, key: PRNGKeyArray) -> Sequence[BadHyperparameter]:
        return [
            BadHyperparameter((3, jnp.tanh), {}, TypeError, "forward", 3),
            BadHyperparameter((jnp.sign, "x"), {}, TypeError, "surrogate", "x"),
        ]


@functional(StraightThrough)
def straight_through(
    x: ArrayLike,
    *,
    forward: Callable[[Array], PyTree[Array]],
    surrogate: Callable[[Array], PyTree[Array]],
) -> PyTree[Array]:
    """Functional form of [`StraightThrough`][]: `forward(x)` forward, the
    derivative of `surrogate` at `x` backward."""
    return StraightThrough(forward, surrogate)(x)


def _first_max(z: Array, axis: int) -> Array:
    """One-hot of the first maximum along `axis`, without `argmax`; a row holding a
    NaN is NaN."""
    m = jnp.max(z, axis=axis, keepdims=True)
    is_max = z == m
    one_hot = (is_max & (jnp.cumsum(is_max, axis=axis) == 1)).astype(z.dtype)
    return jnp.where(m == m, one_hot, m)


def _reference_softmax(z: Array, axis: int) -> Array:
    e = jnp.exp(z - _sg(jnp.max(z, axis=axis, keepdims=True)))
    return e / jnp.sum(e, axis=axis, keepdims=True)


def _one_hot_argmax(z: Array, axis: int, dtype: Any) -> Array:
    """One-hot of `argmax(z)` along `axis`, in `dtype`; a row holding a NaN is NaN
    (`argmax` would point at the NaN as if it were the maximum)."""
    axis = axis % z.ndim
    one_hot = jax.nn.one_hot(
        jnp.argmax(z, axis=axis), z.shape[axis], dtype=dtype, axis=axis
    )
    m = jnp.max(z, axis=axis, keepdims=True).astype(dtype)
    return jnp.where(jnp.isnan(m), m, one_hot)


class StraightThroughOneHot(JVPRule):
    r"""A categorical choice with the softmax derivative: the straight-through
    estimator for discrete latent variables (Bengio et al., 2013).

    $$q = \operatorname{one\_hot}(\operatorname{argmax}(\ell)), \qquad
    \dot q = \partial \operatorname{softmax}(\ell)\, t
    = s \odot (t - \langle s, t \rangle), \quad s = \operatorname{softmax}(\ell)$$

    along `axis`. Ties go to the first maximum; a NaN anywhere along `axis` makes
    that whole row of the value NaN. Not elementwise: takes one floating-point array
    of logits, with at least one axis (`axis` must be in range, else a `ValueError`).

    **Arguments:**

    - `axis`: the axis of the categories. Default `-1`.

    !!! Example

        ```python
        eqxrules.straight_through_onehot(jnp.array([0.1, 2.0, -1.0]))  # [0, 1, 0]
        ```
    """

    axis: int = eqx.field(static=True, default=-1)

    summary: ClassVar[str] = (
        "one_hot(argmax(logits)); derivative that of softmax(logits)"
    )
    exact: ClassVar[bool] = False
    elementwise: ClassVar[bool] = False
    domain: ClassVar[Domain] = Domain(low=-2.0, high=2.0)

    def __check_init__(self):
        _check_axis("straight_through_onehot", self.axis)

    def _check_call(self, args: tuple[Any, ...]) -> None:
        _check_logits("straight_through_onehot", self.axis, args)

    def primal(self, logits: Array) -> Array:
        return _one_hot_argmax(logits, self.axis, logits.dtype)

    def tangent(self, args, t_args, t_self, out, **kwargs):
        return partial_jvp(lambda z: jax.nn.softmax(z, axis=self.axis), args, t_args)

    def reference_forward(self, logits: Array) -> Array:
        return _first_max(logits, self.axis)

    def reference_derivative(self, logits: Array) -> Array:
        return _reference_softmax(logits, self.axis)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[StraightThroughOneHot]:
        return [cls(), cls(axis=0)]

    @classmethod
    def invalid_hyperparameters(cls, key: PRNGKeyArray) -> Sequence[BadHyperparameter]:
        return [
            BadHyperparameter((), {"axis": 1.5}, TypeError, "axis", 1.5),
            BadHyperparameter((), {"axis": True}, TypeError, "axis", True),
        ]


@functional(StraightThroughOneHot)
def straight_through_onehot(logits: ArrayLike, axis: int = -1) -> Array:
    """Functional form of [`StraightThroughOneHot`][]: `one_hot(argmax(logits))`
    forward, the derivative of `softmax(logits)` backward."""
    return StraightThroughOneHot(axis=axis)(logits)


class GumbelSoftmax(JVPRule):
    r"""A sample from the categorical distribution with the given logits, by the
    Gumbel-max trick, differentiated through the Gumbel-softmax relaxation (Jang et
    al., 2017; Maddison et al., 2017). Called as `m(logits, key=key)`.

    With $g$ i.i.d. standard Gumbel noise and the soft sample
    $y = \operatorname{softmax}((\ell + g) / \tau)$ along `axis`:

    $$q = \begin{cases} \operatorname{one\_hot}(\operatorname{argmax}(\ell + g)) &
    \text{hard} \\ y & \text{soft} \end{cases}, \qquad
    \dot q = \partial y\, t = y \odot (t - \langle y, t \rangle) / \tau$$

    With `hard=False` the derivative is exact. Finite for any finite logits (±1e4
    included): the noise is bounded and the softmax is computed stably, in at least
    float32, and cast to the logits' dtype. A NaN anywhere along `axis` makes that
    whole row of the value NaN.

    **Arguments:**

    - `tau`: the temperature, positive. Default `1.0`.
    - `hard`: a one-hot forward (`True`) or the soft sample (`False`). Default `True`.
    - `axis`: the axis of the categories. Default `-1`.

    At call: `key`, a PRNG key.

    !!! Example

        ```python
        z = eqxrules.gumbel_softmax(jnp.array([1.0, 2.0, 0.5]), jax.random.key(0))
        # a one-hot vector; its derivative is that of the soft sample
        ```
    """

    tau: float = eqx.field(static=True, default=1.0)
    hard: bool = eqx.field(static=True, default=True)
    axis: int = eqx.field(static=True, default=-1)

    summary: ClassVar[str] = (
        "hard: one-hot of the Gumbel-perturbed argmax, soft: softmax((logits + g)/τ);"
        " derivative that of the soft sample"
    )
    exact: ClassVar[bool] = False
    elementwise: ClassVar[bool] = False
    domain: ClassVar[Domain] = Domain(low=-2.0, high=2.0)

    def __check_init__(self):
        _check_number("gumbel_softmax", "tau", self.tau)
        validate_positive("gumbel_softmax", "tau", self.tau, allow_zero=False)
        if not isinstance(self.hard, (bool, np.bool_)):
            raise TypeError(
                f"`gumbel_softmax`: `hard` (={self.hard!r}) must be a bool."
            )
        _check_axis("gumbel_softmax", self.axis)

    def is_exact(self) -> bool:
        return not self.hard

    def _check_call(self, args: tuple[Any, ...]) -> None:
        _check_logits("gumbel_softmax", self.axis, args)

    def _perturbed(self, logits: Array, key: PRNGKeyArray) -> Array:
        wide = _wide(logits.dtype)
        return logits.astype(wide) + jax.random.gumbel(key, logits.shape, wide)

    def _soft(self, logits: Array, key: PRNGKeyArray) -> Array:
        z = self._perturbed(logits, key) / self.tau
        return jax.nn.softmax(z, axis=self.axis).astype(logits.dtype)

    def primal(self, logits: Array, *, key: PRNGKeyArray) -> Array:
        if self.hard:
            return _one_hot_argmax(
                self._perturbed(logits, key), self.axis, logits.dtype
            )
        return self._soft(logits, key)

    def tangent(self, args, t_args, t_self, out, *, key, **kwargs):
        return partial_jvp(lambda z: self._soft(z, key), args, t_args)

    def reference_forward(self, logits: Array, *, key: PRNGKeyArray) -> Array:
        wide = _wide(logits.dtype)
        z = logits.astype(wide) + jax.random.gumbel(key, logits.shape, wide)
        if self.hard:
            return _first_max(z, self.axis).astype(logits.dtype)
        return _reference_softmax(z / self.tau, self.axis).astype(logits.dtype)

    def reference_derivative(self, logits: Array, *, key: PRNGKeyArray) -> Array:
        wide = _wide(logits.dtype)
        z = logits.astype(wide) + jax.random.gumbel(key, logits.shape, wide)
        return _reference_softmax(z / self.tau, self.axis).astype(logits.dtype)

    def call_kwargs(self, key: PRNGKeyArray) -> dict[str, Any]:
        return {"key": key}

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[GumbelSoftmax]:
        return [cls(), cls(tau=0.5, hard=False, axis=0)]

    @classmethod
    def invalid_hyperparameters(cls, key: PRNGKeyArray) -> Sequence[BadHyperparameter]:
        return [
            BadHyperparameter((), {"tau": 0.0}, ValueError, "tau", 0.0),
            BadHyperparameter((), {"tau": -1.0}, ValueError, "tau", -1.0),
            BadHyperparameter((), {"tau": _INF}, ValueError, "tau", _INF),
            BadHyperparameter((), {"hard": "yes"}, TypeError, "hard", "yes"),
            BadHyperparameter((), {"axis": 0.5}, TypeError, "axis", 0.5),
        ]


@functional(GumbelSoftmax)
def gumbel_softmax(
    logits: ArrayLike,
    key: PRNGKeyArray,
    tau: float = 1.0,
    hard: bool = True,
    axis: int = -1,
) -> Array:
    """Functional form of [`GumbelSoftmax`][]: a Gumbel-max categorical sample
    (one-hot if `hard`, else the soft sample `softmax((logits + g)/tau)`) forward,
    the derivative of the soft sample backward."""
    return GumbelSoftmax(tau=tau, hard=hard, axis=axis)(logits, key=key)
