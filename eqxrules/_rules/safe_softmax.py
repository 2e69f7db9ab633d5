r"""The NaN-safe softmax and log-sum-exp over the unmasked entries of a row:
[`SafeSoftmax`][] and [`SafeLogsumexp`][], whose rows with nothing in them (every
entry masked out or $-\infty$: a padded sequence, a fully masked attention row) give
zeros and $-\infty$ with a zero derivative. What the NaN-safe rules share is in
`_safe`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray

from .._catalogue import Domain, JVPRule, functional
from .._domain import Inputs, Mask
from .._hyper import axis_indices, hyperparameter
from .._inputs import check_axis, check_broadcasts
from ._safe import check_inputs, kept_shape, wide, zeros

_NEG_INF = -jnp.inf


def _masked(w: Array, where: Array | None) -> Array:
    r"""`w` with its masked-out entries $-\infty$ (nothing in a row's sums)."""
    return w if where is None else jnp.where(where, w, _NEG_INF)


def _empty(w: Array, where: Array | None, axis: Any) -> Array:
    r"""The rows (kept dims) with no unmasked entry above $-\infty$ (a NaN counts:
    its row is not empty, and stays NaN)."""
    live = w != _NEG_INF
    live = live if where is None else live & where
    return ~jnp.any(live, axis=axis, keepdims=True)


class _RowRule(JVPRule):
    """A rule on `x` along `axis`, with an optional boolean `where` (the entries
    that take part): `m(x)` or `m(x, where)`."""

    axis: int | tuple[int, ...] | None = hyperparameter(
        -1, axis_indices, allow_none=True, positional=True
    )

    elementwise: ClassVar[bool] = False
    exact: ClassVar[bool] = True
    domain: ClassVar[Any] = Inputs(x=Domain(), where=Mask())

    def _check_arity(self, args: tuple[Any, ...]) -> None:
        if len(args) not in (1, 2):
            raise TypeError(
                f"`{self.rule_name()}` takes 1 or 2 positional argument(s) (`x`, "
                f"and `where` or none), got {len(args)}."
            )

    def _check_call(self, args: tuple[Any, ...]) -> None:
        name, x = self.rule_name(), args[0]
        where = args[1] if len(args) > 1 else None
        check_inputs(name, (x, where), {"x": "float", "where": "bool or None"})
        if where is not None:
            check_broadcasts(name, "where", where, jnp.shape(x))
        if self.axis is not None:
            check_axis(name, self.axis, jnp.shape(x), "x")

    def _tangent_in(self, args: tuple[Any, ...], t: Any, dtype: Any) -> Any:
        """The tangent of `x` in `dtype`, selected to 0 at the masked-out entries
        (which take no part: an inf or NaN tangent there changes nothing)."""
        where = args[1] if len(args) > 1 else None
        t = t.astype(dtype)
        return t if where is None else jnp.where(where, t, zeros(t))

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[_RowRule]:
        return [cls(), cls(axis=0)]


class SafeSoftmax(_RowRule):
    r"""The softmax along `axis` over the entries `where` holds, which is 0, with a
    zero derivative, on a row with nothing in it.

    With $m$ = `where` (all true by default), on a row with an unmasked entry
    above $-\infty$,

    $$y_i = \frac{[m_i]\, e^{x_i}}{\sum_j [m_j]\, e^{x_j}}, \qquad
    \dot y_i = y_i \Bigl(t_i - \sum_j y_j t_j\Bigr),$$

    `jax.nn.softmax(x, axis=axis, where=where)`'s value (within 4 ulps) and
    derivative. A row whose unmasked entries are all $-\infty$, or that has none
    (a padded sequence, a fully masked attention row), gives zeros, with a zero
    derivative in both modes and a finite (zero) Hessian: PyTorch's
    `_safe_softmax` convention, where `jax.nn.softmax` gives NaN for a row of
    $-\infty$ (masking logits with $-\infty$ is the common way; JAX #6811). A
    masked-out entry gives 0, and its tangent is selected away: a NaN or inf
    there changes nothing. A NaN in an unmasked entry makes its row NaN, value
    and derivative; so does $+\infty$ (as `jax.nn.softmax`).

    bfloat16 and float16 are computed in float32 and cast back.

    **Arguments:**

    - `axis`: an int, a non-empty tuple of ints, or `None` (every axis): the
        axes a row runs along.

    Called as `m(x)` or `m(x, where)`, with `where` a boolean array that
    broadcasts to `x` (`True` for the entries that take part).

    !!! Example

        ```python
        x = jnp.array([[1.0, 2.0], [-jnp.inf, -jnp.inf]])
        jax.jacrev(eqxrules.safe_softmax)(x)[1]  # zeros, where jax.nn.softmax is NaN
        ```
    """

    summary: ClassVar[str] = (
        "softmax(x) along `axis` over the entries `where` holds; derivative "
        "`y(t − Σ y t)`; a row with none above −inf gives 0, derivative 0"
    )

    def primal(
        self, x: Float[Array, "*shape"], where: Bool[Array, "*m"] | None = None
    ) -> Float[Array, "*shape"]:
        w = x.astype(wide(x.dtype))
        m = jnp.max(_masked(w, where), axis=self.axis, keepdims=True)
        # An empty row is shifted by 0, not by its max (-inf): its entries are
        # then `exp(-inf) = 0`, summing to 0, which is divided as 1.
        e = jnp.exp(_masked(w, where) - jnp.where(m == _NEG_INF, 0, m))
        s = jnp.sum(e, axis=self.axis, keepdims=True)
        y = e / jnp.where(s == 0, 1, s)
        # A masked-out entry is 0, also in a row that is NaN (as jax.nn.softmax).
        y = y if where is None else jnp.where(where, y, zeros(y))
        return y.astype(x.dtype)

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        **kwargs: Any,
    ) -> Any:
        t = t_args[0]
        if t is None:
            return None
        # `y` is 0 on an empty row (and at masked-out entries), so is its tangent;
        # `out` is the rule's own value, so the second derivative (this tangent's
        # derivative) goes through this rule again: finite there too.
        y = out.astype(wide(out.dtype))
        t = self._tangent_in(args, t, y.dtype)
        dy = y * (t - jnp.sum(y * t, axis=self.axis, keepdims=True))
        # A masked-out entry's value is the constant 0, also in a row that is NaN
        # (as jax.nn.softmax's): its tangent is selected to 0, not `0 · NaN`.
        where = args[1] if len(args) > 1 else None
        dy = dy if where is None else jnp.where(where, dy, zeros(dy))
        return dy.astype(out.dtype)

    def reference_forward(self, x: Array, where: Array | None = None) -> Array:
        """The double where around `jax.nn.softmax`: an empty row is fed 0 with
        every entry taking part (no NaN), and its value selected to 0."""
        w = x.astype(wide(x.dtype))
        empty = _empty(w, where, self.axis)
        taken = ~empty if where is None else where & ~empty
        fed = jnp.where(taken, w, 0)
        y = jax.nn.softmax(fed, axis=self.axis, where=taken | empty)
        return jnp.where(empty, 0, y).astype(x.dtype)

    def reference_derivative(self, x: Array, where: Array | None = None) -> Array:
        return self.reference_forward(x, where)


@functional(SafeSoftmax)
def safe_softmax(
    x: Float[ArrayLike, "*shape"],
    axis: int | tuple[int, ...] | None = -1,
    where: Bool[ArrayLike, "*m"] | None = None,
) -> Array:
    return SafeSoftmax(axis)(x, where)


class SafeLogsumexp(_RowRule):
    r"""$\log \sum e^{x}$ along `axis` over the entries `where` holds, which is
    $-\infty$, with a zero derivative, on a row with nothing in it.

    With $m$ = `where` (all true by default),

    $$\ell = \log \sum_j [m_j]\, e^{x_j}, \qquad
    \dot\ell = \sum_j y_j t_j, \quad y = \mathrm{softmax}_m(x),$$

    the derivative being [`SafeSoftmax`][]'s value (but on a row holding
    $+\infty$: see below). The value is
    `jax.nn.logsumexp(x, axis=axis, where=where)`'s wherever that is finite
    (within 4 ulps), including entries of magnitude up to `1e30` in float32
    (the largest entry is subtracted before `exp`, and its softmax computed
    likewise, not as $e^{x - \ell}$, which loses it). A row whose unmasked
    entries are all $-\infty$, or that has none, gives $-\infty$ with a zero
    derivative in both modes (its softmax is 0) and a finite (zero) Hessian,
    where `jax.grad(jax.nn.logsumexp)` is NaN (JAX #6811). A NaN in an unmasked
    entry makes its row NaN, value and derivative; a $+\infty$ gives $+\infty$,
    with a NaN derivative at that entry and 0 at the others, as JAX's.

    bfloat16 and float16 are computed in float32 and cast back.

    **Arguments:**

    - `axis`: an int, a non-empty tuple of ints, or `None` (every axis): the
        axes reduced.

    Called as `m(x)` or `m(x, where)`, with `where` a boolean array that
    broadcasts to `x` (`True` for the entries that take part).

    !!! Example

        ```python
        x = jnp.array([-jnp.inf, -jnp.inf])
        eqxrules.safe_logsumexp(x), jax.grad(eqxrules.safe_logsumexp)(x)  # -inf, [0, 0]
        ```
    """

    summary: ClassVar[str] = (
        "log Σ exp(x) along `axis` over the entries `where` holds; derivative "
        "`Σ softmax(x) t`; a row with none above −inf gives −inf, derivative 0"
    )

    def _exp(self, w: Array, where: Array | None) -> tuple[Array, Array, Array]:
        """`(e, s, shift)`: `e = exp(x - shift)` at the unmasked entries (0 at the
        others) and its sum `s` along the row, `shift` the row's max where it is
        finite (as jax.nn.logsumexp), else 0, held constant. An empty row sums to 0
        (its log is -inf), a row holding +inf to +inf."""
        m = jnp.max(_masked(w, where), axis=self.axis, keepdims=True)
        shift = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0))
        e = jnp.exp(_masked(w, where) - shift)
        return e, jnp.sum(e, axis=self.axis, keepdims=True), shift

    def primal(
        self, x: Float[Array, "*shape"], where: Bool[Array, "*m"] | None = None
    ) -> Array:
        _, s, shift = self._exp(x.astype(wide(x.dtype)), where)
        return jnp.reshape(jnp.log(s) + shift, self._out_shape(x)).astype(x.dtype)

    def _out_shape(self, x: Array) -> tuple[int, ...]:
        return jax.eval_shape(lambda x: jnp.sum(x, axis=self.axis), x).shape

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        **kwargs: Any,
    ) -> Any:
        t = t_args[0]
        if t is None:
            return None
        x = args[0]
        w = x.astype(wide(x.dtype))
        # The softmax as `e/s` from the value's own sums (XLA computes them once),
        # not `exp(x - ℓ)`, which is 1 for every entry near the max where `ℓ`
        # rounds to it (entries of 1e30). An empty row has `s = 0`, fed 1: its
        # softmax is 0, and so are this tangent and its own derivative (the
        # Hessian, which JAX takes of this function). A row holding +inf has a NaN
        # softmax at that entry and 0 at the others (the limit), as JAX's.
        e, s, _ = self._exp(w, args[1] if len(args) > 1 else None)
        y = e / jnp.where(s == 0, 1, s)
        dot = jnp.sum(y * self._tangent_in(args, t, w.dtype), axis=self.axis)
        return jnp.reshape(dot, out.shape).astype(out.dtype)

    def input_domain(self) -> Any:
        """The class's domain, with `where` of size 1 along the axes kept: every
        row then holds `where`'s first element, which `Mask` draws `True`, so
        that no random input has an empty row, whose value is -inf (where central
        differences are NaN). Its degenerate inputs still hold the all-`False`
        mask, every row empty."""
        x, where = type(self).domain.domains
        shape = kept_shape(x.shape, self.axis)
        keep = tuple(n if k == 1 else 1 for n, k in zip(x.shape, shape))
        return Inputs(x=x, where=Mask(keep))

    def reference_forward(self, x: Array, where: Array | None = None) -> Array:
        w = x.astype(wide(x.dtype))
        return jax.nn.logsumexp(w, axis=self.axis, where=where).astype(x.dtype)

    def reference_derivative(self, x: Array, where: Array | None = None) -> Array:
        """The double where around `jax.nn.logsumexp`: an empty row is fed 0 with
        every entry taking part, and its value selected to the constant -inf."""
        w = x.astype(wide(x.dtype))
        empty = _empty(w, where, self.axis)
        taken = ~empty if where is None else where & ~empty
        fed = jnp.where(taken, w, 0)
        lse = jax.nn.logsumexp(fed, axis=self.axis, where=taken | empty, keepdims=True)
        out = jnp.where(empty, _NEG_INF, lse)
        return jnp.reshape(out, self._out_shape(x)).astype(x.dtype)


@functional(SafeLogsumexp)
def safe_logsumexp(
    x: Float[ArrayLike, "*shape"],
    axis: int | tuple[int, ...] | None = -1,
    where: Bool[ArrayLike, "*m"] | None = None,
) -> Array:
    return SafeLogsumexp(axis)(x, where)
