"""Gradient shaping: the value is unchanged, the derivative is rescaled, reversed,
clipped or cleaned. Every rule here applies to any pytree `x`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PRNGKeyArray

from .._catalogue import PytreeRule, VJPRule, map_tangent
from .._hyper import at_least_zero, at_most, finite, hyperparameter, positive
from .._typing import PyTree

_ZERO_STAYS_ZERO = ", so that a zero cotangent stays zero"


class GradientReversal(PytreeRule):
    r"""The identity, with the derivative reversed and scaled: the gradient reversal
    layer of domain-adversarial training (Ganin & Lempitsky, 2015).

    With $\lambda$ = `scale`,

    $$y = x, \qquad \dot y = -\lambda\,\dot x.$$

    The derivative is linear, so forward and reverse mode both work. Put it between a
    feature extractor and a domain classifier: the classifier learns to tell the
    domains apart while the features are pushed to make that impossible. Non-float
    leaves are passed through untouched.

    `exact` is `False` (unless `scale == -1`, when the derivative is the identity's).

    **Arguments:**

    - `scale`: a finite number, $\lambda$.

    !!! Example

        ```python
        features = encoder(x)
        domain_logits = domain_head(eqxrules.gradient_reversal(features, scale=0.5))
        ```
    """

    scale: float = hyperparameter(1.0, finite, positional=True)

    summary: ClassVar[str] = (
        "identity with derivative `-scale * t` (forward and reverse)"
    )

    def is_exact(self) -> bool:
        return self.scale == -1

    def primal(self, x: PyTree) -> PyTree:
        return x

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        **kwargs: Any,
    ) -> Any:
        return map_tangent(lambda _, t: -self.scale * t, args[0], t_args[0])

    def reference_forward(self, x: PyTree) -> PyTree:
        return x

    def reference_derivative(self, x: PyTree) -> PyTree:
        sg = jax.lax.stop_gradient
        return jtu.tree_map(lambda a: sg(a) + self.scale * (sg(a) - a), x)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[GradientReversal]:
        return [cls(), cls(scale=0.3)]


class GradientScale(PytreeRule):
    r"""The identity, with the derivative scaled.

    With $\lambda$ = `scale`,

    $$y = x, \qquad \dot y = \lambda\,\dot x,$$

    in forward and reverse mode. Use it to slow down or speed up learning of
    everything upstream of `x` without changing the forward pass. Non-float leaves
    are passed through untouched.

    `exact` is `False` (unless `scale == 1`).

    **Arguments:**

    - `scale`: a finite number, $\lambda$ (zero and negative values are
        allowed: `scale=0` is [`Detach`][], `scale=-1` is [`GradientReversal`][]).
    """

    scale: float = hyperparameter(finite, positional=True)

    summary: ClassVar[str] = (
        "identity with derivative `scale * t` (forward and reverse)"
    )

    def is_exact(self) -> bool:
        return self.scale == 1

    def primal(self, x: PyTree) -> PyTree:
        return x

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        **kwargs: Any,
    ) -> Any:
        return map_tangent(lambda _, t: self.scale * t, args[0], t_args[0])

    def reference_forward(self, x: PyTree) -> PyTree:
        return x

    def reference_derivative(self, x: PyTree) -> PyTree:
        sg = jax.lax.stop_gradient
        return jtu.tree_map(lambda a: sg(a) + self.scale * (a - sg(a)), x)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[GradientScale]:
        return [cls(2.5)]


class _CotangentRule(VJPRule):
    """Base of the reverse-only rules: the identity on a pytree, whose backward pass
    maps the cotangent through `shape_cotangent`. (They are not linear in the
    cotangent, so they have no JVP.)"""

    elementwise: ClassVar[bool] = False
    pytree_input: ClassVar[bool] = True

    def shape_cotangent(self, cotangent: PyTree) -> PyTree:
        raise NotImplementedError

    def primal(self, x: PyTree) -> PyTree:
        return x

    def bwd(
        self, residuals: Any, cotangent: PyTree, args: tuple[Any, ...], **kwargs: Any
    ) -> Any:
        return (self.shape_cotangent(cotangent),)

    def reference_forward(self, x: PyTree) -> PyTree:
        return x

    def _no_cotangent(self) -> Any:
        # The reference gives no cotangent to the rule's own (array-free) fields; it
        # must mirror the rule's structure, as a bare `None` does not.
        return jtu.tree_map(lambda _: None, self)


def _leafwise(f, cotangent: PyTree) -> PyTree:
    # `None` leaves are symbolic-zero cotangents: they stay `None`.
    return jtu.tree_map(
        lambda c: None if c is None else f(c), cotangent, is_leaf=lambda c: c is None
    )


class ClipGradient(_CotangentRule):
    r"""The identity, with the cotangent clipped elementwise to `[lo, hi]`.

    $$y = x, \qquad \bar x = \operatorname{clip}(\bar y, \mathrm{lo}, \mathrm{hi}).$$

    Reverse mode only: the backward pass is not linear in the cotangent $\bar y$, so
    there is no JVP, and `jax.jvp`, `jax.jacfwd` and `jax.hessian` raise a
    `TypeError` naming the rule. Non-float leaves are passed through untouched.

    **Arguments:**

    - `lo`, `hi`: numbers with `lo <= 0 <= hi` (infinite values clip one side
        only). A zero cotangent must stay zero, otherwise an output that does not
        affect the loss would send gradient back.
    """

    lo: float = hyperparameter(at_most(0, _ZERO_STAYS_ZERO), positional=True)
    hi: float = hyperparameter(at_least_zero(_ZERO_STAYS_ZERO), positional=True)

    summary: ClassVar[str] = "identity; cotangent clipped elementwise to `[lo, hi]`"

    def shape_cotangent(self, cotangent: PyTree) -> PyTree:
        return _leafwise(lambda c: jnp.clip(c, self.lo, self.hi), cotangent)

    def cotangent_thresholds(self) -> tuple[float, ...]:
        return (self.lo, self.hi)

    def reference_vjp(self, cotangent: PyTree, x: PyTree) -> tuple[Any, PyTree]:
        ct = jtu.tree_map(
            lambda c: jnp.minimum(jnp.maximum(c, self.lo), self.hi), cotangent
        )
        return self._no_cotangent(), ct

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[ClipGradient]:
        return [cls(-0.3, 1.0)]


def _squared_norm(cotangent: PyTree) -> Array:
    # Accumulated in (at least) float32: a float16 sum of squares overflows easily.
    squares = [
        jnp.sum(jnp.abs(c).astype(jnp.promote_types(c.dtype, jnp.float32)) ** 2)
        for c in jtu.tree_leaves(cotangent)
    ]
    return sum(squares, jnp.zeros((), jnp.float32))


class ClipGradientNorm(_CotangentRule):
    r"""The identity, with the cotangent of the whole pytree rescaled so that its
    global norm is at most `max_norm`.

    With $\bar y$ the cotangent (all leaves together) and $m$ = `max_norm`,

    $$y = x, \qquad \bar x = \bar y \cdot \min\!\left(1, \frac{m}{\|\bar y\|_2}
    \right).$$

    Reverse mode only: the backward pass is not linear in $\bar y$. The norm is
    accumulated in float32 (or wider); the cotangent keeps its dtype. Non-float
    leaves are passed through untouched.

    **Arguments:**

    - `max_norm`: a finite, positive number.
    """

    max_norm: float = hyperparameter(positive, positional=True)

    summary: ClassVar[str] = "identity; cotangent rescaled to global norm <= `max_norm`"

    def cotangent_thresholds(self) -> tuple[float, ...]:
        return (self.max_norm,)

    def shape_cotangent(self, cotangent: PyTree) -> PyTree:
        squared = _squared_norm(cotangent)
        clip = squared > self.max_norm**2
        # The inner `where` keeps `rsqrt` away from 0, so that differentiating the
        # backward pass (`grad` of `grad`) gives no NaN at a zero cotangent.
        safe = jnp.where(clip, squared, 1.0)
        factor = jnp.where(clip, self.max_norm * jax.lax.rsqrt(safe), 1.0)
        return _leafwise(lambda c: (c * factor).astype(c.dtype), cotangent)

    def reference_vjp(self, cotangent: PyTree, x: PyTree) -> tuple[Any, PyTree]:
        leaves = jtu.tree_leaves(cotangent)
        wide = jnp.result_type(jnp.float32, *leaves)
        flat = jnp.concatenate([jnp.ravel(c).astype(wide) for c in leaves])
        norm = jnp.linalg.norm(flat)
        ct = jtu.tree_map(
            lambda c: c * self.max_norm / jnp.maximum(norm, self.max_norm), cotangent
        )
        return self._no_cotangent(), ct

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[ClipGradientNorm]:
        # Random cotangents of the (4, 3) test input have norm about 3.5: the first
        # example rescales them, the second leaves them alone.
        return [cls(1.0), cls(100.0)]


class ZeroNonFiniteGradient(_CotangentRule):
    r"""The identity, with NaN and $\pm\infty$ cotangent entries set to zero.

    $$y = x, \qquad \bar x_i = \begin{cases} \bar y_i & \bar y_i \text{ finite} \\
    0 & \text{otherwise.} \end{cases}$$

    Reverse mode only. Typical use: a function whose derivative is infinite at a
    point the value is fine at, such as `sqrt` at 0 or a norm at the origin.
    Non-float leaves are passed through untouched.

    !!! Example

        ```python
        f = lambda x: jnp.sum(jnp.sqrt(eqxrules.zero_nonfinite_gradient(x)))
        jax.grad(f)(jnp.array([1.0, 0.0, 4.0]))  # [0.5, 0.0, 0.25], not [0.5, inf, ...]
        ```
    """

    summary: ClassVar[str] = "identity; NaN and inf cotangent entries become 0"
    functional_name: ClassVar[str] = "zero_nonfinite_gradient"

    def shape_cotangent(self, cotangent: PyTree) -> PyTree:
        return _leafwise(
            lambda c: jnp.where(jnp.isfinite(c), c, jnp.zeros_like(c)), cotangent
        )

    def reference_vjp(self, cotangent: PyTree, x: PyTree) -> tuple[Any, PyTree]:
        ct = jtu.tree_map(
            lambda c: jnp.nan_to_num(c, nan=0.0, posinf=0.0, neginf=0.0), cotangent
        )
        return self._no_cotangent(), ct
