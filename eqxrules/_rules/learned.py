r"""Learned quantisers: the step (or the clipping level) is a learnable array field
of the Module, and receives its own custom derivative through `t_self`.

The value rounds $v/s$ once: unlike the fixed quantisers, whose range is a Python
number folded into the program, the step here is traced, so the level is
$\operatorname{round}(\operatorname{clip}(v/s))\cdot s$ as written, computed in at
least float32 (and the step's dtype) and cast to the input's dtype. `round` goes half
to even. (Notation: see `_elementwise`.)
"""

from __future__ import annotations

import functools as ft
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from .._catalogue import Domain, JVPRule
from .._hyper import (
    Check,
    at_least,
    axis_index,
    boolean,
    finite_everywhere,
    hyperparameter,
    integer,
    parameter,
    positive,
    positive_everywhere,
)
from .._inputs import check_axis, check_broadcasts, check_float_array
from ._elementwise import masked_identity, sg, wide
from ._exact import MAX_BITS
from .quantize import _reference_round

_signed_bits = Check(
    lambda m: (
        "be >= 2 for a signed quantiser"
        if m.signed is True
        else "be >= 1 for an unsigned quantiser"
    ),
    lambda v, m: v >= (2 if m.signed is True else 1),
    bad=lambda m: (1,) if m.signed is True else (0,),
    after=(integer,),
)
# The bound of `ste_quantize`. Well before float32 stops resolving the ties (24
# bits), `kinks()`, which `verify` probes, would list millions; and from 32 bits
# the unsigned levels overflow int32 (a raw `OverflowError` at the call).
_at_most_bits = Check(
    f"be <= {MAX_BITS} (as for `ste_quantize`: `kinks()` lists all 2^bits - 1 "
    "ties between levels)",
    lambda v, _: v <= MAX_BITS,
    bad=(MAX_BITS + 1, 32),
    after=(integer,),
)


def levels(bits: int, signed: bool) -> tuple[int, int]:
    """$(Q_n, Q_p)$: the levels run from $-Q_n$ to $Q_p$."""
    if signed:
        return 2 ** (bits - 1), 2 ** (bits - 1) - 1
    return 0, 2**bits - 1


def _compute_dtype(x: Array, *params: Any) -> Any:
    return jnp.result_type(wide(x.dtype), *(jnp.result_type(p) for p in params))


def _per_channel(p: Any, axis: int | None, ndim: int) -> Array:
    """`p` shaped to broadcast against an input of `ndim` axes: as it is per
    tensor, along `axis` per channel."""
    p = jnp.asarray(p)
    if axis is None:
        return p
    return p.reshape(p.shape + (1,) * (ndim - 1 - axis % ndim))


# Jitted: called eagerly on each layer's weights, one program per shape rather than
# one per operation.
@ft.partial(jax.jit, static_argnums=(1, 2))
def _initial_step(x: Array, axes: tuple[int, ...] | None, qp: int) -> Array:
    w = wide(x.dtype)
    mean = jnp.mean(jnp.abs(x.astype(w)), axis=axes)
    return jnp.maximum(2 * mean / math.sqrt(qp), jnp.finfo(w).tiny)


@jax.jit
def _initial_alpha(x: Array) -> Array:
    w = wide(x.dtype)
    return jnp.maximum(jnp.max(x.astype(w)), jnp.finfo(w).tiny)


class LSQ(JVPRule):
    r"""Learned step size quantisation (LSQ, Esser et al., ICLR 2020), and with an
    `offset` LSQ+ (Bhalgat et al., 2020): uniform quantisation whose step $s$ is
    learned with the rest of the model.

    With $b$ bits, $Q_n = 2^{b-1}$, $Q_p = 2^{b-1} - 1$ if `signed`, else $Q_n = 0$,
    $Q_p = 2^b - 1$; $\beta$ the offset (0 without one) and $u = (v - \beta)/s$:

    $$\hat v = \operatorname{round}(\operatorname{clip}(u, -Q_n, Q_p))\,s + \beta,
    \qquad \frac{\partial\hat v}{\partial v} = [-Q_n < u < Q_p], \qquad
    \frac{\partial\hat v}{\partial\beta} = 1 - [-Q_n < u < Q_p]$$

    $$\frac{\partial\hat v}{\partial s} = g \cdot \begin{cases}
    -Q_n & u \le -Q_n \\ Q_p & u \ge Q_p \\
    \operatorname{round}(u) - u & \text{else} \end{cases}$$

    the paper's eq. 3 times the gradient scale $g$: by default
    $g = 1/\sqrt{N Q_p}$ with $N$ the number of elements sharing one step (all of
    `x` per tensor, one channel's with `axis`). `round` goes half to even. The step
    is traced, so $v/s$ is rounded once (in at least float32) before `round`.
    NaN propagates; the value has the input's dtype, each cotangent its primal's.

    **Arguments:**

    - `step`: $s$, a positive float or floating-point array: a scalar per tensor,
        or a 1-D array with one step per channel along `axis`. Only an array is a
        trainable leaf (what [`LSQ.from_data`][eqxrules.LSQ.from_data] gives).
    - `bits`: an integer $b \le 16$, $b \ge 2$ if `signed`, $\ge 1$ if not.
    - `signed`: `True` for levels $-Q_n \dots Q_p$, `False` for $0 \dots 2^b - 1$.
    - `grad_scale`: $g$, a positive number, or `None` for $1/\sqrt{N Q_p}$
        (`1.0` gives the raw eq. 3).
    - `axis`: `None` per tensor, or the channel axis of `x` that `step` runs along.
    - `offset`: $\beta$, `None` (LSQ) or a finite float or array shaped like `step`
        (LSQ+).

    !!! Example

        ```python
        w = jax.random.normal(jax.random.key(0), (16, 8))
        q = eqxrules.LSQ.from_data(w, bits=4, axis=0)  # one step per row
        g = jax.grad(lambda q: q(w).sum())(q).step  # the step's gradient
        eqxrules.lsq_quantize(jnp.array([0.3, 2.0]), jnp.array(0.5), bits=2)
        # [0.5, 0.5]
        ```
    """

    step: float | Array = parameter(positive_everywhere)
    bits: int = hyperparameter(_signed_bits, _at_most_bits, kw_only=True)
    signed: bool = hyperparameter(True, boolean, kw_only=True)
    grad_scale: float | None = hyperparameter(
        None, positive, allow_none=True, kw_only=True
    )
    axis: int | None = hyperparameter(None, axis_index, allow_none=True, kw_only=True)
    offset: float | Array | None = parameter(
        None, finite_everywhere, allow_none=True, kw_only=True
    )

    summary: ClassVar[str] = (
        "round(clip((x − offset)/step, −Q_n, Q_p))·step + offset, step learned; "
        "derivative `t·[inside]`, step's g·(round(u) − u, or the clipped level) "
        "(LSQ, LSQ+)"
    )
    functional_name: ClassVar[str] = "lsq_quantize"
    # Not shape-agnostic: with `axis` the step runs along one axis of `x`, and the
    # default g depends on how many elements share a step.
    elementwise: ClassVar[bool] = False

    def _check_call(self, args: tuple[Any, ...]) -> None:
        check_float_array(self.rule_name(), args)
        shape = jnp.shape(args[0])
        for name in ("step", "offset"):
            p = getattr(self, name)
            if p is None:
                continue
            p_shape = jnp.shape(p)
            if self.axis is None:
                try:
                    ok = jnp.broadcast_shapes(shape, p_shape) == shape
                except ValueError:
                    ok = False
                want = "broadcast to"
            else:
                check_axis(self.rule_name(), self.axis, shape, "x")
                ok = p_shape == (shape[self.axis],)
                want = f"have one element per channel along `axis` (={self.axis}) of"
            if not ok:
                raise ValueError(
                    f"`{self.rule_name()}`: `{name}` of shape {p_shape} must {want} "
                    f"`x` of shape {shape}."
                )

    def _levels(self) -> tuple[int, int]:
        return levels(self.bits, self.signed)

    def _params(self, x: Array) -> tuple[Any, Array, Array | None]:
        """The compute dtype, the step and the offset shaped against `x`."""
        extra = () if self.offset is None else (self.offset,)
        w = _compute_dtype(x, self.step, *extra)
        s = _per_channel(self.step, self.axis, x.ndim).astype(w)
        b = (
            None
            if self.offset is None
            else _per_channel(self.offset, self.axis, x.ndim)
        )
        return w, s, None if b is None else b.astype(w)

    def _g(self, x: Array) -> float:
        if self.grad_scale is not None:
            return float(self.grad_scale)
        n = max(x.size // max(jnp.size(self.step), 1), 1)
        return 1.0 / math.sqrt(n * self._levels()[1])

    def primal(self, x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        qn, qp = self._levels()
        w, s, b = self._params(x)
        v = x.astype(w) if b is None else x.astype(w) - b
        q = jnp.round(jnp.clip(v / s, -qn, qp)) * s
        return (q if b is None else q + b).astype(x.dtype)

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
        t_s, t_b = t_self.step, t_self.offset
        if t_x is None and t_s is None and t_b is None:
            return None
        qn, qp = self._levels()
        w, s, b = self._params(x)
        # `u` is held constant in this tangent (as in the reference): the step's
        # derivative `round(u) - u` is the paper's straight-through value, whose
        # own derivative (second order) is 0, not that of `-u`.
        u = jax.lax.stop_gradient((x.astype(w) if b is None else x.astype(w) - b) / s)
        inside = (u > -qn) & (u < qp)
        terms = []
        if t_x is not None:
            terms.append(jnp.where(inside, t_x, jnp.zeros_like(t_x)).astype(w))
        if t_s is not None:
            ds = jnp.where(u <= -qn, -qn, jnp.where(u >= qp, qp, jnp.round(u) - u))
            t_s = _per_channel(t_s, self.axis, x.ndim).astype(w)
            terms.append((self._g(x) * ds) * t_s)
        if t_b is not None:
            t_b = _per_channel(t_b, self.axis, x.ndim).astype(w)
            terms.append(jnp.where(inside, jnp.zeros_like(t_b), t_b))
        return sum(terms[1:], terms[0]).astype(x.dtype)

    def kinks(self) -> tuple[float, ...]:
        """The ends of the range of each step, then the ties between levels."""
        qn, qp = self._levels()
        steps = [float(s) for s in jnp.ravel(jnp.asarray(self.step))]
        b = 0.0 if self.offset is None else float(jnp.ravel(self.offset)[0])
        ends = [k * s + b for s in steps for k in (-qn, qp)]
        ties = [(k + 0.5) * s + b for s in steps for k in range(-qn, qp)]
        ties.sort(key=lambda t: abs(t - b))
        return tuple(dict.fromkeys([*ends, *ties]))

    def _reference_parts(self, x: Array) -> tuple[Array, Array, Array, float]:
        # Independent of `primal`: a per-channel step broadcast by moving `axis`
        # last, N counted from the shape.
        w = jnp.result_type(jnp.float32, x.dtype, jnp.asarray(self.step).dtype)
        step = jnp.asarray(self.step).astype(w)
        offset = jnp.zeros((), w) if self.offset is None else jnp.asarray(self.offset)
        if self.axis is None:
            xm, n = x.astype(w), x.size // max(step.size, 1)
        else:
            xm = jnp.moveaxis(x.astype(w), self.axis % x.ndim, -1)
            n = math.prod(xm.shape[:-1])
        qp = self._levels()[1]
        # (An empty `x` has no gradient to scale: N = 1 keeps g finite.)
        g = self.grad_scale or 1 / math.sqrt(max(n, 1) * qp)
        return xm, step, offset.astype(w), float(g)

    def _unmove(self, y: Array, x: Array) -> Array:
        if self.axis is None:
            return y.astype(x.dtype)
        return jnp.moveaxis(y, -1, self.axis % x.ndim).astype(x.dtype)

    def reference_forward(self, x: Array) -> Array:
        qn, qp = self._levels()
        xm, s, b, _ = self._reference_parts(x)
        k = _reference_round((xm - b) / s)
        k = jnp.where(k < -qn, -qn, jnp.where(k > qp, qp, k))
        return self._unmove(k * s + b, x)

    def reference_derivative(self, x: Array) -> Array:
        # Autodiff of this gives: 1 inside in `x`; in `step`, g·s times the
        # constant level (clipped) or round(u) − u (inside); in `offset`, 1 outside.
        qn, qp = self._levels()
        xm, s, b, g = self._reference_parts(x)
        u = sg((xm - b) / s)
        inside = (u > -qn) & (u < qp)
        slope = jnp.where(
            u <= -qn, -qn, jnp.where(u >= qp, qp, sg(_reference_round(u) - u))
        )
        y = (g * s) * slope + jnp.where(inside, xm, b)
        return self._unmove(y, x)

    @classmethod
    def from_data(
        cls,
        x: ArrayLike,
        *,
        bits: int,
        signed: bool = True,
        axis: int | None = None,
        **kwargs: Any,
    ) -> LSQ:
        r"""An `LSQ` whose step is the paper's initialisation from data `x`:
        $s = 2\,\overline{\lvert v\rvert}/\sqrt{Q_p}$, the mean over all of `x`,
        or over all axes but `axis` per channel (at least the smallest normal
        number of the step's dtype, so an all-zero `x` still gives a valid step).
        The step is float32, or wider if `x` is. Other keywords (`grad_scale`,
        `offset`) are passed on."""
        probe = cls(1.0, bits=bits, signed=signed, axis=axis, **kwargs)
        return probe.initialised_from(x)

    def initialised_from(self, x: ArrayLike) -> LSQ:
        """This quantiser with its step initialised from data `x` as in
        [`LSQ.from_data`][eqxrules.LSQ.from_data] (what [`quantize`][] and [`calibrate`][] call)."""
        x = jnp.asarray(x)
        if self.axis is None:
            axes = None
        else:
            check_axis(self.rule_name(), self.axis, x.shape, "x")
            axis = self.axis % x.ndim
            axes = tuple(a for a in range(x.ndim) if a != axis)
        step = _initial_step(x, axes, self._levels()[1])
        offset = self.offset
        if offset is not None and jnp.shape(offset) != step.shape:
            offset = jnp.zeros(step.shape, step.dtype)
        return type(self)(
            step,
            bits=self.bits,
            signed=self.signed,
            grad_scale=self.grad_scale,
            axis=self.axis,
            offset=offset,
        )

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[LSQ]:
        # Steps that are powers of two, so every tie and end is exact.
        return [
            cls(jnp.array(0.5), bits=2),
            cls(jnp.array(0.25), bits=3, signed=False, grad_scale=1.0),
            cls(jnp.array([0.25, 0.5, 1.0]), bits=2, axis=-1),
            cls(jnp.array(0.25), bits=3, offset=jnp.array(0.25)),
        ]


class PACT(JVPRule):
    r"""Parameterised clipping activation (PACT, Choi et al., 2018): clip at a
    learned level $\alpha$, then quantise $[0, \alpha]$ uniformly onto $2^b$
    levels.

    $$y = \operatorname{clip}(v, 0, \alpha), \qquad
    \hat y = \operatorname{round}\!\big(y\,\tfrac{2^b - 1}{\alpha}\big)\,
    \tfrac{\alpha}{2^b - 1}, \qquad
    \frac{\partial\hat y}{\partial v} = [0 \le v < \alpha], \qquad
    \frac{\partial\hat y}{\partial\alpha} = [v \ge \alpha]$$

    (the paper's straight-through form). `round` goes half to even; $\alpha$ is
    traced, so $y (2^b - 1)/\alpha$ is rounded once (in at least float32) before
    `round`. NaN propagates; the value has the input's dtype, each cotangent its
    primal's.

    **Arguments:**

    - `alpha`: $\alpha$, a positive float or floating-point scalar array (only an
        array is a trainable leaf).
    - `bits`: an integer $1 \le b \le 16$.

    !!! Example

        ```python
        pact = eqxrules.PACT(jnp.array(1.5), bits=2)
        pact(jnp.array([-1.0, 0.4, 2.0]))  # [0, 0.5, 1.5]
        jax.grad(lambda p: p(jnp.array(2.0)))(pact).alpha  # 1.0
        ```
    """

    alpha: float | Array = parameter(positive_everywhere)
    bits: int = hyperparameter(at_least(1, integer), _at_most_bits, kw_only=True)

    summary: ClassVar[str] = (
        "round(clip(x, 0, α)·n/α)·α/n with n = 2^bits − 1, α learned; derivative "
        "`t·[0 <= x < α]`, α's `[x >= α]` (PACT)"
    )
    domain: ClassVar[Domain] = Domain(low=-1.0, high=2.5)
    functional_name: ClassVar[str] = "pact_quantize"

    def _check_call(self, args: tuple[Any, ...]) -> None:
        check_float_array(self.rule_name(), args)
        check_broadcasts(self.rule_name(), "alpha", self.alpha, jnp.shape(args[0]))

    def primal(self, x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        n = 2**self.bits - 1
        w = _compute_dtype(x, self.alpha)
        a = jnp.asarray(self.alpha).astype(w)
        y = jnp.clip(x.astype(w), 0, a)
        return (jnp.round(y * (n / a)) * (a / n)).astype(x.dtype)

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
        t_a = t_self.alpha
        if t_x is None and t_a is None:
            return None
        w = _compute_dtype(x, self.alpha)
        v, a = x.astype(w), jnp.asarray(self.alpha).astype(w)
        terms = []
        if t_x is not None:
            inside = (v >= 0) & (v < a)
            terms.append(jnp.where(inside, t_x, jnp.zeros_like(t_x)).astype(w))
        if t_a is not None:
            t_a = jnp.asarray(t_a).astype(w)
            terms.append(jnp.where(v >= a, t_a, jnp.zeros_like(t_a)))
        return sum(terms[1:], terms[0]).astype(x.dtype)

    def kinks(self) -> tuple[float, ...]:
        n = 2**self.bits - 1
        a = float(jnp.ravel(jnp.asarray(self.alpha))[0])
        ties = sorted(((k + 0.5) * a / n for k in range(n)), key=lambda t: -t)
        return (0.0, a, *ties)

    def reference_forward(self, x: Array) -> Array:
        n = 2**self.bits - 1
        w = jnp.result_type(jnp.float32, x.dtype, jnp.asarray(self.alpha).dtype)
        v, a = x.astype(w), jnp.asarray(self.alpha).astype(w)
        y = jnp.where(v < 0, 0, jnp.where(v > a, a, v))
        return (_reference_round(y * (n / a)) * (a / n)).astype(x.dtype)

    def reference_derivative(self, x: Array) -> Array:
        # The paper's clip, written out: slope 1 in `x` on [0, alpha), in `alpha`
        # where x >= alpha.
        a = jnp.asarray(self.alpha)
        w = jnp.result_type(jnp.float32, x.dtype, a.dtype)
        v = x.astype(w)
        above = v >= a.astype(w)
        y = jnp.where(above, a.astype(w), masked_identity(v, v >= 0))
        return y.astype(x.dtype)

    def initialised_from(self, x: ArrayLike) -> PACT:
        r"""This quantiser with $\alpha = \max v$ of data `x` (at least the
        smallest normal number), what [`calibrate`][] calls."""
        return type(self)(_initial_alpha(jnp.asarray(x)), bits=self.bits)

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[PACT]:
        # alpha·(k + 1/2)/n exact: ties at 0.25, 0.75, 1.25; then at 0.5.
        return [cls(jnp.array(1.5), bits=2), cls(jnp.array(1.0), bits=1)]
