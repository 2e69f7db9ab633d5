"""`quantized_ragged_dot` forward and backward (issue 38 §4): against
`lax.ragged_dot` in float32, and against the same steps written by hand.

For each recipe (identity, `fp8()`, `mxfp8()`) at 8 experts, m = 1024 rows,
k = n = 256, a jitted `value_and_grad` with respect to both operands of
`vdot(f(lhs, rhs), dy)` with fixed, uneven group sizes (an empty group among
them), where `f` is

- `quantized_ragged_dot(lhs, rhs, group_sizes, recipe=...)`;
- `hand_written(recipe)`: one `jax.custom_vjp` written as a careful user would: each
  group's rows gathered from row 0 (`jnp.take`, zeros past the group), each
  group's rows and matrix quantised by the recipe's public quantisers (`jax.vmap`
  over the groups) along what each product contracts, the weight gradient's
  along each group's rows, its left operand quantised in the forward pass and
  kept in its formats (as the other sections' baselines keep theirs); the rows
  put back in place; then `lax.ragged_dot` and its VJP;
- `lax.ragged_dot` in float32 (the float32 target: flops and temp bytes).

XLA's CPU backend computes `lax.ragged_dot` densely over the groups (about 8x the
useful flops here); a GPU runs it as a grouped matrix product (JAX's
`ragged_dot` lowers to XLA's `RaggedDot`, which its GPU backend implements with a
grouped kernel). Each group's own scales are computed on `[g, m, ·]` layouts, as
the dense CPU product does itself."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import eqxrules
from eqxrules import recipes

from .. import exact, report, xla
from ..config import Job
from .quantized_dot import PAIRS, TARGET_S, _equal

NAME = "ragged_dot"
DEFAULT = True
F32 = jnp.float32
# Issue 38 §4: at most these times `lax.ragged_dot`'s flops and temp bytes in
# float32, and at most the hand-written steps' (1.00).
FLOAT32_TARGET = 1.25
XLA_TARGET = 1.00
RECIPES = {
    "identity": recipes.identity(),
    "fp8()": recipes.fp8(),
    "mxfp8()": recipes.mxfp8(),
}
# (groups, m, k, n). By `job.quick`.
SHAPES = {False: ((8, 1024, 256, 256),), True: ((4, 128, 64, 64),)}


def _sizes(groups: int, m: int) -> np.ndarray:
    """Uneven group sizes summing to `m`, the second group empty."""
    weights = np.arange(1, groups + 1, dtype=np.float64)
    weights[1] = 0
    sizes = np.floor(m * weights / weights.sum()).astype(np.int32)
    sizes[-1] += m - sizes.sum()
    return sizes


def _along(q: Any, axis: int) -> Any:
    """`q` with its blocks along `axis`."""
    if isinstance(q, eqxrules.BlockQuantizer) and not isinstance(q.axis, tuple):
        q = dataclasses.replace(q, axis=axis)
    return q


def _q(q: Any, v: jax.Array, axis: int) -> exact.Operand:
    """`q` on `v`, blocks along `axis`."""
    return exact.quantised(_along(q, axis), v, None)


def _per_tensor(parts: Any) -> exact.Operand:
    """Operands of each group (`[g, ...]` values, `[g]` tensor scales or `None`),
    each value times its own tensor scale: a product cannot take a scale per
    group out of its sum."""
    value, scale, exact_payload = parts
    if scale is None:
        return exact.Operand(value, None, exact_payload)
    return exact.Operand(value * scale.reshape(-1, *(1,) * (value.ndim - 1)))


def _each(q: Any, per: jax.Array, axis: int) -> exact.Operand:
    """`q` on each group (`per[i]`)."""
    if q is None:
        return exact.Operand(per)
    value, scale = jax.vmap(lambda u: _q(q, u, axis)[:2])(per)
    return _per_tensor((value, scale, _q(q, per[0], axis).exact))


def _kept_each(q: Any, per: jax.Array, axis: int) -> Any:
    """`exact.kept` of each group (`per[i]`): its parts in their formats."""
    if q is None:
        return per
    return jax.vmap(lambda u: exact.kept(_along(q, axis), u, None))(per)


def _loaded_each(q: Any, k: Any, like: Any, axis: int) -> exact.Operand:
    """The operands `_kept_each` kept (`k`), each group's of `like`'s shape."""
    if q is None:
        return exact.Operand(k)
    fitted = _along(q, axis)
    value, scale, _ = jax.vmap(lambda u: exact.loaded(fitted, u, like))(k)
    first = jax.tree.map(lambda t: t[0], k)
    return _per_tensor((value, scale, exact.loaded(fitted, first, like).exact))


def _place(m: int, sizes: jax.Array) -> jax.Array:
    """Each of `m` rows' place in the `[g, m, ·]` layout of `_per_group`."""
    starts = jnp.cumsum(sizes) - sizes
    local = jnp.arange(m)
    group = jnp.clip(
        jnp.searchsorted(jnp.cumsum(sizes), local, side="right"), 0, len(sizes) - 1
    )
    return jnp.stack([group, local - starts[group]])


def _per_group(v: jax.Array, sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`[g, m, ·]`: each group's rows from row 0, zeros past it; and each row's
    place in that layout."""
    m = v.shape[0]
    starts = jnp.cumsum(sizes) - sizes
    local = jnp.arange(m)
    rows = starts[:, None] + local[None, :]
    inside = local[None, :] < sizes[:, None]
    per = jnp.where(inside[..., None], jnp.take(v, jnp.clip(rows, 0, m - 1), axis=0), 0)
    return per, _place(m, sizes)


def _back(per: jax.Array, place: jax.Array) -> jax.Array:
    return per[place[0], place[1]]


def hand_written(recipe: recipes.Recipe) -> Callable[..., jax.Array]:
    """`f(lhs, rhs, sizes)`: the recipe's three products in one `jax.custom_vjp`
    (the recipes here draw nothing: no key)."""
    p = recipe.products()

    def rows(q: Any, v: jax.Array, sizes: jax.Array, axis: int) -> exact.Operand:
        per, place = _per_group(v, sizes)
        return exact.reshaped(_each(q, per, axis), lambda u: _back(u, place))

    def dot(sizes):
        def product(a, b, precision):
            return jax.lax.ragged_dot(
                a, b, sizes, precision=precision, preferred_element_type=F32
            )

        return product

    @jax.custom_vjp
    def f(a, b, sizes):
        qa, qb = rows(p.fwd.lhs, a, sizes, 1), _each(p.fwd.rhs, b, 0)
        return exact.contract(dot(sizes), qa, qb)

    def f_fwd(a, b, sizes):
        # The weight gradient's left operand, each group's, quantised now and
        # kept in its formats (its `[g, m, k]` layout).
        kept = _kept_each(p.dw.lhs, _per_group(a, sizes)[0], 0)
        return f(a, b, sizes), (kept, b, sizes)

    def f_bwd(residuals, dy):
        kept, b, sizes = residuals
        qb = exact.reshaped(_each(p.dx.rhs, b, 1), lambda u: jnp.swapaxes(u, 1, 2))
        da = exact.contract(dot(sizes), rows(p.dx.lhs, dy, sizes, 1), qb)

        def weight_gradient(qa, g, precision):
            forward = dot(sizes)
            return jax.vjp(lambda u: forward(qa, u, precision), b)[1](g)[0]

        m, k = dy.shape[0], b.shape[1]
        like = jax.ShapeDtypeStruct((m, k), F32)
        place = _place(m, sizes)
        qa = exact.reshaped(
            _loaded_each(p.dw.lhs, kept, like, 0), lambda u: _back(u, place)
        )
        g = rows(p.dw.rhs, dy, sizes, 0)
        return da, exact.contract(weight_gradient, qa, g), None

    f.defvjp(f_fwd, f_bwd)
    return f


def losses(recipe: recipes.Recipe) -> dict[str, Callable[..., jax.Array]]:
    hand = hand_written(recipe)

    def ours(a, b, sizes):
        return eqxrules.quantized_ragged_dot(a, b, sizes, recipe=recipe)

    def plain(a, b, sizes):
        return jax.lax.ragged_dot(a, b, sizes, preferred_element_type=F32)

    def loss(f):
        return lambda a, b, dy, sizes: jnp.vdot(f(a, b, sizes), dy)

    return dict(eqxrules=loss(ours), hand=loss(hand), float32=loss(plain))


def problem(shape: tuple[int, int, int, int]) -> tuple[Any, ...]:
    g, m, k, n = shape
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = (rng.standard_normal((g, k, n)) / np.sqrt(k)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    return jnp.asarray(a), jnp.asarray(b), jnp.asarray(dy), jnp.asarray(_sizes(g, m))


def _row(name: str, shape: tuple[int, int, int, int], job: Job) -> dict[str, Any]:
    job.log(f"  {name} {shape}")
    args = problem(shape)
    figures = {
        v: xla.figures(jax.value_and_grad(loss, (0, 1)), *args)
        for v, loss in losses(RECIPES[name]).items()
    }
    ours, hand = figures["eqxrules"], figures["hand"]
    return dict(
        recipe=name,
        shape=list(shape),
        figures={v: xla.deterministic(f) for v, f in figures.items()},
        equal=_equal(ours["compiled"], hand["compiled"], args),
        wall={
            v: xla.interleaved(
                ours["compiled"],
                figures[v]["compiled"],
                args,
                PAIRS[job.quick],
                TARGET_S[job.quick],
            )
            for v in ("hand", "float32")
        },
        load=os.getloadavg()[0],
    )


def run(job: Job) -> dict[str, Any]:
    rows = [_row(name, shape, job) for shape in SHAPES[job.quick] for name in RECIPES]
    return dict(rows=rows, pairs=PAIRS[job.quick], target_s=TARGET_S[job.quick])


def _shape(shape: list[int]) -> str:
    g, m, k, n = shape
    return f"{g} groups, {m}x{k} @ {g}x{k}x{n}"


def within(row: dict[str, Any], of: str, target: float) -> bool:
    o, b = row["figures"]["eqxrules"], row["figures"][of]
    return o["flops"] <= target * b["flops"] and o["temp"] <= target * b["temp"]


def render(res: dict[str, Any] | None, results: dict[str, Any]) -> list[str]:
    if res is None:
        return []
    rows = res["rows"]
    lines = report.opening(
        NAME, res, results, float32_target=FLOAT32_TARGET, xla_target=XLA_TARGET
    )
    for r in rows:
        o, h, f = (r["figures"][v] for v in ("eqxrules", "hand", "float32"))
        lines.append(
            f"| {r['recipe']} | {_shape(r['shape'])} | {o['flops']:.4g} | "
            f"{report.mib(o['temp'])} | {report.ratio(o['flops'], f['flops'])} | "
            f"{report.ratio(o['temp'], f['temp'])} | "
            f"{report.ratio(o['flops'], h['flops'])} | "
            f"{report.ratio(o['temp'], h['temp'])} | "
            f"{'yes' if r['equal'] else 'no'} |"
        )
    lines += report.fill(NAME, "wall", pairs=res["pairs"], target_s=res["target_s"])
    for r in rows:
        w = r["wall"]
        lines.append(
            f"| {r['recipe']} | {_shape(r['shape'])} | "
            f"{w['float32']['a_s'] * 1e3:.1f} | {w['float32']['b_s'] * 1e3:.1f} | "
            f"{report.spread(w['float32'])} | {report.spread(w['hand'])} | "
            f"{r['load']:.1f} |"
        )
    lines += report.fill(
        NAME,
        "goals",
        float32_within=sum(within(r, "float32", FLOAT32_TARGET) for r in rows),
        hand_within=sum(within(r, "hand", XLA_TARGET) for r in rows),
        equal=sum(r["equal"] for r in rows),
        total=len(rows),
        float32_target=FLOAT32_TARGET,
        xla_target=XLA_TARGET,
    )
    return lines + [""]
