"""MXFP8 training in eqxrules against qwix (issue 41 §5), side by side in one run.

The same MXFP8 work in both libraries (`benchmarks/mxfp8_work.py`): one product's
value and gradients, and one Adam step of an MLP; eqxrules as its users write it
(`quantized_dot`, `eqxrules.quantize(eqx.nn.MLP(...), recipe=recipes.mxfp8())`),
qwix as its users write it (a Linen model through `qwix.quantize_model` with a
`qwix.QtProvider`, `benchmarks/qwix_side.py`). XLA's flops and temp bytes, the HLO
transposes and copies, paired wall time, the product's saved residuals, and the
numeric differences with their causes, block by block.

Not run by default: it needs the `bench` extra (qwix and Flax), which eqxrules
never depends on; without it `run` raises an `ImportError` saying what to
install, and the rest of `python -m benchmarks` runs as before."""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

import eqxrules
from eqxrules import recipes

from .. import mxfp8_work as work, qwix_side, report, xla
from ..config import Job
from .quantized_dot import PAIRS, TARGET_S

NAME = "qwix"
DEFAULT = False
# Issue 41 §5: the MLP step at most these times qwix's wall time and flops.
WALL_TARGET = 0.85
FLOPS_TARGET = 1.05
# (m, k, n) of the product; the MLP's width, depth and batch. By `job.quick`.
PRODUCT = {False: (256, 512, 256), True: (64, 128, 64)}
MLP = {False: (1024, 4, 256), True: (128, 4, 64)}
# Each operand of each product, as (operand, product, axis it contracts there).
OPERANDS = (
    ("x", "fwd", "lhs", 1),
    ("w", "fwd", "rhs", 0),
    ("dy", "dx", "lhs", 1),
    ("w", "dx", "rhs", 1),
    ("x", "dw", "lhs", 0),
    ("dy", "dw", "rhs", 0),
)
PRODUCT_NAMES = {"fwd": "forward", "dx": "input gradient", "dw": "weight gradient"}
HLO_OPS = ("transpose", "copy")


def _xla(figs: dict[str, Any]) -> dict[str, Any]:
    ops = xla._hlo_ops(figs["compiled"])
    return dict(xla.deterministic(figs), ops={op: ops.get(op, 0) for op in HLO_OPS})


def _wall(fa: Any, fb: Any, job: Job) -> dict[str, float]:
    return xla.interleaved(fa, fb, (), PAIRS[job.quick], TARGET_S[job.quick])


def blocks(recipe: recipes.Recipe, operands: dict[str, jax.Array], theirs: Any):
    """`block_causes` for each operand of each product (`OPERANDS`): eqxrules'
    quantisation of it against `theirs(v, axis)`."""
    rounding = work.scale_rounding(recipe)
    products = recipe.products()
    rows = []
    for name, product, side, axis in OPERANDS:
        v = operands[name]
        q = getattr(getattr(products, product), side)
        ours = q.for_reduction_axis(axis, v.shape[axis], f"`{name}`")(v)
        causes = work.block_causes(v, ours, theirs(v, axis), axis, rounding)
        rows.append(dict(operand=name, product=product, **causes))
    return rows


def product_row(recipe: recipes.Recipe, shape: tuple[int, int, int], job: Job):
    job.log(f"  product {shape}")
    x, w, dy = args = work.product_problem(shape)
    fs = dict(
        eqxrules=work.ours(recipe),
        qwix=qwix_side.product_apply(shape[2]),
        float32=work.float32,
    )
    figures = {
        k: xla.figures(jax.value_and_grad(work.product_loss(f), (0, 1)), *args)
        for k, f in fs.items()
    }
    out = {
        k: (jax.jit(f)(x, w), *figures[k]["compiled"](*args)[1]) for k, f in fs.items()
    }
    numerics = [
        dict(quantity=q, **_numerics(*(out[k][i] for k in fs)))
        for i, q in enumerate(("value", "x gradient", "w gradient"))
    ]
    ours_c, qwix_c = figures["eqxrules"]["compiled"], figures["qwix"]["compiled"]
    return dict(
        shape=list(shape),
        figures={k: _xla(f) for k, f in figures.items()},
        residuals={
            k: work.residuals(fs[k], x, w) for k in ("eqxrules", "qwix", "float32")
        },
        numerics=numerics,
        blocks=blocks(recipe, dict(x=x, w=w, dy=dy), qwix_side.quantised),
        wall=_wall(lambda: ours_c(*args), lambda: qwix_c(*args), job),
        load=os.getloadavg()[0],
    )


def _numerics(ours: Any, theirs: Any, reference: Any) -> dict[str, Any]:
    return dict(
        ours=work.relative(ours, reference, reference),
        theirs=work.relative(theirs, reference, reference),
        between=work.relative(ours, theirs, reference),
        equal=all(
            np.array_equal(a, b)
            for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs))
        ),
    )


def mlp_row(recipe: recipes.Recipe, sizes: tuple[int, int, int], job: Job):
    width, depth, batch = sizes
    job.log(f"  MLP {depth} x {width}, batch {batch}")
    model = work.mlp(width, depth)
    x, t = work.mlp_problem(width, batch)
    quantised = eqxrules.quantize(model, recipe=recipe)
    if work.quantised_layers(quantised, recipe) != depth:
        raise RuntimeError("`qwix` section: not every layer of the MLP is quantised")
    params = dict(
        eqxrules=work.split(quantised),
        qwix=(
            qwix_side.flax_params(model),
            qwix_side.mlp_apply(depth, width, qwix_side.flax_params(model), x),
        ),
        float32=work.split(model, vmap=True),
    )
    as_eqx = dict(
        eqxrules=work.layer_arrays, qwix=qwix_side.eqx_order, float32=work.layer_arrays
    )
    figures, losses, grads, calls = {}, {}, {}, {}
    for k, (p, apply) in params.items():
        loss = work.mse(apply)
        step, opt = work.adam_step(loss)
        step_args = (p, opt.init(p), x, t)
        figures[k] = xla.figures(step, *step_args)
        compiled = figures[k]["compiled"]
        calls[k] = lambda c=compiled, a=step_args: c(*a)
        losses[k] = calls[k]()[2]
        grads[k] = as_eqx[k](jax.jit(jax.grad(loss))(p, x, t))
    return dict(
        sizes=list(sizes),
        figures={k: _xla(f) for k, f in figures.items()},
        numerics=[
            dict(quantity="loss", **_numerics(*losses.values())),
            dict(quantity="gradient", **_numerics(*grads.values())),
        ],
        wall=_wall(calls["eqxrules"], calls["qwix"], job),
        load=os.getloadavg()[0],
    )


def run(job: Job) -> dict[str, Any]:
    versions = qwix_side.versions()  # first: without qwix, say so before measuring
    recipe = recipes.mxfp8()
    return dict(
        versions=versions,
        rounding=work.scale_rounding(recipe),
        product=product_row(recipe, PRODUCT[job.quick], job),
        mlp=mlp_row(recipe, MLP[job.quick], job),
        pairs=PAIRS[job.quick],
        target_s=TARGET_S[job.quick],
    )


ROUNDING = {
    "floor": "down, by the OCP specification's rule `2^(floor(log2 amax) - 8)`, "
    "which saturates a block whose largest magnitude has a mantissa above 1.75 "
    "(its largest elements clipped to 448 times the scale)",
    "ceil": 'up too (`scale_rounding="ceil"`), as qwix does',
}


def goals(res: dict[str, Any]) -> dict[str, Any]:
    """The MLP step's wall time and flops over qwix's, and whether each meets its
    target (issue 41 §5)."""
    m = res["mlp"]
    wall = m["wall"]["median"]
    flops = m["figures"]["eqxrules"]["flops"] / m["figures"]["qwix"]["flops"]
    return dict(
        wall=wall,
        wall_met=wall <= WALL_TARGET,
        flops=flops,
        flops_met=flops <= FLOPS_TARGET,
    )


def _met(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _works(res: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    m, k, n = res["product"]["shape"]
    width, depth, batch = res["mlp"]["sizes"]
    return [
        (f"product {m}x{k} @ {k}x{n}", res["product"]),
        (f"MLP step, {depth} x {width}, batch {batch}", res["mlp"]),
    ]


def render(res: dict[str, Any] | None, results: dict[str, Any]) -> list[str]:
    if res is None:
        return []
    works = _works(res)
    (product_label, product), (mlp_label, _) = works
    lines = report.opening(
        NAME,
        res,
        results,
        product=product_label.removeprefix("product "),
        mlp=mlp_label.removeprefix("MLP step, "),
        rounding=ROUNDING[res["rounding"]],
        **res["versions"],
    )
    for label, row in works:
        o, q, f = (row["figures"][k] for k in ("eqxrules", "qwix", "float32"))
        lines.append(
            f"| {label} | {o['flops']:.4g} | {q['flops']:.4g} | "
            f"{report.ratio(o['flops'], q['flops'])} | {report.mib(o['temp'])} | "
            f"{report.mib(q['temp'])} | {report.ratio(o['temp'], q['temp'])} | "
            f"{f['flops']:.4g} | {report.mib(f['temp'])} | "
            + " | ".join(f"{o['ops'][op]} / {q['ops'][op]}" for op in HLO_OPS)
            + " |"
        )
    lines += report.fill(NAME, "wall", pairs=res["pairs"], target_s=res["target_s"])
    for label, row in works:
        w = row["wall"]
        lines.append(
            f"| {label} | {w['a_s'] * 1e3:.1f} | {w['b_s'] * 1e3:.1f} | "
            f"{report.spread(w)} | {row['load']:.1f} |"
        )
    m, k, n = product["shape"]
    lines += report.fill(
        NAME, "residuals", inputs=report.mib(4 * (m * k + k * n)), shape=product_label
    )
    for lib, r in product["residuals"].items():
        lines.append(f"| {lib} | {report.mib(r['bytes'])} | {'; '.join(r['arrays'])} |")
    lines += report.fill(NAME, "numerics")
    for label, row in works:
        for r in row["numerics"]:
            lines.append(
                f"| {label} | {r['quantity']} | {r['ours']:.3e} | {r['theirs']:.3e} | "
                f"{r['between']:.3e} | {'yes' if r['equal'] else 'no'} |"
            )
    lines += report.fill(NAME, "blocks", rounding=res["rounding"])
    for r in product["blocks"]:
        lines.append(
            f"| `{r['operand']}` | {PRODUCT_NAMES[r['product']]} | {r['blocks']} | "
            f"{r['differ']} ({r['differ'] / r['blocks']:.1%}) | {r['rules_differ']} | "
            f"{r['unexplained']} | {r['top_error_ours']:.1%} | "
            f"{r['top_error_theirs']:.1%} |"
        )
    total = {
        k: sum(r[k] for r in product["blocks"])
        for k in ("blocks", "differ", "rules_differ", "unexplained")
    }
    g = goals(res)
    lines += report.fill(
        NAME,
        "goals",
        **total,
        wall=g["wall"],
        wall_target=WALL_TARGET,
        wall_met=_met(g["wall_met"]),
        flops=g["flops"],
        flops_target=FLOPS_TARGET,
        flops_met=_met(g["flops_met"]),
    )
    return lines + [""]
