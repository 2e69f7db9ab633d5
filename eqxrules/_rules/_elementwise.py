r"""What the elementwise straight-through rules share: the `_Elementwise` base (the
tangent is the incoming tangent times a slope) and a few exact helpers.

Notation in the docstrings: $t$ is the incoming tangent, $[\cdot]$ is 1 where the
condition holds and 0 elsewhere, and $\operatorname{sign}(x)$ is $+1$ for $x \ge 0$
and $-1$ for $x < 0$ (so $\operatorname{sign}(0) = +1$ and outputs are only $\pm 1$).

NaN inputs give NaN values: $\operatorname{sign}(\mathrm{NaN}) = \mathrm{NaN}$, and
every step and quantiser propagates NaN likewise (a categorical rule makes the whole
row along `axis` NaN), so a NaN is never silently turned into a finite level. The
derivative at NaN is what the formula gives: a mask such as
$[\lvert x \rvert \le c]$ is false there (0), an identity derivative passes $t$, a
smooth surrogate is NaN. At $\pm\infty$ the values are the limits ($\pm 1$, the end
levels) and the derivatives the surrogates' limits (0 outside a clip), except the
softmax derivative of a categorical rule, which is NaN along a row holding $+\infty$
(softmax has no value there) while the value is one-hot.

Masked derivatives are selected, never multiplied: where a rule's own derivative is
exactly 0 (a mask false, a slope 0), the tangent and cotangent are exactly 0 whatever
comes in, an inf or NaN cotangent or scale included (a bare `t * mask` would give
`0 * inf = NaN`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._catalogue import JVPRule

sg = jax.lax.stop_gradient


class _Elementwise(JVPRule):
    """An elementwise rule whose tangent is `t · slope(x)`, in the input's dtype.
    `slope` may return a boolean mask (the tangent is `t` where it holds, else 0),
    an array of slopes, or `None` for the identity (`t` passes through). Where the
    slope is 0 (or the mask false) the tangent is selected to be exactly 0, never
    multiplied: an inf or NaN incoming tangent or cotangent there gives 0."""

    def slope(self, x: Array) -> Array | None:
        raise NotImplementedError

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        **kwargs: Any,
    ) -> Any:
        (x,) = args
        (t,) = t_args
        if t is None:
            return None
        s = self.slope(x)
        if s is None:
            return t
        if s.dtype == jnp.bool_:
            return jnp.where(s, t, jnp.zeros_like(t))
        # Selected, not multiplied, where the slope is 0: an inf or NaN tangent
        # there gives 0, not `0 * inf`.
        return jnp.where(s == 0, jnp.zeros_like(t), t * s)


def wide(dtype: Any) -> Any:
    # Values of the quantisers are computed in at least float32 and cast back: the
    # nearest level of a bf16 input is then found exactly, and only rounded once.
    return jnp.promote_types(dtype, jnp.float32)


def sign(x: Array) -> Array:
    return jnp.where(jnp.isnan(x), x, jnp.where(x >= 0, 1, -1).astype(x.dtype))


def reference_sign(x: Array) -> Array:
    # A NaN fails both comparisons and falls through to itself.
    one = jnp.ones_like(x)
    return jnp.where(x < 0, -one, jnp.where(x >= 0, one, x))


def masked_identity(x: Array, mask: Array) -> Array:
    """A function whose autodiff derivative is `mask` (boolean), value irrelevant."""
    return jnp.where(mask, x, jnp.zeros_like(x))


def clip_kinks(clip_value: float | None) -> tuple[float, ...]:
    """`±clip_value`, where a clipped mask jumps (none without a clip)."""
    return () if clip_value is None else (-clip_value, clip_value)
