r"""Categorical choices: a one-hot sample forward, the derivative of a softmax
backward. (Notation: see `_elementwise`.)"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from .._catalogue import JVPRule
from .._hyper import axis_index, boolean, hyperparameter, positive
from .._inputs import check_axis, check_float_array
from .._tangents import partial_jvp
from ._elementwise import sg, wide


def _first_max(z: Array, axis: int) -> Array:
    """One-hot of the first maximum along `axis`, without `argmax`; a row holding a
    NaN is NaN."""
    m = jnp.max(z, axis=axis, keepdims=True)
    is_max = z == m
    one_hot = (is_max & (jnp.cumsum(is_max, axis=axis) == 1)).astype(z.dtype)
    return jnp.where(m == m, one_hot, m)


def _reference_softmax(z: Array, axis: int) -> Array:
    e = jnp.exp(z - sg(jnp.max(z, axis=axis, keepdims=True)))
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


class _Categorical(JVPRule):
    """A rule on one floating-point array of logits, along `axis` (in range, else a
    `ValueError` when called)."""

    elementwise: ClassVar[bool] = False

    def _check_call(self, args: tuple[Any, ...]) -> None:
        # `axis` is each subclass's field (declared there, in its own place).
        axis = getattr(self, "axis")
        check_float_array(self.rule_name(), args, argument="logits")
        check_axis(self.rule_name(), axis, jnp.shape(args[0]), "logits")


class StraightThroughOneHot(_Categorical):
    r"""A categorical choice with the softmax derivative: the straight-through
    estimator for discrete latent variables (Bengio et al., 2013).

    $$q = \operatorname{one\_hot}(\operatorname{argmax}(\ell)), \qquad
    \dot q = \partial \operatorname{softmax}(\ell)\, t
    = s \odot (t - \langle s, t \rangle), \quad s = \operatorname{softmax}(\ell)$$

    along `axis`. Ties go to the first maximum; a NaN anywhere along `axis` makes
    that whole row of the value NaN. Not elementwise: takes one floating-point array
    of logits, with at least one axis (`axis` must be in range, else a `ValueError`).

    **Arguments:**

    - `axis`: the axis of the categories.

    !!! Example

        ```python
        eqxrules.straight_through_onehot(jnp.array([0.1, 2.0, -1.0]))  # [0, 1, 0]
        ```
    """

    axis: int = hyperparameter(-1, axis_index, positional=True)

    summary: ClassVar[str] = (
        "one_hot(argmax(logits)); derivative that of softmax(logits)"
    )
    functional_name: ClassVar[str] = "straight_through_onehot"

    def primal(self, logits: Array) -> Array:
        return _one_hot_argmax(logits, self.axis, logits.dtype)

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        **kwargs: Any,
    ) -> Any:
        return partial_jvp(lambda z: jax.nn.softmax(z, axis=self.axis), args, t_args)

    def reference_forward(self, logits: Array) -> Array:
        return _first_max(logits, self.axis)

    def reference_derivative(self, logits: Array) -> Array:
        return _reference_softmax(logits, self.axis)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[StraightThroughOneHot]:
        return [cls(), cls(axis=0)]


class GumbelSoftmax(_Categorical):
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

    - `tau`: the temperature, positive.
    - `hard`: a one-hot forward (`True`) or the soft sample (`False`).
    - `axis`: the axis of the categories.

    At call: `key`, a PRNG key.

    !!! Example

        ```python
        z = eqxrules.gumbel_softmax(jnp.array([1.0, 2.0, 0.5]), jax.random.key(0))
        # a one-hot vector; its derivative is that of the soft sample
        ```
    """

    tau: float = hyperparameter(1.0, positive, positional=True)
    hard: bool = hyperparameter(True, boolean, positional=True)
    axis: int = hyperparameter(-1, axis_index, positional=True)

    summary: ClassVar[str] = (
        "hard: one-hot of the Gumbel-perturbed argmax, soft: softmax((logits + g)/τ);"
        " derivative that of the soft sample"
    )

    def is_exact(self) -> bool:
        return not self.hard

    def _perturbed(self, logits: Array, key: PRNGKeyArray) -> Array:
        w = wide(logits.dtype)
        return logits.astype(w) + jax.random.gumbel(key, logits.shape, w)

    def _soft(self, logits: Array, key: PRNGKeyArray) -> Array:
        z = self._perturbed(logits, key) / self.tau
        return jax.nn.softmax(z, axis=self.axis).astype(logits.dtype)

    def primal(self, logits: Array, *, key: PRNGKeyArray) -> Array:
        if self.hard:
            return _one_hot_argmax(
                self._perturbed(logits, key), self.axis, logits.dtype
            )
        return self._soft(logits, key)

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        *,
        key: PRNGKeyArray,
        **kwargs: Any,
    ) -> Any:
        return partial_jvp(lambda z: self._soft(z, key), args, t_args)

    def reference_forward(self, logits: Array, *, key: PRNGKeyArray) -> Array:
        w = wide(logits.dtype)
        z = logits.astype(w) + jax.random.gumbel(key, logits.shape, w)
        if self.hard:
            return _first_max(z, self.axis).astype(logits.dtype)
        return _reference_softmax(z / self.tau, self.axis).astype(logits.dtype)

    def reference_derivative(self, logits: Array, *, key: PRNGKeyArray) -> Array:
        w = wide(logits.dtype)
        z = logits.astype(w) + jax.random.gumbel(key, logits.shape, w)
        return _reference_softmax(z / self.tau, self.axis).astype(logits.dtype)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[GumbelSoftmax]:
        return [cls(), cls(tau=0.5, hard=False, axis=0)]
