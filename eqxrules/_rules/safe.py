r"""NaN-safe functions: the plain value, and a derivative that is finite at the
singular set where the plain one is inf or NaN (the norm of a zero vector, `sqrt`
at 0, `arccos` at $\pm 1$), by a convention each docstring states.

Each derivative is written with the "double where" trick: the singular branch is
fed a harmless input (`where(ok, x, 1)`) before the formula and selected away
after it, so no branch ever evaluates $0/0$ or $1/\sqrt{0}$. That holds in the
tangent function too, which JAX differentiates for second order (`jax.hessian`,
`jacrev(jacrev)`): every derivative of every order is finite at the singular set,
in both modes. A NaN input is never selected away: it stays NaN in the value and
the derivative of its own element (or slice, for a reduction), and nowhere else.

Values and derivatives of bfloat16 and float16 inputs are computed in float32 and
cast back; the conventions are constants (0) that no dtype overflows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray

from .._catalogue import Domain, ElementwiseRule, JVPRule, functional
from .._domain import Inputs, Mask
from .._hyper import axis_indices, boolean, finite, function, hyperparameter
from .._inputs import check_array, check_axis, check_float_array
from .._tangents import call_with_key, partial_jvp
from ._elementwise import wide

_Axis = int | tuple[int, ...] | None


def _zeros(x: Array) -> Array:
    return jnp.zeros_like(x)


# Reductions ---------------------------------------------------------------------


def _kept_shape(shape: tuple[int, ...], axis: _Axis) -> tuple[int, ...]:
    """`shape` with the reduced axes kept as 1 (as `keepdims=True` gives)."""
    axes = range(len(shape)) if axis is None else np.atleast_1d(axis) % len(shape)
    return tuple(
        1 if i in set(int(a) for a in axes) else n for i, n in enumerate(shape)
    )


def _pow2(k: Array, dtype: Any) -> Array:
    """$2^k$ in float32 or float64 (`dtype`), exactly, from its bits; `k` must keep
    it normal (XLA may flush a subnormal to zero)."""
    if jnp.dtype(dtype) == jnp.float64:
        bits = jnp.left_shift(k.astype(jnp.int64) + 1023, 52)
        return jax.lax.bitcast_convert_type(bits, jnp.float64)
    bits = jnp.left_shift(k.astype(jnp.int32) + 127, 23)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _exponent_part(m: Array) -> Array:
    r"""$2^{\lfloor \log_2 m \rfloor}$ for a normal positive `m` (float32 or
    float64), from its exponent bits alone: 0 for 0 or a subnormal, inf for inf or
    NaN. Two bitcasts and an `and`, where `frexp` costs a dozen operations."""
    info = jnp.finfo(m.dtype)
    ints = jnp.int64 if m.dtype == jnp.float64 else jnp.int32
    mask = ((1 << info.nexp) - 1) << info.nmant  # the exponent field
    bits = jax.lax.bitcast_convert_type(m, ints) & jnp.asarray(mask, ints)
    return jax.lax.bitcast_convert_type(bits, m.dtype)


def _scaled_norm(w: Array, axis: _Axis) -> Array:
    """The Euclidean norm of `w` (float32 or float64) along `axis`, kept dims.

    `w` is scaled by a power of two $p$ near its slice's largest magnitude before
    squaring, and the norm scaled back. A power of two scales every square and the
    square root exactly (the scale of a square is an even power), so where the
    plain sum of squares neither overflows nor underflows this is the plain
    `sqrt(sum(w**2))` bit for bit; beyond, it stays finite and accurate. $p$ is
    clipped to $[2^{-126}, 2^{126}]$ (float32; float64 likewise) so that $p$ and
    $1/p$ are both normal: a zero slice gets the smallest (its squares stay 0), an
    inf or NaN the largest (the inf or NaN stays)."""
    m = jnp.max(jnp.abs(w), axis=axis, keepdims=True, initial=0)
    info = jnp.finfo(w.dtype)
    p = jnp.clip(_exponent_part(m), 2.0**info.minexp, 2.0 ** (info.maxexp - 2))
    s = jnp.sum(jnp.square(w * (1 / p)), axis=axis, keepdims=True)
    return jnp.sqrt(s) * p


def _reference_norm(w: Array, axis: _Axis) -> Array:
    """Independently of `_scaled_norm`: `m · sqrt(sum((w/m)²))` with `m` the slice's
    largest magnitude itself (held constant), 0 on a zero slice: the classic
    overflow-safe norm, whose plain derivative is the double-where one."""
    m = jax.lax.stop_gradient(jnp.max(jnp.abs(w), axis=axis, keepdims=True))
    nonzero = m != 0
    m_safe = jnp.where(nonzero, m, 1)
    s = jnp.sum(jnp.square(w / m_safe), axis=axis, keepdims=True)
    # A NaN slice has `m` NaN: not zero, so its NaN reaches value and derivative.
    s_safe = jnp.where(nonzero, s, 1)
    return jnp.where(nonzero, m_safe * jnp.sqrt(s_safe), 0 * s)


class _Reduction(JVPRule):
    """A rule on one floating-point array along `axis` (checked when called)."""

    elementwise: ClassVar[bool] = False
    exact: ClassVar[bool] = True
    domain: ClassVar[Domain] = Domain(kinks=(0.0,))

    def _check_call(self, args: tuple[Any, ...]) -> None:
        check_float_array(self.rule_name(), args)
        axis = getattr(self, "axis")  # each subclass declares its own
        if axis is not None:
            check_axis(self.rule_name(), axis, jnp.shape(args[0]), "x")


class SafeNorm(_Reduction):
    r"""The Euclidean norm, whose derivative is finite (zero) at a zero vector.

    Along `axis` (all axes for `None`),

    $$n = \lVert x \rVert = \sqrt{\textstyle\sum_i x_i^2}, \qquad
    \dot n = \begin{cases} \langle x, t \rangle / n & n \neq 0 \\
    0 & x = 0 \end{cases}$$

    On an all-zero slice ($-0.0$ counts as zero) the value is 0 and the derivative
    is 0 in both modes: the minimum-norm subgradient of the norm there (the plain
    `jnp.linalg.norm` gives NaN). Second derivatives are $(I - u u^\top)/n$ with
    $u = x/n$ away from zero and 0 on a zero slice, finite in every mode.

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
        n = jnp.reshape(out, _kept_shape(x.shape, self.axis)).astype(w.dtype)
        zero = n == 0
        # `x · (1/n)` before the product, so that it neither overflows nor
        # underflows where the norm was scaled; `1/n` is 0 on a zero slice (one
        # select per slice, none per element), whose tangent is then 0.
        u = w * jnp.where(zero, _zeros(n), 1 / jnp.where(zero, 1, n))
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
        w = x.astype(wide(x.dtype))
        n = _scaled_norm(w, self.axis)
        return (w / jnp.where(n == 0, 1, n)).astype(x.dtype)

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
        inv = jnp.where(zero, _zeros(n), 1 / jnp.where(zero, 1, n))
        y, t = w * inv, t.astype(w.dtype)
        dy = (t - y * jnp.sum(y * t, axis=self.axis, keepdims=True)) * inv
        return dy.astype(x.dtype)

    def reference_forward(self, x: Array) -> Array:
        w = x.astype(wide(x.dtype))
        n = _reference_norm(w, self.axis)
        return jnp.where(n == 0, 0, w / jnp.where(n == 0, 1, n)).astype(x.dtype)

    def reference_derivative(self, x: Array) -> Array:
        """`u / ‖u‖` with `u = x / m`, `m` the slice's largest magnitude (held
        constant): `u` and `‖u‖` are of order 1, so the plain derivative
        `(I − y yᵀ) / (m ‖u‖)` neither overflows nor underflows where `‖x‖²` would
        (a slice of magnitude 1e-30, say). 0 on a zero slice; NaN on a NaN one."""
        w = x.astype(wide(x.dtype))
        m = jax.lax.stop_gradient(jnp.max(jnp.abs(w), axis=self.axis, keepdims=True))
        zero = m == 0
        u = w / jnp.where(zero, 1, m)
        s = jnp.sum(jnp.square(u), axis=self.axis, keepdims=True)
        y = u / jnp.sqrt(jnp.where(zero, 1, s))
        return jnp.where(zero, 0 * w, y).astype(x.dtype)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[SafeNormalize]:
        return [cls(), cls(axis=0)]


# Elementwise ----------------------------------------------------------------------


class _Safe(ElementwiseRule):
    exact: ClassVar[bool] = True


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
        return jnp.where(zero, _zeros(w), slope).astype(x.dtype)

    def reference_forward(self, x: Array) -> Array:
        w = x.astype(wide(x.dtype))  # `pow(-inf, 0.5)` is inf by IEEE, not NaN
        return jnp.where(w < 0, jnp.nan, jnp.power(w, 0.5)).astype(x.dtype)

    def reference_derivative(self, x: Array) -> Array:
        positive, negative = x > 0, ~(x >= 0)  # NaN is "negative": NaN derivative
        root = jnp.sqrt(jnp.where(positive, x, 1))
        below = jnp.sqrt(jnp.where(negative, x, 1))
        return jnp.where(positive, root, jnp.where(negative, below, 0 * x))


# Where |x| exceeds 1 by at most this many epsilons (of its dtype), `arccos` and
# `arcsin` take x as ±1: the rounding error of a cosine computed as the dot product
# of unit vectors (measured in float32: within 3 eps of 1 for `u @ u` with
# `u = v / jnp.linalg.norm(v)`, n from 3 to 1024).
_ROUNDING_ULPS = 4


def _unit_interval(x: Array) -> tuple[Array, Array, Array]:
    """`(w, inside, edge)`: `x` in float32 (at least), `|x| < 1`, and `|x|` within
    rounding of 1 (`1 <= |x| <= 1 + 4 eps`). Neither holds beyond, nor at NaN."""
    x = jnp.asarray(x)  # under `grad`, a Python float arrives as `TypedFloat`
    w = x.astype(wide(x.dtype))
    a = jnp.abs(w)
    band = 1 + _ROUNDING_ULPS * float(jnp.finfo(x.dtype).eps)  # exact in `w`
    return w, a < 1, (a >= 1) & (a <= band)


def _arc_slope(x: Array) -> Array:
    r"""$1/\sqrt{1 - x^2}$ inside, 0 at $\pm 1$ (and within rounding of them), NaN
    beyond or at NaN. $(1 - x)(1 + x)$ is exact-ish near $\pm 1$, where
    $1 - x^2$ cancels."""
    w, _, edge = _unit_interval(x)
    # At the edges `rsqrt` is fed inf: its value there is exactly 0 and so is its
    # derivative, `-u^(-3/2)/2` (one select, where feeding 0 and selecting the
    # inf away would leave `0 · inf = NaN` in reverse over reverse). Beyond them,
    # or at NaN, `rsqrt` of a negative keeps its NaN, in this slope and in its
    # own derivative.
    u = jnp.where(edge, jnp.inf, (1 - w) * (1 + w))
    return jax.lax.rsqrt(u).astype(jnp.result_type(x))


def _reference_arc(x: Array, kind: str, *, derivative: bool) -> Array:
    r"""`arccos` or `arcsin` (`kind`) with the value `jnp.arccos` or `jnp.arcsin`
    gives on $x$ clamped within rounding of $\pm 1$; with `derivative`, a function
    whose plain derivative is the rule's: $\arccos x = 2 \operatorname{atan2}(
    \sqrt{1 - x}, \sqrt{1 + x})$ and $\arcsin x = \operatorname{atan2}(x,
    \sqrt{(1 - x)(1 + x)})$ inside, a constant at the edges, NaN beyond."""
    w, inside, edge = _unit_interval(x)
    beyond = ~(inside | edge)
    plain = jnp.arccos if kind == "arccos" else jnp.arcsin
    if derivative:
        s = jnp.where(inside, w, 0)
        if kind == "arccos":
            value = 2 * jnp.arctan2(jnp.sqrt(1 - s), jnp.sqrt(1 + s))
        else:
            value = jnp.arctan2(s, jnp.sqrt((1 - s) * (1 + s)))
    else:
        value = plain(jnp.clip(w, -1, 1))
    ends = plain(jnp.sign(w)) + 0 * w
    nan = plain(jnp.where(beyond, w, 0))
    return jnp.where(inside, value, jnp.where(edge, ends, nan)).astype(x.dtype)


class SafeArccos(_Safe):
    r"""`arccos`, whose derivative at $\pm 1$ is 0 instead of $-\infty$: the angle
    between unit vectors $u, v$ as `safe_arccos(u @ v)`.

    $$y = \arccos x, \qquad \dot y = \begin{cases} -t / \sqrt{1 - x^2} &
    \lvert x \rvert < 1 \\ 0 & \lvert x \rvert = 1 \end{cases}$$

    At $x = 1$ the value is exactly 0 and at $x = -1$ it is $\pi$ (rounded to the
    dtype); the derivative is 0 in both modes, and so is every higher derivative.
    Why 0: as a function of the vectors, the angle $\arccos(u \cdot v)$ has a
    cone-shaped minimum at $u = v$ (and maximum at $u = -v$), whose minimum-norm
    subgradient is 0, as [`SafeNorm`][]'s at 0; near $1$,
    $\arccos x \approx \sqrt{2(1 - x)}$ and 0 is [`SafeSqrt`][]'s convention; and
    it is finite in every dtype.

    Beyond $\pm 1$: a cosine computed from unit vectors rounds past 1, and the
    plain `jnp.arccos` then gives NaN. Within 4 epsilons of the input's dtype
    ($\lvert x \rvert \le 1 + 4\varepsilon$) the input is taken as $\pm 1$ (value 0
    or $\pi$, derivative 0). Farther beyond, value and derivative are NaN, as
    `jnp.arccos`: such an input is no cosine (vectors that were not normalised),
    and a clamp would hide that. Clamp explicitly where it is intended:
    `safe_arccos(jnp.clip(c, -1, 1))`.

    Inside, the value is `jnp.arccos`'s; the derivative is computed as
    $-1/\sqrt{(1 - x)(1 + x)}$, which does not cancel near $\pm 1$ (where
    $1 - x^2$ rounded in float32 is up to $3 \times 10^{-5}$ off, relatively,
    within 1000 epsilons of 1).

    !!! Example

        ```python
        u = jnp.array([0.6, 0.8])
        jax.grad(lambda u: eqxrules.safe_arccos(u @ u))(u)  # [0, 0], not NaN
        ```
    """

    summary: ClassVar[str] = (
        "arccos(x); derivative `−t/√(1 − x²)`, 0 at |x| = 1; "
        "|x| <= 1 + 4ε taken as ±1, NaN beyond"
    )
    domain: ClassVar[Domain] = Domain(low=-1.0, high=1.0, kinks=(-1.0, 1.0))

    def primal(self, x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        w, _, edge = _unit_interval(x)
        # Within rounding of ±1, exactly ±1 (`sign`); elsewhere `x` itself.
        return jnp.arccos(jnp.where(edge, jnp.sign(w), w)).astype(x.dtype)

    def slope(self, x: Array) -> Array:
        return -_arc_slope(x)

    def reference_forward(self, x: Array) -> Array:
        return _reference_arc(x, "arccos", derivative=False)

    def reference_derivative(self, x: Array) -> Array:
        return _reference_arc(x, "arccos", derivative=True)


class SafeArcsin(_Safe):
    r"""`arcsin`, whose derivative at $\pm 1$ is 0 instead of $+\infty$.

    $$y = \arcsin x, \qquad \dot y = \begin{cases} t / \sqrt{1 - x^2} &
    \lvert x \rvert < 1 \\ 0 & \lvert x \rvert = 1 \end{cases}$$

    At $x = \pm 1$ the value is exactly $\pm\pi/2$ (rounded to the dtype) and every
    derivative is 0, in both modes: [`SafeArccos`][]'s convention, since
    $\arcsin x = \pi/2 - \arccos x$. As there, $\lvert x \rvert \le 1 +
    4\varepsilon$ (the input dtype's epsilon) is taken as $\pm 1$, and farther
    beyond value and derivative are NaN, as `jnp.arcsin`.

    !!! Example

        ```python
        jax.grad(eqxrules.safe_arcsin)(1.0)  # 0.0, where jax.grad(jnp.arcsin) is inf
        ```
    """

    summary: ClassVar[str] = (
        "arcsin(x); derivative `t/√(1 − x²)`, 0 at |x| = 1; "
        "|x| <= 1 + 4ε taken as ±1, NaN beyond"
    )
    domain: ClassVar[Domain] = Domain(low=-1.0, high=1.0, kinks=(-1.0, 1.0))

    def primal(self, x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        w, _, edge = _unit_interval(x)
        # Within rounding of ±1, exactly ±1 (`sign`); elsewhere `x` itself.
        return jnp.arcsin(jnp.where(edge, jnp.sign(w), w)).astype(x.dtype)

    def slope(self, x: Array) -> Array:
        return _arc_slope(x)

    def reference_forward(self, x: Array) -> Array:
        return _reference_arc(x, "arcsin", derivative=False)

    def reference_derivative(self, x: Array) -> Array:
        return _reference_arc(x, "arcsin", derivative=True)


# Several inputs -------------------------------------------------------------------


def _check_inputs(rule: str, args: tuple[Any, ...], kinds: dict[str, str]) -> None:
    """A `TypeError` naming `rule` and the argument unless each of `args` is an
    array of its kind (`"float"` or `"bool"`), and a `ValueError` naming their
    shapes unless they broadcast together."""
    for arg, (name, kind) in zip(args, kinds.items(), strict=True):
        if kind == "float":
            check_float_array(rule, (arg,), argument=name)
        else:
            check_array(rule, (arg,), argument=name, what="a boolean array")
            dtype = jnp.result_type(arg)
            if dtype != jnp.bool_:
                raise TypeError(
                    f"`{rule}` expects a boolean array for `{name}`, got dtype "
                    f"{dtype}. Compare first, e.g. `{name} != 0`."
                )
    shapes = [jnp.shape(a) for a in args]
    try:
        jnp.broadcast_shapes(*shapes)
    except ValueError:
        listed = ", ".join(f"`{n}` {s}" for n, s in zip(kinds, shapes, strict=True))
        raise ValueError(
            f"`{rule}`: the shapes of its inputs must broadcast together; got {listed}."
        ) from None


def _float_dtype(*args: Any) -> Any:
    """The dtype of the floating-point inputs together (`jnp.result_type`: a weak
    Python float keeps a bfloat16 array bfloat16)."""
    return jnp.result_type(*args)


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
        _check_inputs(self.rule_name(), args, {"a": "float", "b": "float"})

    def primal(self, a: Float[Array, "*a"], b: Float[Array, "*b"]) -> Array:
        dtype = _float_dtype(a, b)
        wa, wb = jnp.asarray(a, wide(dtype)), jnp.asarray(b, wide(dtype))
        zero = wb == 0
        q = wa / jnp.where(zero, 1, wb)
        return jnp.where(zero, _zeros(q), q).astype(dtype)

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
        dtype = _float_dtype(a, b)
        wa, wb = jnp.asarray(a, wide(dtype)), jnp.asarray(b, wide(dtype))
        return jnp.where(wb == 0, 0, wa / wb).astype(dtype)

    def reference_derivative(self, a: Array, b: Array) -> Array:
        """`(a·2^-e) / f` with `b = f·2^e` (`frexp`; the power of two held
        constant): the same quotient, exactly, whose plain derivative in `b`,
        `-(a·2^-e)/f² · 2^-e`, squares a number of order 1 where `-a/b²` would
        square `b` (and overflow at `b` near 1e-32, making `0 · inf` of a zero
        derivative). 0 where `b` is, with zero derivatives (for a finite `a`)."""
        dtype = _float_dtype(a, b)
        wa, wb = jnp.asarray(a, wide(dtype)), jnp.asarray(b, wide(dtype))
        zero = wb == 0
        info = jnp.finfo(wb.dtype)
        _, e = jnp.frexp(jax.lax.stop_gradient(jnp.where(zero, 1, wb)))
        k = _pow2(-jnp.clip(e, info.minexp + 2, info.maxexp - 2), wb.dtype)
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

    `fn` must be elementwise (each output element depends on the same element of
    `x` only), and `x`, `mask` and `otherwise` broadcast together (a 0-d
    `otherwise` is the usual case). The output has the dtype of `fn(x)` and
    `otherwise` together.

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
        kinds = {"mask": "bool", "x": "float", "otherwise": "float"}
        _check_inputs(self.rule_name(), args, kinds)

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
        fx = call_with_key(self.fn, self._inside(mask, x), key)
        return self._select(mask, fx, otherwise)

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
