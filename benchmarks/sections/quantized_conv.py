"""`quantized_conv` forward and backward, against the same steps written by hand
(issue 26 §7): section 9's measurement for a convolution.

For each recipe (`mxfp8()`, `fp8()`, `nvfp4()` without its Hadamard transform,
which a convolution refuses, with and without stochastic rounding) and each shape,
a jitted `value_and_grad` with respect to `x` and `w` of `vdot(f(x, w), dy)`,
where `f` is

- `quantized_conv(x, w, (1, 1), "SAME")` on the whole batch (NCHW, OIHW), and
  under `jax.vmap` over the examples (as an `eqx.nn.Conv2d` sees them), its
  `axis_name` naming that `vmap` (so one call on the batch);
- `hand_written(recipe)`: one `jax.custom_vjp` written as a careful user would for
  the same recipe: the forward product's operands quantised by the recipe's public
  quantisers along the input channels (axis 1 of `x` and `w`), the input
  gradient's along the output channels (axis 1 of `dy`, axis 0 of `w`), the weight
  gradient's along the batch and positions (each operand's channels moved first
  and the rest flattened), the keys split as `quantized_conv` documents, then the
  convolution and its two transposes (`jax.vjp` of `lax.conv_general_dilated`);
- `lax.conv_general_dilated` in float32, unquantised (for information)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import eqxrules
from eqxrules import recipes
from eqxrules._lowp.recipes import reads_key

from .. import exact, xla
from ..config import Job
from .quantized_dot import PAIRS, TARGET_S, render_rows, rows_of

NAME = "quantized_conv"
DEFAULT = True
F32 = jnp.float32
_NO_RHT = dataclasses.replace(recipes.nvfp4(), hadamard=None)
RECIPES = {
    "mxfp8()": recipes.mxfp8(),
    "fp8()": recipes.fp8(),
    "nvfp4(), no RHT": _NO_RHT,
    "nvfp4(), no SR, no RHT": dataclasses.replace(_NO_RHT, gradient_rounding="nearest"),
}
# (batch, input channels, output channels, height = width), 3x3 kernels.
SHAPES = {False: ((64, 32, 64, 16), (32, 64, 128, 32)), True: ((8, 32, 32, 8),)}


def _conv(x: jax.Array, w: jax.Array, precision: Any = None) -> jax.Array:
    return jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", precision=precision, preferred_element_type=F32
    )


def _blocked(q: Any, axis: int) -> Any:
    """`q` with its blocks along `axis` (square blocks over the kernel's output and
    input channels, axes 0 and 1, as they are)."""
    if isinstance(q, eqxrules.BlockQuantizer) and not isinstance(q.axis, tuple):
        q = dataclasses.replace(q, axis=axis)
    return q


def _along(q: Any, v: jax.Array, axis: int, key: Any) -> exact.Operand:
    """`q` on `v` with its blocks along `axis` (`_blocked`)."""
    return exact.quantised(_blocked(q, axis), v, key)


def _kept_positions(q: Any, v: jax.Array, key: Any) -> Any:
    """`q` on `v` (NCHW) with its blocks along the batch and positions, kept in
    formats (`exact.kept`): the channels moved first, the rest flattened (whose
    length the shapes' blocks divide). An elementwise `q` (one scale per tensor)
    has no blocks to lay out."""
    if not isinstance(q, eqxrules.BlockQuantizer):
        return exact.kept(q, v, key)
    moved = jnp.moveaxis(v, 1, -1)
    return exact.kept(_blocked(q, 0), moved.reshape(-1, moved.shape[-1]), key)


def _loaded_positions(q: Any, k: Any, shape: tuple[int, ...]) -> exact.Operand:
    """The operand `_kept_positions(q, v, key)` keeps for `v` of `shape`, as the
    product takes it (the layout undone)."""
    if not isinstance(q, eqxrules.BlockQuantizer):
        return exact.loaded(q, k, jax.ShapeDtypeStruct(shape, F32))
    n, c, h, w = shape
    like = jax.ShapeDtypeStruct((n * h * w, c), F32)
    out = exact.loaded(_blocked(q, 0), k, like)
    return exact.reshaped(out, lambda u: jnp.moveaxis(u.reshape(n, h, w, c), -1, 1))


def _positions(q: Any, v: jax.Array, key: Any) -> exact.Operand:
    """`q` on `v` (NCHW) with its blocks along the batch and positions."""
    return _loaded_positions(q, _kept_positions(q, v, key), tuple(v.shape))


def hand_written(recipe: recipes.Recipe) -> Callable[..., jax.Array]:
    """`f(x, w, key)` for NCHW `x` and OIHW `w`: the recipe's three products in one
    plain `jax.custom_vjp`, keys split as `quantized_conv` documents."""
    p = recipe.products()

    def keys(key, n=3):
        return (None,) * n if key is None else tuple(jax.random.split(key, n))

    @jax.custom_vjp
    def f(x, w, key):
        k_x, k_w, _ = keys(keys(key)[0])
        q_x, q_w = _along(p.fwd.lhs, x, 1, k_x), _along(p.fwd.rhs, w, 1, k_w)
        return exact.contract(_conv, q_x, q_w)

    def f_fwd(x, w, key):
        # The weight gradient's left operand, quantised now and kept in formats.
        y = f(x, w, key)
        k_x, _, _ = keys(keys(key)[2])
        return y, (_kept_positions(p.dw.lhs, x, k_x), w, key)

    def f_bwd(residuals, dy):
        kept, w, key = residuals
        _, k_dx, k_dw = keys(key)
        k_g, k_w, _ = keys(k_dx)
        x_like = jax.ShapeDtypeStruct((dy.shape[0], w.shape[1], *dy.shape[2:]), F32)

        def input_gradient(g, q_w, precision):
            return jax.linear_transpose(lambda a: _conv(a, q_w, precision), x_like)(g)[
                0
            ]

        q_g, q_w = _along(p.dx.lhs, dy, 1, k_g), _along(p.dx.rhs, w, 0, k_w)
        dx = exact.contract(input_gradient, q_g, q_w)
        _, k_g, _ = keys(k_dw)

        def weight_gradient(q_x, g, precision):
            return jax.vjp(lambda b: _conv(q_x, b, precision), w)[1](g)[0]

        q_x = _loaded_positions(p.dw.lhs, kept, x_like.shape)
        q_g = _positions(p.dw.rhs, dy, k_g)
        dw = exact.contract(weight_gradient, q_x, q_g)
        return dx, dw, None

    f.defvjp(f_fwd, f_bwd)
    return f


def losses(recipe: recipes.Recipe) -> dict[str, Callable[..., jax.Array]]:
    """`loss(x, w, dy, key) = vdot(f(x, w), dy)` for each way of computing `f`."""

    def ours(x, w, key):
        return eqxrules.quantized_conv(x, w, (1, 1), "SAME", recipe=recipe, key=key)

    def vmapped(x, w, key):
        def one(xi):
            return eqxrules.quantized_conv(
                xi[None], w, (1, 1), "SAME", recipe=recipe, key=key, axis_name="batch"
            )[0]

        return jax.vmap(one, axis_name="batch")(x)

    def loss(f):
        return lambda x, w, dy, key: jnp.vdot(f(x, w, key), dy)

    return dict(
        eqxrules=loss(ours),
        vmapped=loss(vmapped),
        hand=loss(hand_written(recipe)),
        float32=loss(lambda x, w, key: _conv(x, w)),
    )


def problem(recipe: recipes.Recipe, shape: tuple[int, ...]) -> tuple[Any, ...]:
    """`(x, w, dy, key)`: normal data, `w` scaled by `1/√(9·C)`."""
    n, c, o, s = shape
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, s, s)).astype(np.float32)
    w = (rng.standard_normal((o, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32)
    dy = rng.standard_normal((n, o, s, s)).astype(np.float32)
    key = jax.random.key(0) if reads_key(recipe.products()) else None
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy), key


def _row(name: str, shape: tuple[int, ...], job: Job) -> list[dict[str, Any]]:
    recipe = RECIPES[name]
    args = problem(recipe, shape)
    figures = {
        v: xla.figures(jax.value_and_grad(loss, (0, 1)), *args)
        for v, loss in losses(recipe).items()
    }
    return rows_of(name, shape, args, figures, job)


def run(job: Job) -> dict[str, Any]:
    rows = []
    for shape in SHAPES[job.quick]:
        for name in RECIPES:
            rows += _row(name, shape, job)
    return dict(rows=rows, pairs=PAIRS[job.quick], target_s=TARGET_S[job.quick])


def _shape(shape: list[int]) -> str:
    n, c, o, s = shape
    return f"{n}x{c}x{s}x{s} * {o}x{c}x3x3"


def render(res: dict[str, Any] | None, results: dict[str, Any]) -> list[str]:
    return render_rows(NAME, res, results, _shape)
