r"""The generic straight-through estimator: any forward, the derivative of any
surrogate."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PRNGKeyArray

from .._catalogue import JVPRule
from .._hyper import function, hyperparameter
from .._tangents import partial_jvp
from .._typing import PyTree


class _Shown:
    def __init__(self, leaf: jax.ShapeDtypeStruct) -> None:
        self.text = f"{leaf.dtype}{list(leaf.shape)}"

    def __repr__(self) -> str:
        return self.text


def _describe(tree: PyTree) -> str:
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

    forward: Callable[[Array], PyTree] = hyperparameter(function, static=False)
    surrogate: Callable[[Array], PyTree] = hyperparameter(function, static=False)

    summary: ClassVar[str] = (
        "`forward(x)`; derivative that of `surrogate` at x (shapes and dtypes must "
        "match)"
    )

    def kinks(self) -> tuple[float, ...]:
        # Where the examples' forwards (a step, `floor`) jump; any other forward
        # declares its own by subclassing.
        return (-1.0, 0.0, 1.0)

    def _check_call(self, args: tuple[Any, ...]) -> None:
        super()._check_call(args)
        f = jax.eval_shape(self.forward, args[0])
        s = jax.eval_shape(self.surrogate, args[0])
        if jtu.tree_structure(f) != jtu.tree_structure(s) or any(
            (a.shape, a.dtype) != (b.shape, b.dtype)
            for a, b in zip(jtu.tree_leaves(f), jtu.tree_leaves(s))
        ):
            raise ValueError(
                f"`{self.rule_name()}`: `forward` gives {_describe(f)} but "
                f"`surrogate` gives {_describe(s)}; their shapes and dtypes must match."
            )

    def primal(self, x: Array) -> PyTree:
        return self.forward(x)

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        **kwargs: Any,
    ) -> Any:
        (x,) = args
        (t_x,) = t_args
        return partial_jvp(
            lambda s, x: s(x), (self.surrogate, x), (t_self.surrogate, t_x)
        )

    def reference_forward(self, x: Array) -> PyTree:
        return self.forward(x)

    def reference_derivative(self, x: Array) -> PyTree:
        return self.surrogate(x)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[StraightThrough]:
        return [cls(_heaviside, jax.nn.sigmoid), cls(jnp.floor, _identity)]
