r"""What the elementwise straight-through rules share: the [`ElementwiseRule`][]
base (the tangent is the incoming tangent times a slope) and a few exact helpers.

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

from .._catalogue import ElementwiseRule

sg = jax.lax.stop_gradient


# The public base, under the name the rule modules use.
_Elementwise = ElementwiseRule


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
