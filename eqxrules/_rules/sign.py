r"""Binarisers and ternarisers: a step function forward (sign, Heaviside, ternary), a
surrogate derivative backward, exact at every boundary. (Notation: see
`_elementwise`.)"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._catalogue import ElementwiseRule, JVPRule
from .._hyper import hyperparameter, non_negative, positive
from .._inputs import check_float_array
from ._elementwise import (
    _Elementwise,
    clip_kinks,
    masked_identity,
    reference_sign,
    sg,
    sign,
    wide,
)
from ._exact import ge, le

# A threshold hyperparameter `c` is its float32 value, `np.float32(c)`, and inputs of
# every dtype are compared with that number exactly: in a dtype that holds both (at
# least float32). Comparing a bfloat16 input with `c` rounded to bfloat16 instead
# would misclassify the inputs between the two (larq compares in the input's dtype).


def within(x: Array, c: float | None) -> Array | None:
    """`|x| <= float32(c)`, exactly, whatever `x`'s dtype (`None` without a clip)."""
    return None if c is None else jnp.abs(x.astype(wide(x.dtype))) <= np.float32(c)


def reference_within(x: Array, c: float) -> Array:
    """Independently of `within`: `-c <= x <= c` in `x`'s own dtype, against `c`
    rounded outwards into it (`ge`/`le`), which is the same test exactly."""
    c32 = float(np.float32(c))
    return ge(x, -c32) & le(x, c32)


class _Sign(_Elementwise):
    """A sign whose value is +1 on every input >= 0 (sign(0) = +1): `quantize` warns
    where one follows an activation that is never negative (a ReLU)."""

    constant_on_non_negative: ClassVar[bool] = True


class SteSign(_Sign):
    r"""Sign with the straight-through estimator: the workhorse of binarised networks.

    $$q = \operatorname{sign}(x), \qquad
    \dot q = t \cdot [\lvert x \rvert \le c]$$

    with $c$ = `clip_value`, inclusive at $\pm c$ (the `stop_gradient` trick built on
    `jnp.clip` gives half the gradient there). With `clip_value=None` the derivative
    is $t$ everywhere. Note $\operatorname{sign}(0) = +1$: outputs are only $\pm 1$,
    and NaN for a NaN input.

    **Arguments:**

    - `clip_value`: a non-negative number, or `None` for no clipping.

    !!! Example

        ```python
        q = eqxrules.SteSign()(jnp.array([-2.0, -1.0, 0.0, 0.5]))  # [-1, -1, 1, 1]
        g = jax.grad(lambda x: eqxrules.ste_sign(x).sum())(jnp.array([1.0, 1.5]))
        # [1, 0]: abs(x) <= 1 passes the gradient, inclusive at the boundary
        ```
    """

    clip_value: float | None = hyperparameter(
        1.0, non_negative, allow_none=True, positional=True
    )

    summary: ClassVar[str] = (
        "sign(x) (sign(0) = +1); derivative `t·[|x| <= clip_value]`, inclusive"
    )

    def kinks(self) -> tuple[float, ...]:
        return (0.0, *clip_kinks(self.clip_value))

    def primal(self, x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        return sign(x)

    def slope(self, x: Array) -> Array | None:
        return within(x, self.clip_value)

    def reference_forward(self, x: Array) -> Array:
        return reference_sign(x)

    def reference_derivative(self, x: Array) -> Array:
        if self.clip_value is None:
            return x
        return masked_identity(x, reference_within(x, self.clip_value))

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[SteSign]:
        return [cls(), cls(clip_value=0.5), cls(clip_value=None)]


class ApproxSign(_Sign):
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

    def kinks(self) -> tuple[float, ...]:
        return (-1.0, 0.0, 1.0)

    def primal(self, x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        return sign(x)

    def slope(self, x: Array) -> Array:
        a = jnp.abs(x)
        return jnp.where(a <= 1, 2 - 2 * a, jnp.zeros_like(x))

    def reference_forward(self, x: Array) -> Array:
        return reference_sign(x)

    def reference_derivative(self, x: Array) -> Array:
        # d/dx (2x - x|x|) = 2 - 2|x|. Outside [-1, 1] (NaN and inf included) the
        # polynomial sees 0, so its derivative there is never `0 * inf`.
        u = jnp.where(jnp.abs(x) <= 1, x, jnp.zeros_like(x))
        return 2 * u - u * jnp.abs(u)


class SwishSign(_Sign):
    r"""Sign with the derivative of the SignSwish function (Darabi et al., 2018): a
    smooth surrogate whose sharpness is set by $\beta$.

    $$q = \operatorname{sign}(x), \qquad
    \dot q = t \cdot \frac{\beta\,(2 - \beta x \tanh(\beta x / 2))}
    {1 + \cosh(\beta x)}$$

    That is the derivative of $2\sigma(\beta x)(1 + \beta x(1 - \sigma(\beta x))) - 1$.

    **Arguments:**

    - `beta`: a positive number, $\beta$.

    !!! Example

        ```python
        g = jax.grad(eqxrules.swish_sign)(jnp.array(0.0))  # beta = 5.0
        ```
    """

    beta: float = hyperparameter(5.0, positive, positional=True)

    summary: ClassVar[str] = (
        "sign(x); derivative `t·β(2 − βx·tanh(βx/2)) / (1 + cosh(βx))` (SignSwish)"
    )

    def kinks(self) -> tuple[float, ...]:
        return (0.0,)

    def primal(self, x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        return sign(x)

    def slope(self, x: Array) -> Array:
        b = float(self.beta)
        # Clamped to the largest finite number, so that at +-inf the ratio is
        # finite / inf = 0 (its limit), not -inf / inf = NaN.
        big = float(jnp.finfo(x.dtype).max)
        bx = jnp.clip(b * x, -big, big)
        return b * ((2 - bx * jnp.tanh(bx / 2)) / (1 + jnp.cosh(bx)))

    def reference_forward(self, x: Array) -> Array:
        return reference_sign(x)

    def reference_derivative(self, x: Array) -> Array:
        # In float32 at least: in float16 the derivative is wrong, even in sign, for
        # |x| above about 1.1 (beta = 5). 2 s (1 + y s_) - 1 = 1 - 2 s_ + 2 y s s_
        # with s = sigma(y), s_ = sigma(-y), each exp(-softplus(-+y)): autodiff then
        # neither cancels nor overflows for large |y| (through `sigmoid` it forms
        # 1 - s, 60 ulps of float32 off at y = 10). At +-inf, where `y s_` is
        # inf * 0, the derivative is 0 (its limit): `y` is cut from `x` there.
        w = x.astype(wide(x.dtype))
        y = self.beta * jnp.where(jnp.isinf(w), sg(w), w)
        s, s_minus = jnp.exp(-jax.nn.softplus(-y)), jnp.exp(-jax.nn.softplus(y))
        return (1 - 2 * s_minus + 2 * y * s * s_minus).astype(x.dtype)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[SwishSign]:
        return [cls(), cls(beta=1.5)]


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

    The mask selects, in both modes: where $\lvert x \rvert > c$ the tangent and the
    cotangent are exactly 0, even where $\alpha$ is inf or NaN (a non-finite
    element in the channel) or $t$ is. With `clip_value=None` the derivative is
    $\alpha t$ everywhere, as in larq.

    A 1-D input has no axis to average over, so $\alpha = \lvert x \rvert$ elementwise
    (as in larq). Not elementwise: takes one floating-point array.

    **Arguments:**

    - `clip_value`: a non-negative number, $c$, or `None` for no clipping.

    !!! Example

        ```python
        w = jnp.array([[0.5, -2.0], [-0.5, 1.0]])
        eqxrules.magnitude_aware_sign(w)  # [[0.5, -1.5], [-0.5, 1.5]]
        ```
    """

    clip_value: float | None = hyperparameter(
        1.0, non_negative, allow_none=True, positional=True
    )

    summary: ClassVar[str] = (
        "stop_gradient(mean |x| over all axes but the last)·sign(x); derivative "
        "that scale·`t·[|x| <= clip_value]`"
    )
    elementwise: ClassVar[bool] = False

    def kinks(self) -> tuple[float, ...]:
        return (0.0, *clip_kinks(self.clip_value))

    def _check_call(self, args: tuple[Any, ...]) -> None:
        check_float_array(self.rule_name(), args)

    def primal(self, x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        # No NaN select: the magnitude is already NaN wherever `x` is.
        return _magnitude(x) * jnp.where(x >= 0, 1, -1).astype(x.dtype)

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        **kwargs: Any,
    ) -> Any:
        (x,) = args
        (t,) = t_args
        if t is None:
            return None
        # α is `stop_gradient(mean |x|)`: no derivative of this tangent (second
        # order) flows through it either, as none flows through the reference's.
        scale = jax.lax.stop_gradient(_magnitude(x))
        mask = within(x, self.clip_value)
        if mask is None:
            return t * scale
        # Selected, not multiplied, twice: the outer select makes the tangent 0
        # where the mask is, whatever `t`; the inner one makes the scale 0 there,
        # so that the transpose, `where(mask, ct, 0) * scale`, is `0 * 0` and not
        # `0 * NaN` when a non-finite element makes the channel's scale NaN.
        scale = jnp.where(mask, scale, jnp.zeros_like(scale))
        return jnp.where(mask, t * scale, jnp.zeros_like(t))

    def reference_forward(self, x: Array) -> Array:
        axes = tuple(range(x.ndim - 1))
        scale = jnp.sum(jnp.abs(x), axis=axes, keepdims=True) / math.prod(x.shape[:-1])
        return scale * reference_sign(x)

    def reference_derivative(self, x: Array) -> Array:
        scale = sg(_magnitude(x))
        if self.clip_value is None:
            return scale * x
        # The scale is 0 where the mask is, so that the derivative there is 0 in
        # both modes even where a non-finite element makes the scale NaN.
        inside = reference_within(x, self.clip_value)
        return masked_identity(jnp.where(inside, scale, 0) * x, inside)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[MagnitudeAwareSign]:
        return [cls(), cls(clip_value=0.5), cls(clip_value=None)]


class SteTernary(_Elementwise):
    r"""Ternarisation with the straight-through estimator (Ternary Weight Networks).

    $$q = \begin{cases} +1 & x \ge \theta \\ -1 & x \le -\theta \\ 0 & \text{else}
    \end{cases}, \qquad \dot q = t \cdot [\lvert x \rvert \le c]$$

    with $\theta$ = `threshold_value` and $c$ = `clip_value`, both inclusive. With
    `clip_value=None` the derivative is $t$ everywhere. A NaN input gives NaN.

    **Arguments:**

    - `threshold_value`: a positive number (at zero, $x = 0$ would be both $+1$ and
        $-1$).
    - `clip_value`: a non-negative number, or `None` for no clipping.

    !!! Example

        ```python
        eqxrules.ste_ternary(jnp.array([-0.05, 0.0, 0.05, 0.3]))  # [-1, 0, 1, 1]
        ```
    """

    threshold_value: float = hyperparameter(0.05, positive, positional=True)
    clip_value: float | None = hyperparameter(
        1.0, non_negative, allow_none=True, positional=True
    )

    summary: ClassVar[str] = (
        "+1 where x >= threshold, −1 where x <= −threshold, else 0; derivative "
        "`t·[|x| <= clip_value]`"
    )

    def kinks(self) -> tuple[float, ...]:
        th = self.threshold_value
        return (-th, th, *clip_kinks(self.clip_value))

    def primal(self, x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        th, w = np.float32(self.threshold_value), x.astype(wide(x.dtype))
        q = jnp.where(w >= th, 1, jnp.where(w <= -th, -1, 0)).astype(x.dtype)
        return jnp.where(jnp.isnan(x), x, q)

    def slope(self, x: Array) -> Array | None:
        return within(x, self.clip_value)

    def reference_forward(self, x: Array) -> Array:
        th = float(np.float32(self.threshold_value))
        q = ge(x, th).astype(x.dtype) - le(x, -th).astype(x.dtype)
        return jnp.where(x == x, q, x)

    def reference_derivative(self, x: Array) -> Array:
        if self.clip_value is None:
            return x
        return masked_identity(x, reference_within(x, self.clip_value))

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[SteTernary]:
        return [
            cls(),
            cls(threshold_value=0.5, clip_value=1.5),
            cls(threshold_value=0.3, clip_value=None),
        ]


class SteHeaviside(_Elementwise):
    r"""The Heaviside step with the straight-through estimator: binary $\{0, 1\}$
    activations.

    $$q = [x > 0], \qquad \dot q = t \cdot [\lvert x \rvert \le c]$$

    With `clip_value=None` the derivative is $t$ everywhere. A NaN input gives NaN.

    **Arguments:**

    - `clip_value`: a non-negative number, $c$, or `None` for no clipping.

    !!! Example

        ```python
        eqxrules.ste_heaviside(jnp.array([-1.0, 0.0, 0.5]))  # [0, 0, 1]
        ```
    """

    clip_value: float | None = hyperparameter(
        1.0, non_negative, allow_none=True, positional=True
    )

    summary: ClassVar[str] = "1 where x > 0, else 0; derivative `t·[|x| <= clip_value]`"

    def kinks(self) -> tuple[float, ...]:
        return (0.0, *clip_kinks(self.clip_value))

    def primal(self, x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        return jnp.where(jnp.isnan(x), x, (x > 0).astype(x.dtype))

    def slope(self, x: Array) -> Array | None:
        return within(x, self.clip_value)

    def reference_forward(self, x: Array) -> Array:
        return jnp.floor((jnp.sign(x) + 1) / 2)

    def reference_derivative(self, x: Array) -> Array:
        if self.clip_value is None:
            return x
        return masked_identity(x, reference_within(x, self.clip_value))

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[SteHeaviside]:
        return [cls(), cls(clip_value=None)]


class QuadraticSign(ElementwiseRule):
    r"""Sign with the derivative of a quadratic surrogate of width $c$ = `clip_value`
    (positive): [`ApproxSign`][] (Bi-Real Net) is $c = 1$.

    $$q = \operatorname{sign}(x), \qquad \dot q = t \cdot \tfrac{2}{c}
    \big(1 - \tfrac{\lvert x \rvert}{c}\big) [\lvert x \rvert \le c]$$

    !!! Example

        ```python
        jax.grad(eqxrules.QuadraticSign(clip_value=0.5))(jnp.array(0.25))  # 2.0
        ```
    """

    clip_value: float = hyperparameter(1.0, positive)
    summary: ClassVar[str] = "sign(x); derivative `t·(2/c)·(1 − |x|/c)·[|x| <= c]`"
    constant_on_non_negative: ClassVar[bool] = True  # sign(0) = +1

    def kinks(self) -> tuple[float, ...]:
        return (-self.clip_value, 0.0, self.clip_value)

    def primal(self, x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        return jnp.sign(x) + (x == 0)  # +1 at 0; NaN stays NaN

    def slope(self, x: Array) -> Array:
        c = self.clip_value  # compared in at least float32: with float32(c) exactly
        a = jnp.abs(x.astype(jnp.promote_types(x.dtype, jnp.float32)))
        return jnp.where(a <= jnp.float32(c), (2 - 2 * a / c) / c, 0).astype(x.dtype)

    def reference_forward(self, x: Array) -> Array:
        return jnp.where(x < 0, -1, jnp.where(x >= 0, 1, x)).astype(x.dtype)

    def reference_derivative(self, x: Array) -> Array:
        w, c = x.astype(jnp.promote_types(x.dtype, jnp.float32)), self.clip_value
        u = jnp.where((w >= -jnp.float32(c)) & (w <= jnp.float32(c)), w, 0)
        return ((2 * u - u * jnp.abs(u) / c) / c).astype(x.dtype)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[QuadraticSign]:
        return [cls(), cls(clip_value=0.5)]
