"""ScaledModel: call a sub-model on `x / scale`, with a choice of derivative."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, PRNGKeyArray

from .._catalogue import Domain, JVPRule, functional
from .._hyper import finite_nonzero, function, hyperparameter, one_of
from .._inputs import check_array, check_broadcasts
from .._tangents import call_with_key, partial_jvp
from .._typing import PyTree

Mode = Literal["exact", "skip_scale", "stop_input"]
_MODES = ("exact", "skip_scale", "stop_input")


def _sin_and_square(u: Array) -> dict[str, Array]:
    # A plain function with a pytree output, to check that both are supported.
    return {"sin": jnp.sin(u), "square": u**2}


class ScaledModel(JVPRule):
    r"""Calls `sub_model(x / scale)`, with a choice of derivative.

    With $u = x / s$ and $J_\theta$, $J_u$ the sub-model's Jacobians with respect to
    its parameters $\theta$ and its input, the tangent for tangents
    $(\dot\theta, \dot x, \dot s)$ is

    | `mode` | tangent |
    |---|---|
    | `"exact"` | $J_\theta \dot\theta + J_u (\dot x / s - x \dot s / s^2)$ (plain autodiff) |
    | `"skip_scale"` | $J_\theta \dot\theta + J_u \dot x$ (the gradient is with respect to $u$) |
    | `"stop_input"` | $J_\theta \dot\theta$ |

    Parameters always get their true derivatives, whether or not `x` is
    differentiated: symbolic-zero tangents are respected, never dropped. (The
    textbook rule reads only the tangent of `x`; it crashes when `x` is not
    differentiated and silently zeroes the parameter gradient when it is.)

    **Arguments:**

    - `sub_model`: any callable pytree: an `eqx.Module`, `eqx.nn.MLP`, or a plain
        function. Its output may be a pytree of arrays.
    - `scale`: a Python number or an array broadcastable to `x`. Zero, NaN and
        infinite values are rejected when concrete.
    - `mode`: `"exact"`, `"skip_scale"` or `"stop_input"`.

    !!! Example

        ```python
        mlp = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
        model = eqxrules.ScaledModel(mlp, 4.0, mode="skip_scale")
        grads = eqx.filter_grad(lambda m, x: m(x).sum())(model, jnp.ones(3))
        ```
    """

    sub_model: Callable[..., PyTree] = hyperparameter(function, static=False)
    scale: float | Array = hyperparameter(finite_nonzero, static=False)
    mode: Mode = hyperparameter("exact", one_of(*_MODES))

    summary: ClassVar[str] = (
        "`sub_model(x / scale)`; `mode` picks the derivative: exact, skip_scale or "
        "stop_input"
    )
    exact: ClassVar[bool] = True
    elementwise: ClassVar[bool] = False
    domain: ClassVar[Domain] = Domain(low=-2.0, high=2.0, shape=(3,))

    def is_exact(self) -> bool:
        return self.mode == "exact"

    def _check_call(self, args: tuple[Any, ...]) -> None:
        if len(args) != 1:
            raise TypeError(f"`ScaledModel` takes one input `x`, got {len(args)}.")
        check_array(self.rule_name(), args)
        check_broadcasts("ScaledModel", "scale", self.scale, jnp.shape(args[0]))

    def primal(self, x: Array, *, key: PRNGKeyArray | None = None) -> PyTree:
        return call_with_key(self.sub_model, x / self.scale, key)

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        *,
        key: PRNGKeyArray | None = None,
        **kwargs: Any,
    ) -> Any:
        (x,) = args
        (t_x,) = t_args
        # `eqx.filter_custom_jvp` passes `t_self` shaped like the Module (`None` in
        # each unperturbed field), never a bare `None`.
        t_sub = t_self.sub_model
        if self.mode == "exact":
            t_scale = t_self.scale
            return partial_jvp(
                lambda sub, scale, x: call_with_key(sub, x / scale, key),
                (self.sub_model, self.scale, x),
                (t_sub, t_scale, t_x),
            )
        # The point `x / scale`, moving as the mode says `x` moves it (as the
        # reference has it): with `x` itself under "skip_scale", not at all under
        # "stop_input". Its value is `x / scale` exactly (`x - sg(x)` is 0); only
        # a derivative of this tangent (second order) sees the difference.
        sg = jax.lax.stop_gradient
        u = sg(x / self.scale)
        if self.mode == "skip_scale":
            u = u + (x - sg(x))
            return partial_jvp(
                lambda sub, u: call_with_key(sub, u, key),
                (self.sub_model, u),
                (t_sub, t_x),
            )
        return partial_jvp(
            lambda sub: call_with_key(sub, u, key), (self.sub_model,), (t_sub,)
        )

    def reference_forward(self, x: Array, *, key: PRNGKeyArray | None = None) -> PyTree:
        return call_with_key(self.sub_model, x / self.scale, key)

    def reference_derivative(
        self, x: Array, *, key: PRNGKeyArray | None = None
    ) -> PyTree:
        sg = jax.lax.stop_gradient
        if self.mode == "exact":
            return call_with_key(self.sub_model, x / self.scale, key)
        if self.mode == "skip_scale":
            # Value at exactly x / scale; derivative in x the identity.
            return call_with_key(self.sub_model, sg(x / self.scale) + (x - sg(x)), key)
        return call_with_key(self.sub_model, sg(x / self.scale), key)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[ScaledModel]:
        k1, k2 = jax.random.split(key)
        mlp = eqx.nn.MLP(3, 2, 5, 2, activation=jnp.tanh, key=k1)
        linear = eqx.nn.Linear(3, 2, key=k2)
        return [
            *(cls(mlp, 2.0, mode=m) for m in _MODES),
            cls(linear, jnp.array([0.5, 2.0, -1.5]), mode="exact"),
            cls(_sin_and_square, 3.0, mode="skip_scale"),
        ]


@functional(ScaledModel)
def scaled_call(
    sub_model: Callable[..., PyTree],
    x: ArrayLike,
    scale: float | Array,
    *,
    mode: Mode = "exact",
) -> PyTree:
    return ScaledModel(sub_model, scale, mode=mode)(x)
