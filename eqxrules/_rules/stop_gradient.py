"""Stop-gradient preprocessors: the value is computed as usual, the derivative is
blocked (all of it, or with respect to some inputs only)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PRNGKeyArray

from .._catalogue import (
    Domain,
    JVPRule,
    PytreeRule,
    functional,
    map_tangent,
    no_tangent,
)
from .._hyper import axis_indices, function, hyperparameter, non_negative
from .._inputs import check_axis
from .._tangents import call_with_key, partial_jvp
from .._typing import PyTree


def _frozen(tree: PyTree) -> PyTree:
    """`tree` with `lax.stop_gradient` on its floating-point arrays.

    The primal of a rule is also differentiated with ordinary autodiff when the rule
    is differentiated twice (JAX differentiates the JVP rule, which evaluates
    `primal`). Freezing inside `primal` makes those higher derivatives agree with the
    plain `stop_gradient` composition instead of silently reviving the blocked path.
    """
    dynamic, static = eqx.partition(tree, eqx.is_inexact_array)
    return eqx.combine(jax.lax.stop_gradient(dynamic), static)


class _Blocking(JVPRule):
    """A rule whose `primal` blocks the same paths as its `tangent` (by freezing
    them, see `_frozen`), so derivatives of every order agree with its references."""

    def higher_order(self) -> bool:
        return True


class _WrapperRule(_Blocking):
    """Base of the rules that call a wrapped callable on `x`.

    The callable's output may hold non-array leaves; those are found by tracing it
    abstractly (`eqx.filter_eval_shape`), kept out of the custom JVP (whose outputs
    must be JAX types) and put back after it.
    """

    elementwise: ClassVar[bool] = False
    domain: ClassVar[Domain] = Domain(low=-2.0, high=2.0, shape=(3,))

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[Any]:
        # Each subclass has one field, the callable it wraps.
        wrap: Any = cls
        return [wrap(eqx.nn.MLP(3, 2, 5, 2, activation=jnp.tanh, key=key))]

    def _wrapped(self) -> Callable[..., PyTree]:
        # The one field: the callable wrapped.
        return getattr(self, dataclasses.fields(self)[0].name)

    def reference_forward(
        self, x: PyTree, *, key: PRNGKeyArray | None = None
    ) -> PyTree:
        return call_with_key(self._wrapped(), x, key)

    def __call__(
        self, *args: PyTree, key: PRNGKeyArray | None = None, **kwargs: Any
    ) -> PyTree:
        x = self._one_input(args)
        shapes = eqx.filter_eval_shape(
            lambda f, x: call_with_key(f, x, key), self._wrapped(), x
        )
        other = eqx.filter(shapes, lambda s: isinstance(s, jax.ShapeDtypeStruct), True)
        return eqx.combine(super().__call__(x, key=key, **kwargs), other)


class StopGradient(_WrapperRule):
    r"""Calls `fn(x)` as a frozen preprocessor: nothing is differentiated through it.

    With $\theta$ the parameters (floating-point arrays) of `fn`,

    $$y = f_\theta(x), \qquad \dot y = 0$$

    for every tangent $(\dot\theta, \dot x)$: the derivative is zero with respect to
    `x` and with respect to every parameter of `fn`. Derivatives of any order are
    those of `jax.lax.stop_gradient(fn(x))`.

    `exact` is `False`: the derivative is deliberately not the derivative of the
    value (finite differences of `fn(x)` are not zero).

    **Arguments:**

    - `fn`: any callable pytree: an `eqx.Module`, `eqx.nn.MLP`, or a plain function.
        Its input and output may be any pytrees; non-array output leaves are passed
        through.

    !!! Example

        ```python
        encoder = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
        features = eqxrules.StopGradient(encoder)(x)  # no gradient reaches encoder or x
        ```
    """

    fn: Callable[..., PyTree] = hyperparameter(function, static=False)

    summary: ClassVar[str] = (
        "`fn(x)` with zero derivative in `x` and in `fn`'s parameters"
    )

    def primal(self, x: PyTree, *, key: PRNGKeyArray | None = None) -> PyTree:
        fn, x = _frozen((self.fn, x))
        return eqx.filter(call_with_key(fn, x, key), eqx.is_array)

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        **kwargs: Any,
    ) -> Any:
        return no_tangent(out)

    def reference_derivative(
        self, x: PyTree, *, key: PRNGKeyArray | None = None
    ) -> PyTree:
        return jax.lax.stop_gradient(call_with_key(self.fn, x, key))


@functional(StopGradient)
def stop_gradient_call(fn: Callable[..., PyTree], x: PyTree) -> PyTree:
    return StopGradient(fn)(x)


class Frozen(_WrapperRule):
    r"""Calls `module(x)` as a frozen encoder: its parameters get no gradient, but the
    derivative still flows with respect to `x`.

    With $\theta$ the parameters of `module` and $J_x$ its Jacobian with respect to
    its input,

    $$y = m_\theta(x), \qquad \dot y = J_x \dot x \quad (\text{whatever } \dot\theta).$$

    This holds in forward and reverse mode. Derivatives of any order are those of
    `module` with `jax.lax.stop_gradient` on its parameters: second derivatives in
    `x` are the true ones, and every derivative involving $\theta$ is zero.

    `exact` is `False`: the derivative with respect to the parameters is
    deliberately zero, not the true one.

    **Arguments:**

    - `module`: any callable pytree, typically an `eqx.Module`. Its input and output
        may be any pytrees; non-array output leaves are passed through.

    !!! Example

        ```python
        encoder = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
        frozen = eqxrules.Frozen(encoder)
        dx = jax.grad(lambda x: frozen(x).sum())(x)  # flows through the encoder
        ```
    """

    module: Callable[..., PyTree] = hyperparameter(function, static=False)

    summary: ClassVar[str] = (
        "`module(x)` with zero derivative in its parameters; flows in `x`"
    )

    def primal(self, x: PyTree, *, key: PRNGKeyArray | None = None) -> PyTree:
        return eqx.filter(call_with_key(_frozen(self.module), x, key), eqx.is_array)

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
        module = _frozen(self.module)
        t_out = partial_jvp(
            lambda x: eqx.filter(call_with_key(module, x, key), eqx.is_array),
            tuple(args),
            tuple(t_args),
        )
        return no_tangent(out) if t_out is None else t_out

    def reference_derivative(
        self, x: PyTree, *, key: PRNGKeyArray | None = None
    ) -> PyTree:
        frozen = jtu.tree_map(
            lambda p: jax.lax.stop_gradient(p) if eqx.is_inexact_array(p) else p,
            self.module,
        )
        return call_with_key(frozen, x, key)


@functional(Frozen)
def frozen_call(module: Callable[..., PyTree], x: PyTree) -> PyTree:
    return Frozen(module)(x)


class Detach(PytreeRule, _Blocking):
    r"""The identity on any pytree, with zero derivative: PyTorch's `x.detach()`.

    $$y = x, \qquad \dot y = 0,$$

    and derivatives of every order are zero. Used to cut the graph, e.g. on the carried state of a recurrent network between
    windows of truncated back-propagation through time. Non-array leaves are passed
    through untouched; integer arrays pass through with no tangent.

    `exact` is `False`: the true derivative of the identity is not zero.

    !!! Example

        ```python
        h, c = eqxrules.detach((h, c))
        ```
    """

    summary: ClassVar[str] = "identity on any pytree, with zero derivative"

    def primal(self, x: PyTree) -> PyTree:
        return _frozen(x)

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        **kwargs: Any,
    ) -> Any:
        return no_tangent(out)

    def reference_forward(self, x: PyTree) -> PyTree:
        return x

    def reference_derivative(self, x: PyTree) -> PyTree:
        return jtu.tree_map(lambda a: a - (a - jax.lax.stop_gradient(a)), x)


def _wide(x: Array) -> Array:
    # Statistics of bf16/f16 inputs are accumulated in (at least) float32.
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


class Standardize(PytreeRule, _Blocking):
    r"""Standardises every floating-point leaf along `axis`, with the statistics
    treated as constants.

    With $\mu$ and $\sigma$ the mean and (population) standard deviation of $x$ along
    `axis`, and $\epsilon$ = `eps`,

    $$y = \frac{x - \mu}{\sigma + \epsilon}, \qquad
    \dot y = \frac{\dot x}{\sigma + \epsilon},$$

    i.e. $\mu$ and $\sigma$ get `stop_gradient` (normalisation with stop-gradient
    statistics). Derivatives of any order are those of that composition. Non-float
    leaves are passed through untouched. Statistics of low-precision inputs are
    computed in float32; the output keeps the input's dtype.

    `exact` is `False`: the true derivative would also differentiate $\mu$ and
    $\sigma$.

    **Arguments:**

    - `axis`: an int or a tuple of ints, the axes the statistics are taken over
        (applied to every floating-point leaf). A leaf without those axes (a
        scalar, say) is a `ValueError` at call time.
    - `eps`: a finite, non-negative number added to $\sigma$. With `eps=0` a
        constant slice divides by zero.
    """

    axis: int | tuple[int, ...] = hyperparameter(-1, axis_indices)
    eps: float = hyperparameter(1e-5, non_negative)

    summary: ClassVar[str] = (
        "`(x - mean) / (std + eps)` along `axis`; mean and std get no gradient"
    )

    def _check_call(self, args: tuple[Any, ...]) -> None:
        # Checked here, at call time: deep inside `jnp.std` a bad axis is an
        # `IndexError` that names neither the rule nor the axis.
        for leaf in jtu.tree_leaves(args):
            if eqx.is_inexact_array(leaf):
                check_axis(self.rule_name(), self.axis, leaf.shape, "x")

    def _denominator(self, x: Array) -> Array:
        std = jnp.std(_wide(jax.lax.stop_gradient(x)), axis=self.axis, keepdims=True)
        return std + self.eps

    def primal(self, x: PyTree) -> PyTree:
        def leaf(a):
            if not eqx.is_inexact_array(a):
                return a
            mean = jnp.mean(_wide(jax.lax.stop_gradient(a)), self.axis, keepdims=True)
            return ((_wide(a) - mean) / self._denominator(a)).astype(a.dtype)

        return jtu.tree_map(leaf, x)

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
        return map_tangent(lambda a, t: t / self._denominator(a), x, t_x)

    def reference_forward(self, x: PyTree) -> PyTree:
        def leaf(a):
            if not eqx.is_inexact_array(a):
                return a
            w = _wide(a)
            var = jnp.var(w, axis=self.axis, keepdims=True)
            centred = w - jnp.mean(w, axis=self.axis, keepdims=True)
            return (centred / (jnp.sqrt(var) + self.eps)).astype(a.dtype)

        return jtu.tree_map(leaf, x)

    def reference_derivative(self, x: PyTree) -> PyTree:
        def leaf(a):
            if not eqx.is_inexact_array(a):
                return a
            w = _wide(a)
            c = jax.lax.stop_gradient(w)
            y = (w - c.mean(self.axis, keepdims=True)) / (
                c.std(self.axis, keepdims=True) + self.eps
            )
            return y.astype(a.dtype)

        return jtu.tree_map(leaf, x)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[Standardize]:
        return [cls(), cls(axis=0, eps=0.1)]
