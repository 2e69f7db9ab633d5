r"""The NaN-safe norms: [`SafeNorm`][], [`SafeNormalize`][] and [`SafeSqrt`][] (the
norm of one element). What the NaN-safe rules share is in `_safe`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._catalogue import Domain
from .._hyper import axis_indices, boolean, hyperparameter
from ._safe import (
    Axis,
    _Reduction,
    _Safe,
    power_of_two_near,
    safe_inverse,
    wide,
    zeros,
)


def _scaled_norm(w: Array, axis: Axis) -> Array:
    """The Euclidean norm of `w` (float32 or float64) along `axis`, kept dims.

    `w` is scaled by a power of two $p$ near its slice's largest magnitude before
    squaring, and the norm scaled back. A power of two scales every square and the
    square root exactly (the scale of a square is an even power), so where the
    plain sum of squares neither overflows nor underflows this is the plain
    `sqrt(sum(w**2))` bit for bit; beyond, it stays finite and accurate. $p$ is
    clipped to $[2^{-126}, 2^{126}]$ (float32; float64 likewise) so that $p$ and
    $1/p$ are both normal: a zero slice gets the smallest (its squares stay 0), an
    inf or NaN the largest (the inf or NaN stays)."""
    p, r = _scaled(w, axis)
    return r * p


def _scaled(w: Array, axis: Axis) -> tuple[Array, Array]:
    """`(p, r)` with the norm `r · p` (`_scaled_norm`): `p` the power of two, `r`
    the norm of `w / p`, finite wherever `w` is."""
    m = jnp.max(jnp.abs(w), axis=axis, keepdims=True, initial=0)
    p = power_of_two_near(m)
    s = jnp.sum(jnp.square(w * (1 / p)), axis=axis, keepdims=True)
    return p, jnp.sqrt(s)


def _unit(w: Array, axis: Axis) -> Array:
    """`w / ‖w‖` as `(w / p) / r` (`_scaled`), 0 on a zero slice: bit for bit
    `w / ‖w‖` where the norm is finite (`p` a power of two), and finite where the
    norm overflows (a float32 slice of 16 elements of 1e38 has the norm 4e38 > 3.4e38,
    yet its unit vector is 1/4 each)."""
    m = jnp.max(jnp.abs(w), axis=axis, keepdims=True, initial=0)
    u = w * (1 / power_of_two_near(m))
    s = jnp.sum(jnp.square(u), axis=axis, keepdims=True)
    # The double where: `sqrt`'s derivative at a zero slice's 0 is inf, which the
    # second derivative (this is the tangent's `y`) would meet.
    return u / jnp.sqrt(jnp.where(s == 0, 1, s))


def _reference_norm(w: Array, axis: Axis) -> Array:
    """Independently of `_scaled_norm`: `m · sqrt(sum((w/m)²))` with `m` the slice's
    largest magnitude itself (held constant), 0 on a zero slice: the classic
    overflow-safe norm, whose plain derivative is the double-where one."""
    m = jax.lax.stop_gradient(jnp.max(jnp.abs(w), axis=axis, keepdims=True))
    nonzero = m != 0
    # Above 1, `w` is divided by `m · 2⁻⁴⁰` rather than `m`: the tangents `t/m`
    # would fall below float32's smallest normal near `m = 1e38` (and flush to zero
    # where |t| < 1 but not elsewhere), while `w/m` of order 2⁴⁰ squares without
    # overflow.
    m = jnp.where(m > 1, m * 2.0**-40, m)
    m_safe = jnp.where(nonzero, m, 1)
    s = jnp.sum(jnp.square(w / m_safe), axis=axis, keepdims=True)
    # A NaN slice has `m` NaN: not zero, so its NaN reaches value and derivative.
    s_safe = jnp.where(nonzero, s, 1)
    return jnp.where(nonzero, m_safe * jnp.sqrt(s_safe), 0 * s)


class SafeNorm(_Reduction):
    r"""The Euclidean norm, whose derivative is finite (zero) at a zero vector.

    Along `axis` (all axes for `None`),

    $$n = \lVert x \rVert = \sqrt{\textstyle\sum_i x_i^2}, \qquad
    \dot n = \begin{cases} \langle x, t \rangle / n & n \neq 0 \\
    0 & x = 0 \end{cases}$$

    On an all-zero slice ($-0.0$ counts as zero) the value is 0 and the derivative
    is 0 in both modes: the minimum-norm subgradient of the norm there (the plain
    `jnp.linalg.norm` gives NaN). Second derivatives are $(I - u u^\top)/n$ with
    $u = x/n$ away from zero and 0 on a zero slice, finite in every mode, and
    right at every scale where they are finite in float32 ($n$ from about
    $10^{-38}$ to $10^{38}$): they are [`SafeNormalize`][]'s Jacobian, which
    never squares $n$.

    Where the sum of squares neither overflows nor underflows, the value is
    `jnp.linalg.norm`'s bit for bit (up to summation order: within 4 ulps).
    Beyond, `x` is scaled by a power of two near its largest magnitude, so the norm
    of float32 entries around `1e30` or `1e-30` is finite and correct where
    `jnp.linalg.norm` gives inf or 0. A NaN makes its slice's value and derivative
    NaN, and no other slice's.

    **Arguments:**

    - `axis`: an int, a non-empty tuple of ints, or `None` (every axis).
    - `keepdims`: whether the reduced axes are kept, with size 1.

    !!! Example

        ```python
        jax.grad(eqxrules.safe_norm)(jnp.zeros(3))  # [0, 0, 0], not NaN
        ```
    """

    axis: int | tuple[int, ...] | None = hyperparameter(
        None, axis_indices, allow_none=True, positional=True
    )
    keepdims: bool = hyperparameter(False, boolean, positional=True)

    summary: ClassVar[str] = (
        "‖x‖ along `axis`; derivative `⟨x, t⟩/‖x‖`, 0 on a zero slice"
    )

    def primal(self, x: Float[Array, "*shape"]) -> Array:
        n = _scaled_norm(x.astype(wide(x.dtype)), self.axis).astype(x.dtype)
        return n if self.keepdims else jnp.reshape(n, self._out_shape(x))

    def _out_shape(self, x: Array) -> tuple[int, ...]:
        return jax.eval_shape(
            lambda x: jnp.sum(x, axis=self.axis, keepdims=self.keepdims), x
        ).shape

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        **kwargs: Any,
    ) -> Any:
        (x,), (t,) = args, t_args
        if t is None:
            return None
        w = x.astype(wide(x.dtype))
        # `u = x/‖x‖` through its own rule, 0 on a zero slice (whose tangent is
        # then 0). The derivative of this tangent (the second derivative, which
        # JAX takes of this function) is then `SafeNormalize`'s, `(t − u⟨u, t⟩)/n`:
        # it never squares `n`, which is inf for `n` near 1e-20 and 0 near 1e20 in
        # float32, where the Hessian `(I − u uᵀ)/n` is finite.
        axes = tuple(range(w.ndim)) if self.axis is None else self.axis
        if w.ndim == 0:  # the norm of a number, `|x|`: along an axis of one
            u = jnp.reshape(SafeNormalize(0)(jnp.reshape(w, (1,))), ())
        else:
            u = SafeNormalize(axes)(w)
        dot = jnp.sum(u * t.astype(w.dtype), axis=self.axis, keepdims=True)
        return jnp.reshape(dot, out.shape).astype(x.dtype)

    def reference_forward(self, x: Array) -> Array:
        n = _reference_norm(x.astype(wide(x.dtype)), self.axis).astype(x.dtype)
        return n if self.keepdims else jnp.reshape(n, self._out_shape(x))

    def reference_derivative(self, x: Array) -> Array:
        return self.reference_forward(x)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[SafeNorm]:
        return [cls(), cls(axis=-1, keepdims=True)]


class SafeNormalize(_Reduction):
    r"""`x / ‖x‖` along `axis`, which is 0, with a zero Jacobian, on a zero slice.

    With $n = \lVert x \rVert$ along `axis` ([`SafeNorm`][]) and $y = x / n$,

    $$y = \begin{cases} x / n & n \neq 0 \\ 0 & x = 0 \end{cases}, \qquad
    \dot y = \begin{cases} (t - y \langle y, t \rangle) / n & n \neq 0 \\
    0 & x = 0. \end{cases}$$

    The plain `x / jnp.linalg.norm(x)` is NaN at zero, in value and derivative.
    Here every derivative of every order is finite there (and 0), in both modes;
    the norm is scaled as [`SafeNorm`][]'s, so `x` of float32 magnitude `1e30` or
    `1e-30` is normalised correctly. Elsewhere the value is the plain formula's
    (within 4 ulps). A NaN makes its slice NaN, value and derivative, and no other.

    **Arguments:**

    - `axis`: an int or a non-empty tuple of ints, the axes normalised over.

    !!! Example

        ```python
        eqxrules.safe_normalize(jnp.array([[3.0, 4.0], [0.0, 0.0]]))
        # [[0.6, 0.8], [0, 0]]
        ```
    """

    axis: int | tuple[int, ...] = hyperparameter(-1, axis_indices, positional=True)

    summary: ClassVar[str] = (
        "x/‖x‖ along `axis`; derivative `(t − y⟨y, t⟩)/‖x‖`, 0 on a zero slice"
    )

    def primal(self, x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        return _unit(x.astype(wide(x.dtype)), self.axis).astype(x.dtype)

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        **kwargs: Any,
    ) -> Any:
        (x,), (t,) = args, t_args
        if t is None:
            return None
        w = x.astype(wide(x.dtype))
        # The norm through its own rule: its derivative (taken for second order) is
        # then the safe one, 0 on a zero slice, not `sqrt`'s inf.
        n = SafeNorm(self.axis, True)(w)
        zero = n == 0
        # `1/n` per slice, 0 on a zero slice (whose tangent is then 0); `y`
        # recomputed from `x` rather than read from `out`: XLA then fuses the whole
        # tangent, and its transpose, into the passes over `x` (measured: temp
        # bytes 1.0x the hand-written double where, against 3.0x with `out` kept).
        inv = safe_inverse(n, zero)
        y, t = _unit(w, self.axis), t.astype(w.dtype)
        dy = (t - y * jnp.sum(y * t, axis=self.axis, keepdims=True)) * inv
        return dy.astype(x.dtype)

    def reference_forward(self, x: Array) -> Array:
        # `(x/m) / ‖x/m‖`, as `reference_derivative` (`x / ‖x‖` overflows its norm
        # where the unit vector is finite: 16 elements of 1e38).
        return self.reference_derivative(x)

    def reference_derivative(self, x: Array) -> Array:
        """`u / ‖u‖` with `u = x / m`, `m` the slice's largest magnitude (held
        constant): `u` and `‖u‖` are of order 1, so the plain derivative
        `(I − y yᵀ) / (m ‖u‖)` neither overflows nor underflows where `‖x‖²` would
        (a slice of magnitude 1e-30, say). 0 on a zero slice; NaN on a NaN one."""
        w = x.astype(wide(x.dtype))
        m = jax.lax.stop_gradient(jnp.max(jnp.abs(w), axis=self.axis, keepdims=True))
        zero = m == 0
        # Above 1, `x` is divided by `m · 2⁻⁴⁰` rather than `m`: the tangents `t/m`
        # would fall below float32's smallest normal near `m = 1e38` (and flush to
        # zero where |t| < 1 but not elsewhere), while `u` of order 2⁴⁰ squares
        # without overflow.
        u = w / jnp.where(zero, 1, jnp.where(m > 1, m * 2.0**-40, m))
        s = jnp.sum(jnp.square(u), axis=self.axis, keepdims=True)
        y = u / jnp.sqrt(jnp.where(zero, 1, s))
        return jnp.where(zero, 0 * w, y).astype(x.dtype)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[SafeNormalize]:
        return [cls(), cls(axis=0)]


class SafeSqrt(_Safe):
    r"""The square root, whose derivative at 0 is 0 instead of inf.

    $$y = \sqrt{x}, \qquad \dot y = \begin{cases} t / (2\sqrt{x}) & x > 0 \\
    0 & x = 0 \\ \mathrm{NaN} & x < 0 \end{cases}$$

    At 0 ($-0.0$ included) the value is 0 and the derivative is 0 in both modes, and
    so is every higher derivative. Why 0: any finite number is a convention there
    (the one-sided limit is $+\infty$); 0 is the minimum-norm subgradient of
    $\sqrt{x^2} = \lvert x \rvert$ (so it agrees with [`SafeNorm`][] of one
    element), it is the value the double-where trick gives (optax's `safe_norm`,
    jax-md's `safe_sqrt`), and it needs no dtype-dependent constant: a
    "largest finite slope" such as $1/(2\sqrt{\text{tiny}})$ is
    $1.8 \times 10^{19}$ in float32 and inf in float16.

    Negative inputs give NaN in value and derivative, as `jnp.sqrt`: a negative
    argument is a bug upstream (a variance that cancelled below zero, say), and a
    clamp would hide it. Clamp explicitly where that is intended:
    `safe_sqrt(jnp.maximum(x, 0))`.

    Elsewhere the value is `jnp.sqrt`'s and the derivative JAX's.

    !!! Example

        ```python
        jax.grad(eqxrules.safe_sqrt)(0.0)  # 0.0, where jax.grad(jnp.sqrt) is inf
        ```
    """

    summary: ClassVar[str] = "√x; derivative `t/(2√x)`, 0 at x = 0; NaN for x < 0"
    domain: ClassVar[Domain] = Domain(low=0.0, high=4.0, kinks=(0.0,))

    def primal(self, x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        return jnp.sqrt(x.astype(wide(x.dtype))).astype(x.dtype)

    def slope(self, x: Array) -> Array:
        x = jnp.asarray(x)  # under `grad`, a Python float arrives as `TypedFloat`
        w = x.astype(wide(x.dtype))
        zero = w == 0
        # Only 0 is selected away (fed 1): a negative or NaN `x` keeps `rsqrt`'s
        # NaN, in this slope and in its own derivative.
        slope = 0.5 * jax.lax.rsqrt(jnp.where(zero, 1, w))
        return jnp.where(zero, zeros(w), slope).astype(x.dtype)

    def reference_forward(self, x: Array) -> Array:
        w = x.astype(wide(x.dtype))  # `pow(-inf, 0.5)` is inf by IEEE, not NaN
        return jnp.where(w < 0, jnp.nan, jnp.power(w, 0.5)).astype(x.dtype)

    def reference_derivative(self, x: Array) -> Array:
        positive, negative = x > 0, ~(x >= 0)  # NaN is "negative": NaN derivative
        root = jnp.sqrt(jnp.where(positive, x, 1))
        below = jnp.sqrt(jnp.where(negative, x, 1))
        return jnp.where(positive, root, jnp.where(negative, below, 0 * x))
