"""`quantized_dot_general` forward and backward, against the same steps written by
hand (issue 26 §7): section 9's measurement for a batched contraction, attention's
scores `s[b, q, k] = Σ_d q[b, q, d] k[b, k, d]`.

For each recipe and shape, a jitted `value_and_grad` with respect to both operands
of `vdot(f(q, k), dy)`, where `f` is

- `quantized_dot_general(q, k, (((2,), (2,)), ((0,), (0,))))` on the whole batch,
  and under `jax.vmap` over the batch, its `axis_name` naming that `vmap` (both
  operands mapped: one more batch dimension of one call);
- `hand_written(recipe)`: one `jax.custom_vjp` written as a careful user would: the
  forward product's operands quantised by the recipe's public quantisers along `d`,
  the `q` gradient's along `k` (axis 2 of `dy`, axis 1 of `k`), the `k` gradient's
  along `q` (axis 1 of `q` and `dy`), after the recipe's random Hadamard rotation of
  both along it, keys split as the function documents; then `lax.dot_general` and
  its transposes (`jax.vjp`); square weight blocks over `k`'s axes 1 and 2;
- `lax.dot_general` in float32, unquantised (for information)."""

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
from .quantized_dot import PAIRS, RECIPES, TARGET_S, _rotate, render_rows, rows_of

NAME = "quantized_dot_general"
DEFAULT = True
F32 = jnp.float32
DIMS = (((2,), (2,)), ((0,), (0,)))
# (batch, queries = keys, head dimension).
SHAPES = {False: ((16, 256, 64), (8, 512, 128)), True: ((2, 32, 64),)}


def _dot(a: jax.Array, b: jax.Array, precision: Any = None) -> jax.Array:
    return jax.lax.dot_general(
        a, b, DIMS, precision=precision, preferred_element_type=F32
    )


def _blocked(q: Any, axis: int, square=(1, 2)) -> Any:
    """`q` with its blocks along `axis` (square blocks over `square`)."""
    if isinstance(q, eqxrules.BlockQuantizer):
        axes = square if isinstance(q.axis, tuple) else axis
        q = dataclasses.replace(q, axis=axes)
    return q


def _q(q: Any, v: jax.Array, axis: int, key: Any, square=(1, 2)) -> exact.Operand:
    """`q` on `v`, its blocks along `axis` (square blocks over `square`)."""
    return exact.quantised(_blocked(q, axis, square), v, key)


def hand_written(recipe: recipes.Recipe) -> Callable[..., jax.Array]:
    """`f(q, k, key)`: the recipe's three products in one plain `jax.custom_vjp`."""
    p = recipe.products()

    def keys(key):
        return (None,) * 3 if key is None else tuple(jax.random.split(key, 3))

    def rotated(spec, a, a_axis, b, b_axis, key):
        k_a, k_b, k_s = keys(key)
        if spec.hadamard is not None:
            signs = jax.random.rademacher(k_s, (spec.hadamard,), F32)
            a, b = _rotate(a, a_axis, signs), _rotate(b, b_axis, signs)
        return a, b, k_a, k_b

    def operands(spec, a, a_axis, b, b_axis, key):
        a, b, k_a, k_b = rotated(spec, a, a_axis, b, b_axis, key)
        return _q(spec.lhs, a, a_axis, k_a), _q(spec.rhs, b, b_axis, k_b)

    @jax.custom_vjp
    def f(q, k, key):
        return exact.contract(_dot, *operands(p.fwd, q, 2, k, 2, keys(key)[0]))

    def f_fwd(q, k, key):
        # The weight gradient's left operand, quantised now and kept in formats.
        y = f(q, k, key)
        r, _, k_r, _ = rotated(p.dw, q, 1, q, 1, keys(key)[2])
        kept = exact.kept(_blocked(p.dw.lhs, 1), r, k_r)
        return y, (kept, k, key)

    def f_bwd(residuals, dy):
        kept, k, key = residuals
        _, k_dq, k_dk = keys(key)
        q_like = jax.ShapeDtypeStruct((*dy.shape[:2], k.shape[2]), F32)

        def dq_of(g, qk, precision):
            return jax.linear_transpose(lambda a: _dot(a, qk, precision), q_like)(g)[0]

        def dk_of(qq, g, precision):
            return jax.vjp(lambda b: _dot(qq, b, precision), k)[1](g)[0]

        dq = exact.contract(dq_of, *operands(p.dx, dy, 2, k, 1, k_dq))
        _, g, _, k_g = rotated(p.dw, dy, 1, dy, 1, k_dk)
        q_q = exact.loaded(_blocked(p.dw.lhs, 1), kept, q_like)
        dk = exact.contract(dk_of, q_q, _q(p.dw.rhs, g, 1, k_g))
        return dq, dk, None

    f.defvjp(f_fwd, f_bwd)
    return f


def losses(recipe: recipes.Recipe) -> dict[str, Callable[..., jax.Array]]:
    """`loss(q, k, dy, key) = vdot(f(q, k), dy)` for each way of computing `f`."""

    def ours(q, k, key):
        return eqxrules.quantized_dot_general(q, k, DIMS, recipe=recipe, key=key)

    def vmapped(q, k, key):
        one = (((1,), (1,)), ((), ()))
        return jax.vmap(
            lambda a, b: eqxrules.quantized_dot_general(
                a, b, one, recipe=recipe, key=key, axis_name="batch"
            ),
            axis_name="batch",
        )(q, k)

    def loss(f):
        return lambda q, k, dy, key: jnp.vdot(f(q, k, key), dy)

    return dict(
        eqxrules=loss(ours),
        vmapped=loss(vmapped),
        hand=loss(hand_written(recipe)),
        float32=loss(lambda q, k, key: _dot(q, k)),
    )


def problem(recipe: recipes.Recipe, shape: tuple[int, ...]) -> tuple[Any, ...]:
    """`(q, k, dy, key)`: normal data, `k` scaled by `1/√d`."""
    b, t, d = shape
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, t, d)).astype(np.float32)
    k = (rng.standard_normal((b, t, d)) / np.sqrt(d)).astype(np.float32)
    dy = rng.standard_normal((b, t, t)).astype(np.float32)
    key = jax.random.key(0) if reads_key(recipe.products()) else None
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(dy), key


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
    b, t, d = shape
    return f"{b}x{t}x{d} · {b}x{t}x{d}"


def render(res: dict[str, Any] | None, results: dict[str, Any]) -> list[str]:
    return render_rows(NAME, res, results, _shape)
