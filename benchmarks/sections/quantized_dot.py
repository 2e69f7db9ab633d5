"""`quantized_dot` forward and backward, against the same steps written by hand.

For each recipe (`mxfp8()`, `fp8()`, `nvfp4()` with and without stochastic
rounding and the Hadamard transform) and each shape, a jitted `value_and_grad`
with respect to `x` and `w` of `vdot(f(x, w), dy)` (so the cotangent is a random
`dy`), where `f` is

- `quantized_dot` on the whole batch, and under `jax.vmap` over the examples (as a
  layer sees them), its `axis_name` naming that `vmap` (so one call on the
  batch);
- `hand_written(recipe)`: one `jax.custom_vjp` written as a careful user would for
  the same recipe: each product's operands quantised by the same public quantisers
  along its reduced axis (their payloads and tensor scales, `benchmarks/exact.py`),
  the same random Hadamard rotation, the same keys, then `lax.dot_general` with
  float32 output at a named precision;
- `jnp.dot` in float32, unquantised (for information).

XLA's flops and bytes (`cost_analysis()`) and temp bytes (`memory_analysis()`) are
deterministic; wall time is the median of interleaved A/B pairs."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import eqxrules
from eqxrules import recipes
from eqxrules._lowp.recipes import reads_key

from .. import exact, report, xla
from ..config import Job

NAME = "quantized_dot"
DEFAULT = True
F32 = jnp.float32
# Issue 19 §6: XLA's flops and temp bytes at most these times the hand-written
# composition's, and wall time.
XLA_TARGET = 1.00
WALL_TARGET = 1.05
RECIPES = {
    "mxfp8()": recipes.mxfp8(),
    "fp8()": recipes.fp8(),
    "nvfp4()": recipes.nvfp4(),
    "nvfp4(), no SR, no RHT": dataclasses.replace(
        recipes.nvfp4(), gradient_rounding="nearest", hadamard=None
    ),
}
# (M, K, N): x is M x K, w is K x N. By `job.quick`.
SHAPES = {False: ((1024, 512, 512), (4096, 1024, 1024)), True: ((256, 128, 64),)}
PAIRS = {False: 21, True: 3}
TARGET_S = {False: 0.5, True: 0.02}


def _along(q: Any, axis: int) -> Any:
    """The public quantiser `q` with its blocks along `axis`: an elementwise one, or
    one with square blocks, as it is."""
    if q is None or not hasattr(q, "axis") or isinstance(q.axis, tuple):
        return q
    return dataclasses.replace(q, axis=axis)


def _hadamard(n: int) -> np.ndarray:
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def _rotate(a: jax.Array, axis: int, signs: jax.Array) -> jax.Array:
    """`H (s ⊙ v) / √n` on every block of `n` consecutive elements along `axis`."""
    n = signs.shape[0]
    moved = jnp.moveaxis(a, axis, -1)
    blocks = moved.reshape(*moved.shape[:-1], -1, n) * signs
    out = jnp.matmul(blocks, _hadamard(n), precision=jax.lax.Precision.HIGHEST)
    out = out * np.float32(1 / math.sqrt(n))
    return jnp.moveaxis(out.reshape(moved.shape), -1, axis)


def hand_written(recipe: recipes.Recipe) -> Callable[..., jax.Array]:
    """`f(x, w, key)` for a 2-D `x`: the recipe's three products in one plain
    `jax.custom_vjp`, with the keys split as `quantized_dot` documents (one per
    product, then one per operand and one for the Hadamard signs)."""
    p = recipe.products()

    def split(spec, key):
        """`(k_a, k_b, signs)`: each operand's key, the Hadamard signs (or `None`)."""
        if key is None:
            return None, None, None
        k_a, k_b, k_signs = jax.random.split(key, 3)
        if spec.hadamard is None:
            return k_a, k_b, None
        return k_a, k_b, jax.random.rademacher(k_signs, (spec.hadamard,), F32)

    def rotated(a, axis, signs):
        return a if signs is None else _rotate(a, axis, signs)

    def product(spec, a, a_axis, b, b_axis, key, qa=None):
        k_a, k_b, signs = split(spec, key)
        if qa is None:
            a = rotated(a, a_axis, signs)
            qa = exact.quantised(_along(spec.lhs, a_axis), a, k_a)
        b = rotated(b, b_axis, signs)
        qb = exact.quantised(_along(spec.rhs, b_axis), b, k_b)
        dims = (((a_axis,), (b_axis,)), ((), ()))

        def dot(x, y, precision):
            return jax.lax.dot_general(
                x, y, dims, precision=precision, preferred_element_type=F32
            )

        return exact.contract(dot, qa, qb)

    def keys(key):
        return (None,) * 3 if key is None else tuple(jax.random.split(key, 3))

    @jax.custom_vjp
    def f(x, w, key):
        return product(p.fwd, x, 1, w, 0, keys(key)[0])

    def f_fwd(x, w, key):
        # The weight gradient's left operand, quantised now and kept in formats.
        y = f(x, w, key)
        k_x, _, signs = split(p.dw, keys(key)[2])
        kept = exact.kept(_along(p.dw.lhs, 0), rotated(x, 0, signs), k_x)
        return y, (kept, w, key)

    def f_bwd(residuals, dy):
        kept, w, key = residuals
        _, k_dx, k_dw = keys(key)
        like = jax.ShapeDtypeStruct((dy.shape[0], w.shape[0]), F32)
        q_x = exact.loaded(_along(p.dw.lhs, 0), kept, like)
        dx = product(p.dx, dy, 1, w, 1, k_dx)
        dw = product(p.dw, None, 0, dy, 0, k_dw, q_x)
        return dx, dw, None

    f.defvjp(f_fwd, f_bwd)
    return f


def losses(recipe: recipes.Recipe) -> dict[str, Callable[..., jax.Array]]:
    """`loss(x, w, dy, key) = vdot(f(x, w), dy)` for each way of computing `f`."""
    hand = hand_written(recipe)

    def ours(x, w, key):
        return eqxrules.quantized_dot(x, w, recipe=recipe, key=key)

    def vmapped(x, w, key):
        def one(xi):
            return eqxrules.quantized_dot(
                xi, w, recipe=recipe, key=key, axis_name="batch"
            )

        return jax.vmap(one, axis_name="batch")(x)

    def loss(f):
        return lambda x, w, dy, key: jnp.vdot(f(x, w, key), dy)

    return dict(
        eqxrules=loss(ours),
        vmapped=loss(vmapped),
        hand=loss(hand),
        float32=loss(lambda x, w, key: jnp.dot(x, w)),
    )


def problem(recipe: recipes.Recipe, shape: tuple[int, int, int]) -> tuple[Any, ...]:
    """`(x, w, dy, key)`: normal data, `w` scaled by `1/√K`; `key` is `None` for a
    recipe that draws nothing."""
    m, k, n = shape
    rng = np.random.default_rng(0)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    key = jax.random.key(0) if reads_key(recipe.products()) else None
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy), key


def measure(
    recipe: recipes.Recipe, shape: tuple[int, int, int]
) -> dict[str, dict[str, Any]]:
    """XLA's figures of each loss's jitted `value_and_grad` w.r.t. `x` and `w`."""
    args = problem(recipe, shape)
    return {
        v: xla.figures(jax.value_and_grad(loss, (0, 1)), *args)
        for v, loss in losses(recipe).items()
    }


def _equal(a: Any, b: Any, args: tuple[Any, ...]) -> bool:
    """Whether two compiled programs give the same value and gradients, bit for
    bit."""
    out_a, out_b = jax.tree.leaves(a(*args)), jax.tree.leaves(b(*args))
    return all(np.array_equal(u, v) for u, v in zip(out_a, out_b))


def _row(name: str, shape: tuple[int, int, int], job: Job) -> list[dict[str, Any]]:
    recipe = RECIPES[name]
    return rows_of(name, shape, problem(recipe, shape), measure(recipe, shape), job)


def rows_of(
    name: str, shape: Any, args: tuple[Any, ...], figures: dict[str, Any], job: Job
) -> list[dict[str, Any]]:
    """The rows (whole batch, then `vmap`) of one recipe and shape, from the XLA
    `figures` of each way of computing it on `args`, with their wall times."""
    hand, f32 = figures["hand"], figures["float32"]
    rows = []
    for mode in ("eqxrules", "vmapped"):
        job.log(f"  {name} {shape} {mode}")
        ours = figures[mode]
        row: dict[str, Any] = dict(
            recipe=name,
            shape=list(shape),
            mode=mode,
            figures={v: xla.deterministic(figures[v]) for v in (mode, "hand")},
            float32=xla.deterministic(f32),
            same_program=xla.same_program(ours["compiled"], hand["compiled"]),
            equal=_equal(ours["compiled"], hand["compiled"], args),
            hlo_diff=None,
            wall={},
        )
        if ours["flops"] > hand["flops"] or ours["temp"] > hand["temp"]:
            row["hlo_diff"] = xla.hlo_diff(ours["compiled"], hand["compiled"])
        for v, theirs in (("hand", hand), ("float32", f32)):
            if v == "float32" and mode == "vmapped":
                continue  # the same program as on the whole batch: measured once
            row["wall"][v] = xla.interleaved(
                ours["compiled"],
                theirs["compiled"],
                args,
                PAIRS[job.quick],
                TARGET_S[job.quick],
            )
        row["load"] = os.getloadavg()[0]
        rows.append(row)
    return rows


def run(job: Job) -> dict[str, Any]:
    rows = []
    for shape in SHAPES[job.quick]:
        for name in RECIPES:
            rows += _row(name, shape, job)
    return dict(rows=rows, pairs=PAIRS[job.quick], target_s=TARGET_S[job.quick])


_MODES = {"eqxrules": "whole batch", "vmapped": "`vmap` over examples"}


def _shape(shape: list[int]) -> str:
    m, k, n = shape
    return f"{m}x{k} @ {k}x{n}"


def render(res: dict[str, Any] | None, results: dict[str, Any]) -> list[str]:
    return render_rows(NAME, res, results, _shape)


def render_rows(
    name: str, res: dict[str, Any] | None, results: dict[str, Any], shape: Any
) -> list[str]:
    """The section `name`'s lines: its two tables and its goals, each row's
    operands written by `shape`."""
    if res is None:
        return []
    rows = res["rows"]
    lines = report.opening(
        name, res, results, xla_target=XLA_TARGET, wall_target=WALL_TARGET
    )
    for r in rows:
        o, h = r["figures"][r["mode"]], r["figures"]["hand"]
        lines.append(
            f"| {r['recipe']} | {shape(r['shape'])} | {_MODES[r['mode']]} | "
            f"{o['flops']:.4g} | {report.mib(o['temp'])} | "
            f"{report.ratio(o['flops'], h['flops'])} | "
            f"{report.ratio(o['bytes'], h['bytes'])} | "
            f"{report.ratio(o['temp'], h['temp'])} | "
            f"{'yes' if r['same_program'] else 'no'} | "
            f"{'yes' if r['equal'] else 'no'} |"
        )
    lines += report.fill(name, "wall", pairs=res["pairs"], target_s=res["target_s"])
    for r in rows:
        w = r["wall"]
        o, f = r["figures"][r["mode"]], r["float32"]
        lines.append(
            f"| {r['recipe']} | {shape(r['shape'])} | {_MODES[r['mode']]} | "
            f"{w['hand']['a_s'] * 1e3:.1f} | {w['hand']['b_s'] * 1e3:.1f} | "
            f"{report.spread(w['hand'])} | "
            f"{report.spread(w.get('float32'))} | "
            f"{report.ratio(o['flops'], f['flops'])} | "
            f"{report.mib(f['temp'])} | {r['load']:.1f} |"
        )
    return lines + _goals(name, rows) + [""]


def within_xla(row: dict[str, Any]) -> bool:
    """Whether the row's flops and temp bytes are within `XLA_TARGET` of the
    hand-written composition's."""
    o, h = row["figures"][row["mode"]], row["figures"]["hand"]
    return o["flops"] <= XLA_TARGET * h["flops"] and o["temp"] <= XLA_TARGET * h["temp"]


def _goals(name: str, rows: list[dict[str, Any]]) -> list[str]:
    walls = [r["wall"]["hand"]["median"] for r in rows]
    lines = report.fill(
        name,
        "goals",
        xla_within=sum(within_xla(r) for r in rows),
        same=sum(r["same_program"] for r in rows),
        equal=sum(r["equal"] for r in rows),
        wall_within=sum(w <= WALL_TARGET for w in walls),
        total=len(rows),
        median=float(np.median(walls)),
        min=min(walls),
        max=max(walls),
        xla_target=XLA_TARGET,
        wall_target=WALL_TARGET,
    )
    for r in rows:
        if r["hlo_diff"]:
            lines += [
                f"- **above the hand-written composition**: {r['recipe']}, "
                f"{_MODES[r['mode']]}, shape {r['shape']}:",
                "",
                "    ```",
                *("    " + line for line in r["hlo_diff"].splitlines()),
                "    ```",
            ]
    return lines
