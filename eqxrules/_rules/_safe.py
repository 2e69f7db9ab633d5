r"""What the NaN-safe rules share (`safe_norms`, `safe_angles`, `safe_masks`,
`safe_softmax`, `safe_eigh`): the value where it is defined, and a derivative that is
finite at the singular set where the plain one is inf or NaN (the norm of a zero
vector, `sqrt` at 0, `arccos` at $\pm 1$, `atan2` at the origin, a softmax of a row
with nothing in it, two equal eigenvalues), by a convention each docstring states.

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

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._catalogue import Domain, ElementwiseRule, JVPRule
from .._inputs import check_array, check_axis, check_float_array
from ._elementwise import wide as wide

Axis = int | tuple[int, ...] | None


def zeros(x: Array) -> Array:
    return jnp.zeros_like(x)


def safe_inverse(d: Array, zero: Array) -> Array:
    """`1/d`, and 0 where `zero` holds: `d` is fed 1 there, so neither this nor its
    derivative of any order meets `1/0`."""
    return jnp.where(zero, zeros(d), 1 / jnp.where(zero, 1, d))


def kept_shape(shape: tuple[int, ...], axis: Axis) -> tuple[int, ...]:
    """`shape` with the reduced axes kept as 1 (as `keepdims=True` gives)."""
    axes = range(len(shape)) if axis is None else np.atleast_1d(axis) % len(shape)
    return tuple(
        1 if i in set(int(a) for a in axes) else n for i, n in enumerate(shape)
    )


def pow2(k: Array, dtype: Any) -> Array:
    """$2^k$ in float32 or float64 (`dtype`), exactly, from its bits; `k` must keep
    it normal (XLA may flush a subnormal to zero)."""
    if jnp.dtype(dtype) == jnp.float64:
        bits = jnp.left_shift(k.astype(jnp.int64) + 1023, 52)
        return jax.lax.bitcast_convert_type(bits, jnp.float64)
    bits = jnp.left_shift(k.astype(jnp.int32) + 127, 23)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def exponent_part(m: Array) -> Array:
    r"""$2^{\lfloor \log_2 m \rfloor}$ for a normal positive `m` (float32 or
    float64), from its exponent bits alone: 0 for 0 or a subnormal, inf for inf or
    NaN. Two bitcasts and an `and`, where `frexp` costs a dozen operations."""
    info = jnp.finfo(m.dtype)
    ints = jnp.int64 if m.dtype == jnp.float64 else jnp.int32
    mask = ((1 << info.nexp) - 1) << info.nmant  # the exponent field
    bits = jax.lax.bitcast_convert_type(m, ints) & jnp.asarray(mask, ints)
    return jax.lax.bitcast_convert_type(bits, m.dtype)


def power_of_two_near(m: Array) -> Array:
    r"""A power of two $p$ with $p \le m < 2p$ for a normal positive `m`, clipped to
    $[2^{-126}, 2^{126}]$ (float32; float64 likewise) so that $p$ and $1/p$ are
    both normal: 0 and subnormals get the smallest, inf and NaN the largest. It
    has no derivative (`m` is held constant): dividing by it is exact, and scales
    a quantity and its derivatives of every order into range together."""
    info = jnp.finfo(m.dtype)
    m = jax.lax.stop_gradient(m)
    return jnp.clip(exponent_part(m), 2.0**info.minexp, 2.0 ** (info.maxexp - 2))


class _Safe(ElementwiseRule):
    exact: ClassVar[bool] = True


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


def _is_python_number(a: Any) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool)


def check_inputs(rule: str, args: tuple[Any, ...], kinds: dict[str, str]) -> None:
    """A `TypeError` naming `rule` and the argument unless each of `args` is an
    array of its kind (`"float"`; `"number"`, a floating-point array or a Python
    int or float; `"bool"`; `"bool or None"`), and a `ValueError` naming their
    shapes unless they broadcast together."""
    for arg, (name, kind) in zip(args, kinds.items(), strict=True):
        if kind == "number" and _is_python_number(arg):
            continue
        if kind in ("float", "number"):
            check_float_array(rule, (arg,), argument=name)
        elif not (kind == "bool or None" and arg is None):
            check_array(rule, (arg,), argument=name, what="a boolean array")
            dtype = jnp.result_type(arg)
            if dtype != jnp.bool_:
                raise TypeError(
                    f"`{rule}` expects a boolean array for `{name}`, got dtype "
                    f"{dtype}. Compare first, e.g. `{name} != 0`."
                )
    shapes = [jnp.shape(a) for a in args if a is not None]
    try:
        jnp.broadcast_shapes(*shapes)
    except ValueError:
        listed = ", ".join(
            f"`{n}` {jnp.shape(a)}"
            for n, a in zip(kinds, args, strict=True)
            if a is not None
        )
        raise ValueError(
            f"`{rule}`: the shapes of its inputs must broadcast together; got {listed}."
        ) from None


def float_dtype(*args: Any) -> Any:
    """The dtype of the floating-point inputs together (`jnp.result_type`: a weak
    Python float keeps a bfloat16 array bfloat16)."""
    return jnp.result_type(*args)


def widened(*args: Any) -> tuple[Any, list[Array]]:
    """The inputs' common dtype, and each input in (at least) float32."""
    dtype = float_dtype(*args)
    return dtype, [jnp.asarray(a, wide(dtype)) for a in args]
