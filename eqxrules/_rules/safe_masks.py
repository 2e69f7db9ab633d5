r"""The NaN-safe divisions and masks: [`SafeDivide`][], [`SafeWhere`][] (the double
where as one call) and [`SafeXlogy`][] (`x log y`, 0 where `x` is). What the
NaN-safe rules share is in `_safe`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray

from .._catalogue import Domain, JVPRule, functional
from .._domain import Inputs, Mask
from .._hyper import finite, function, hyperparameter
from .._tangents import call_with_key, partial_jvp
from ._safe import check_inputs, float_dtype, pow2, wide, widened, zeros


class SafeDivide(JVPRule):
    r"""`a / b`, which is 0, with zero derivatives in `a` and `b`, where `b` is 0.

    $$q = \begin{cases} a / b & b \neq 0 \\ 0 & b = 0 \end{cases}, \qquad
    \dot q = \begin{cases} (\dot a - q\,\dot b) / b & b \neq 0 \\
    0 & b = 0 \end{cases}$$

    with `a` and `b` broadcast together. Where `b == 0` ($-0.0$ counts) the value
    is 0 and every derivative, in `a` and in `b`, of every order, in both modes,
    is 0, *whatever `a` is*: a NaN or inf in `a` there is hidden (selected away,
    in the value and in the derivatives). Elsewhere the value is `a / b` (to 4
    ulps), and a NaN in `a` or `b` stays in its own element only. The plain
    `jnp.where(b == 0, 0, a / b)` has the right value but a NaN derivative in `b`
    (and an inf one in `a`) where `b == 0`.

    The dtype is that of `a` and `b` together (`jnp.result_type`); bfloat16 and
    float16 are computed in float32 and cast back.

    !!! Example

        ```python
        eqxrules.SafeDivide()(jnp.array([1.0, 2.0]), jnp.array([2.0, 0.0]))  # [0.5, 0]
        ```
    """

    elementwise: ClassVar[bool] = False
    exact: ClassVar[bool] = True
    domain: ClassVar[Any] = Inputs(a=Domain(), b=Domain(kinks=(0.0,)))

    summary: ClassVar[str] = (
        "a/b; derivative `(ȧ − q ḃ)/b`, value and derivatives 0 where b = 0"
    )

    def _check_call(self, args: tuple[Any, ...]) -> None:
        check_inputs(self.rule_name(), args, {"a": "float", "b": "float"})

    def primal(self, a: Float[Array, "*a"], b: Float[Array, "*b"]) -> Array:
        dtype = float_dtype(a, b)
        wa, wb = jnp.asarray(a, wide(dtype)), jnp.asarray(b, wide(dtype))
        zero = wb == 0
        q = wa / jnp.where(zero, 1, wb)
        return jnp.where(zero, zeros(q), q).astype(dtype)

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        **kwargs: Any,
    ) -> Any:
        (_, b), (t_a, t_b) = args, t_args
        if t_a is None and t_b is None:
            return None
        w = wide(out.dtype)
        wb = jnp.asarray(b, w)
        zero = wb == 0
        # `(ȧ − q ḃ) / b`. The slope `1/b` is 0 where `b` is: `b` is fed 1 there,
        # so no `0/0` in it nor in its own derivative (second order). Where it is 0
        # (`b == 0`, or the limit `b` infinite) the tangent is selected, never
        # multiplied, as an elementwise rule's: an inf or NaN tangent or cotangent
        # there gives 0. One select for both inputs (measured: flops 0.67x and temp
        # bytes 1.0x the hand-written double where, against 1.10x and 2.0x with a
        # select per input).
        s = jnp.where(zero, jnp.zeros_like(wb), 1 / jnp.where(zero, 1, wb))
        num = jnp.zeros(out.shape, w)
        if t_a is not None:
            num = num + t_a.astype(w)
        if t_b is not None:
            num = num - out.astype(w) * t_b.astype(w)
        return jnp.where(s == 0, jnp.zeros_like(num), num * s).astype(out.dtype)

    def reference_forward(self, a: Array, b: Array) -> Array:
        dtype = float_dtype(a, b)
        wa, wb = jnp.asarray(a, wide(dtype)), jnp.asarray(b, wide(dtype))
        return jnp.where(wb == 0, 0, wa / wb).astype(dtype)

    def reference_derivative(self, a: Array, b: Array) -> Array:
        """`(a·2^-e) / f` with `b = f·2^e` (`frexp`; the power of two held
        constant): the same quotient, exactly, whose plain derivative in `b`,
        `-(a·2^-e)/f² · 2^-e`, squares a number of order 1 where `-a/b²` would
        square `b` (and overflow at `b` near 1e-32, making `0 · inf` of a zero
        derivative). 0 where `b` is, with zero derivatives (for a finite `a`)."""
        dtype = float_dtype(a, b)
        wa, wb = jnp.asarray(a, wide(dtype)), jnp.asarray(b, wide(dtype))
        zero = wb == 0
        info = jnp.finfo(wb.dtype)
        _, e = jnp.frexp(jax.lax.stop_gradient(jnp.where(zero, 1, wb)))
        k = pow2(-jnp.clip(e, info.minexp + 2, info.maxexp - 2), wb.dtype)
        q = (wa * k) / jnp.where(zero, 1, wb * k)
        return jnp.where(zero, jnp.zeros_like(q), q).astype(dtype)


@functional(SafeDivide)
def safe_divide(a: Float[ArrayLike, "*a"], b: Float[ArrayLike, "*b"]) -> Array:
    return SafeDivide()(a, b)


class SafeWhere(JVPRule):
    r"""`where(mask, fn(x), otherwise)`, whose value and derivatives never see
    `fn` at the masked-out points: the "double where" trick as one call.

    With $m$ = `mask` and $\tilde x = \operatorname{where}(m, x, c)$ ($c$ = `fill`),

    $$y = \begin{cases} f(x) & m \\ o & \neg m \end{cases}, \qquad
    \dot y = \begin{cases} f'(x)\,\dot x + \partial_\theta f(x)\,\dot\theta & m \\
    \dot o & \neg m \end{cases}$$

    where $o$ = `otherwise` and $\theta$ the parameters of `fn` (an `eqx.Module`).
    `fn` is evaluated on $\tilde x$ only, so its NaN or inf at a masked-out `x`
    (`log` of a negative, `1/x` at 0) never reaches the value, nor any derivative
    in `x` or `otherwise`, of any order, in either mode. Where the mask holds,
    `fn`'s own derivative applies, NaN included: a NaN `x` there stays visible,
    as does a NaN `otherwise` where the mask does not hold. The plain
    `jnp.where(mask, fn(x), otherwise)` has the right value and a NaN derivative
    in `x` wherever `fn`'s derivative is not finite at a masked-out point
    (`0 · inf`).

    **Derivatives in `fn`'s own parameters** sum over every element, so `fn` must
    be finite, with finite derivatives, at `fill`: the masked-out points
    contribute $\partial_\theta f(c) \cdot 0$, which is NaN where
    $\partial_\theta f(c)$ is not finite. Choose `fill` inside `fn`'s domain (the
    default 1 suits `log`, `sqrt`, `1/x`, `log1p`, `arccos`'s inverse, ...).

    !!! warning "`fn` must be elementwise"

        Each element of `fn(x)` must depend on the same element of `x` alone, as
        `jnp.log` or `lambda x: 2 * x**2` do. A function that mixes elements
        (`jnp.cumsum`, `x - x.mean()`, a softmax) would see `fill` in place of
        the masked-out elements, and give another value than `jnp.where` does:
        mask out the elements it must not see in its own input instead. What
        can be checked when `safe_where` is traced is an error (a `ValueError`
        naming `fn`): an output of another shape than `x` (`jnp.sum`), and a
        function that, given one element alone (a 0-d array), fails or gives an
        array of another shape (`jnp.cumsum` gives shape `(1,)`). A function
        that mixes elements and keeps shapes (`x - x.mean()`) cannot be told
        from an elementwise one there.

    `x`, `mask` and `otherwise` broadcast together (a 0-d `otherwise` is the
    usual case, a Python `int` or `float` as for `jnp.where`). The output has
    the dtype of `fn(x)` and `otherwise` together.

    **Arguments:**

    - `fn`: an elementwise callable: a function or an `eqx.Module` (whose
        parameters get their derivatives).
    - `fill`: where `fn` is evaluated at the masked-out points: a finite number at
        which `fn` and its derivatives are finite.

    !!! Example

        ```python
        x = jnp.array([-1.0, 0.0, 2.0])
        f = lambda x: eqxrules.safe_where(x > 0, jnp.log, x, 0.0).sum()
        jax.grad(f)(x)  # [0, 0, 0.5], where the plain jnp.where gives NaN at 0
        ```
    """

    fn: Callable[[Array], Array] = hyperparameter(function, static=False)
    fill: float = hyperparameter(1.0, finite)

    elementwise: ClassVar[bool] = False
    exact: ClassVar[bool] = True
    domain: ClassVar[Any] = Inputs(
        mask=Mask(), x=Domain(low=0.25, high=2.0), otherwise=Domain(shape=())
    )

    summary: ClassVar[str] = (
        "`where(mask, fn(x), otherwise)`; `fn` evaluated at `fill` where the mask "
        "is false, so its NaN there reaches no derivative"
    )

    def _check_call(self, args: tuple[Any, ...]) -> None:
        kinds = {"mask": "bool", "x": "float", "otherwise": "number"}
        check_inputs(self.rule_name(), args, kinds)

    def _inside(self, mask: Array, x: Array) -> Array:
        """`x` where the mask holds, `fill` elsewhere, in `x`'s shape broadcast with
        the mask's."""
        shape = jnp.broadcast_shapes(jnp.shape(mask), jnp.shape(x))
        x = jnp.broadcast_to(x, shape)
        return jnp.where(mask, x, jnp.asarray(self.fill, x.dtype))

    def _select(self, mask: Array, inside: Array, otherwise: Array) -> Array:
        dtype = jnp.result_type(inside, otherwise)
        return jnp.where(mask, inside.astype(dtype), jnp.asarray(otherwise, dtype))

    def primal(
        self,
        mask: Bool[Array, "*m"],
        x: Float[Array, "*x"],
        otherwise: Array,
        *,
        key: PRNGKeyArray | None = None,
    ) -> Array:
        inside = self._inside(mask, x)
        fx = call_with_key(self.fn, inside, key)
        self._check_elementwise(inside, fx, key)
        return self._select(mask, fx, otherwise)

    def _check_elementwise(self, inside: Array, fx: Any, key: Any) -> None:
        """A `ValueError` naming `fn` where it is not elementwise by what shapes
        can tell: `fn(x)` of another shape than `x`, or `fn` of one element (a
        0-d array, traced only) failing or of a shape other than `()` or a
        trailing part of `x`'s (a closed-over array of parameters, one per
        element)."""
        name, shape = self.rule_name(), tuple(inside.shape)
        must = (
            f"`{name}`: `fn` must be elementwise (each output element a function "
            "of the same element of `x` alone)"
        )
        if tuple(jnp.shape(fx)) != shape:
            raise ValueError(
                f"{must}, but it maps `x` of shape {shape} to shape "
                f"{tuple(jnp.shape(fx))}."
            )
        one = jax.ShapeDtypeStruct((), inside.dtype)
        try:
            alone = jax.eval_shape(lambda v: call_with_key(self.fn, v, key), one)
        except Exception as e:  # noqa: BLE001  (re-raised with what must hold)
            raise ValueError(
                f"{must}, but given one element alone (a 0-d array) it raised "
                f"{type(e).__name__}: {e}"
            ) from e
        got = tuple(jnp.shape(alone))
        if len(got) > len(shape) or got != shape[len(shape) - len(got) :]:
            raise ValueError(
                f"{must}, but given one element alone (a 0-d array) it gives shape "
                f"{got}: it does not treat each element on its own "
                f"(`x` of shape {shape})."
            )

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        **kwargs: Any,
    ) -> Any:
        (mask, x, _), (_, t_x, t_o) = args, t_args
        t_fn = None if t_self is None else t_self.fn
        inside = self._inside(mask, x)
        t_inside = None
        if t_x is not None:
            t_x = jnp.broadcast_to(t_x.astype(x.dtype), inside.shape)
            t_inside = jnp.where(mask, t_x, jnp.zeros_like(t_x))
        # `fn`'s own JVP, at `fill` on the masked-out points (finite there), where
        # it is then selected away: no `0 · inf`, in either mode.
        key = kwargs.get("key")
        t_f = partial_jvp(
            lambda fn, v: call_with_key(fn, v, key), (self.fn, inside), (t_fn, t_inside)
        )
        if t_f is None and t_o is None:
            return None
        zeros = jnp.zeros(out.shape, out.dtype)
        t_f = zeros if t_f is None else t_f.astype(out.dtype)
        t_o = zeros if t_o is None else jnp.asarray(t_o).astype(out.dtype)
        return jnp.broadcast_to(jnp.where(mask, t_f, t_o), out.shape)

    def reference_forward(
        self,
        mask: Array,
        x: Array,
        otherwise: Array,
        *,
        key: PRNGKeyArray | None = None,
    ) -> Array:
        return self._select(mask, call_with_key(self.fn, x, key), otherwise)

    def reference_derivative(
        self,
        mask: Array,
        x: Array,
        otherwise: Array,
        *,
        key: PRNGKeyArray | None = None,
    ) -> Array:
        """The double-where trick written out: its plain derivative is the rule's."""
        safe = jnp.where(mask, x, self.fill)
        return self._select(mask, call_with_key(self.fn, safe, key), otherwise)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[SafeWhere]:
        return [cls(jnp.log), cls(_ScaledLog(jnp.asarray(1.5)), fill=2.0)]


class _ScaledLog(eqx.Module):
    """`scale · log(x)`: an elementwise `fn` with a parameter, for the examples."""

    scale: Array

    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        return self.scale.astype(x.dtype) * jnp.log(x)


@functional(SafeWhere)
def safe_where(
    mask: Bool[ArrayLike, "*m"],
    fn: Callable[[Array], Array],
    x: Float[ArrayLike, "*x"],
    otherwise: ArrayLike,
    *,
    fill: float = 1.0,
) -> Array:
    return SafeWhere(fn, fill=fill)(mask, x, otherwise)


class SafeXlogy(JVPRule):
    r"""`x · log(y)`, which is 0 where `x` is 0, with derivatives finite (0) at
    $(0, 0)$: entropy and cross-entropy of distributions with zeros.

    $$q = \begin{cases} x \log y & (x, y) \neq (0, 0) \\ 0 & (x, y) = (0, 0)
    \end{cases}, \qquad
    \dot q = \begin{cases} \dot x \log y + \dot y\, x / y & (x, y) \neq (0, 0)
    \\ 0 & (x, y) = (0, 0) \end{cases}$$

    with `x` and `y` broadcast together. The value is 0 wherever `x == 0` ($-0.0$
    counts) and `y` is finite and non-negative: $0 \log 0 = 0$, so that
    $-\sum_i p_i \log p_i$ is the entropy of a distribution with zeros. The
    derivative in `x` is $\log y$, in `y` it is $x / y$, which is 0 wherever `x`
    is; at $(0, 0)$ both are 0, and so is every higher derivative, in both
    modes. The plain `x * jnp.log(y)` behind
    `jnp.where(x == 0, 0, ...)`, and `jax.scipy.special.xlogy`, give $(-\infty,
    \mathrm{NaN})$ there. With these conventions the entropy
    $-\sum_i \mathrm{xlogy}(p_i, p_i)$ has the gradient $-(\log p_i + 1)$ where
    $p_i > 0$ and 0 where $p_i = 0$, and a finite Hessian ($-1/p_i$, and 0).

    Elsewhere values and derivatives are the plain formula's: $x \log 0$ is
    $\mp\infty$ for $x \gtrless 0$, with infinite derivatives, as it should be
    (a cross-entropy that puts zero probability on an observed outcome); and
    $0 \cdot \log y$ is NaN for a negative or infinite `y`, where it has no
    value (`scipy.special.xlogy` gives 0 there: a negative probability is a bug
    upstream that a 0 would hide, as [`SafeSqrt`][] keeps `sqrt`'s NaN). A NaN
    in `x` or `y` makes its element's value NaN, and a NaN `y` its derivatives
    too (the derivative in `x`, $\log y$, does not depend on `x`).

    The dtype is that of `x` and `y` together (`jnp.result_type`); bfloat16 and
    float16 are computed in float32 and cast back.

    !!! Example

        ```python
        p = jnp.array([0.5, 0.5, 0.0])
        jax.grad(lambda p: -eqxrules.safe_xlogy(p, p).sum())(p)  # [-0.31, -0.31, 0]
        ```
    """

    elementwise: ClassVar[bool] = False
    exact: ClassVar[bool] = True
    domain: ClassVar[Any] = Inputs(
        x=Domain(kinks=(0.0,)), y=Domain(low=0.0, high=2.0, kinks=(0.0,))
    )

    summary: ClassVar[str] = (
        "x·log(y), 0 where x = 0; derivatives `log y` and `x/y`, 0 at (0, 0)"
    )

    def _check_call(self, args: tuple[Any, ...]) -> None:
        check_inputs(self.rule_name(), args, {"x": "float", "y": "float"})

    def _log_y(self, wx: Array, wy: Array) -> tuple[Array, Array, Array]:
        """`(x == 0 and y == 0, y fed 1 there, its log)`: what the value and the
        tangent share (XLA computes them once)."""
        both = (wx == 0) & (wy == 0)
        y1 = jnp.where(both, 1, wy)
        return both, y1, jnp.log(y1)

    def primal(self, x: Float[Array, "*x"], y: Float[Array, "*y"]) -> Array:
        dtype, (wx, wy) = widened(x, y)
        # `0 · log 1 = 0` at (0, 0); elsewhere the plain product.
        return (wx * self._log_y(wx, wy)[2]).astype(dtype)

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        **kwargs: Any,
    ) -> Any:
        (x, y), (t_x, t_y) = args, t_args
        if t_x is None and t_y is None:
            return None
        w = wide(out.dtype)
        wx, wy = jnp.asarray(x, w), jnp.asarray(y, w)
        both, y1, log_y = self._log_y(wx, wy)
        # At (0, 0) no `log 0` or `0/0` reaches this or its own derivative (second
        # order). Elsewhere the slopes multiply: `log y` is 0 at `y = 1` and
        # `x/y` at `x = 0` as smooth functions, whose own derivatives (the mixed
        # second derivative `1/y`) a select would lose.
        num = jnp.zeros(out.shape, w)
        if t_x is not None:
            num = num + t_x.astype(w) * log_y
        if t_y is not None:
            # `1/y`, fed inf at (0, 0): 0 there, with every derivative (so the
            # mixed second derivative is 0 there, as that of `log y`); and 0 at
            # `y = ±inf`. Where it is 0 the tangent is selected, not multiplied.
            r = 1 / jnp.where(both, jnp.inf, wy)
            # `x · (t/y)` as plain autodiff orders it: `x/y` first overflows for
            # `x` near float32's largest and `y` below 1 (`t` is usually smaller).
            by_y = wx * (t_y.astype(w) * r)
            num = num + jnp.where(r == 0, zeros(by_y), by_y)
        return num.astype(out.dtype)

    def reference_forward(self, x: Array, y: Array) -> Array:
        dtype, (wx, wy) = widened(x, y)
        both = (wx == 0) & (wy == 0)
        return jnp.where(both, 0, wx * jnp.log(wy)).astype(dtype)

    def reference_derivative(self, x: Array, y: Array) -> Array:
        """The double where: `x log y` with `y` fed 1 at (0, 0), selected away there;
        its plain derivative is the rule's."""
        dtype, (wx, wy) = widened(x, y)
        both = (wx == 0) & (wy == 0)
        q = wx * jnp.log(jnp.where(both, 1, wy))
        return jnp.where(both, zeros(q), q).astype(dtype)
