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


def softmax_tangent(
    z: Array, t: Array | None, axis: int, tau: float = 1.0
) -> Array | None:
    r"""The derivative of $y = \operatorname{softmax}(z / \tau)$ along `axis` in
    the direction `t`, $J t / \tau$ with $J = \operatorname{diag}(y) - y y^\top$
    (`None` for a symbolic zero), in at least float32 and cast to `t`'s dtype.

    Evaluated as $P^\top J P t$, where $P t = t - t_m \mathbf{1}$ subtracts the
    component at the largest $y_m$ and $P^\top u = u - e_m \sum_i u_i$ (equal to
    $J t$, as $J \mathbf{1} = 0$ and $J = J^\top$). The plain $y \odot (t -
    \langle y, t\rangle)$ cancels where one category dominates: its component
    $m$ is $y_m (t_m - \langle y, t\rangle)$, with $\langle y, t\rangle \approx
    t_m$, so its float32 error is that of $t_m$, not of the small result (at
    $y_m = 0.9989$, 1.6e-4 relative, and two evaluations summing in another order,
    as a GPU's batched and single programs do, differ by more than float32's
    tolerance). Shifted, $(P t)_m = 0$ and $\langle y, P t\rangle$ sums only the
    small terms, so every component is within a few $\gamma_n$ of its own scale,
    $y_i \sum_j y_j |t_i - t_j|$. The form is its own transpose, so the
    cotangent (`jax.vjp` transposes it) is computed as stably."""
    if t is None:
        return None
    w = wide(z.dtype)
    y = jax.nn.softmax(z.astype(w) / tau, axis=axis)
    n = y.shape[axis]
    positions = jnp.arange(n).reshape(
        [n if a == axis % y.ndim else 1 for a in range(y.ndim)]
    )
    is_m = positions == jnp.argmax(y, axis=axis, keepdims=True)

    def at_m(v: Array) -> Array:
        return jnp.sum(jnp.where(is_m, v, 0), axis=axis, keepdims=True)

    s = t.astype(w) - at_m(t.astype(w))
    u = y * (s - jnp.sum(y * s, axis=axis, keepdims=True))
    jt = u - jnp.where(is_m, jnp.sum(u, axis=axis, keepdims=True), 0)
    return (jt / tau).astype(t.dtype)


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
        return softmax_tangent(args[0], t_args[0], self.axis)

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
        z = self._perturbed(args[0], key)
        return softmax_tangent(z, t_args[0], self.axis, self.tau)

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
