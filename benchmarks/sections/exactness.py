"""The cost of exactness: the exact grids against the formula users write.

`ste_quantize` and `dorefa_quantize` against `lo + round((clip(x) - lo)/step)·step`
with the `stop_gradient` trick (issue 18): the forward pass alone, a training step
of an MLP whose every weight and activation is quantised, and XLA's flops and bytes
per element. Wall times are interleaved A/B pairs."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import eqxrules

from .. import networks as nets, report, xla
from ..config import Job

NAME = "exactness"
DEFAULT = True
BITS = (2, 4, 8)
GRIDS = {"ste_quantize": (-1.0, 1.0), "dorefa_quantize": (0.0, 1.0)}
FORWARD_TARGET = 2.0  # issue 18: at most 2x the formula's forward
STEP_TARGET = 1.03  # and at most 1.03x its training step


def formula(bits: int, lo: float, hi: float) -> Callable[[jax.Array], jax.Array]:
    """What users write: the plain formula, with the identity gradient inside the
    range through `clip` (the `stop_gradient` trick)."""
    step = (hi - lo) / (2**bits - 1)

    def f(x):
        c = jnp.clip(x, lo, hi)
        return c + jax.lax.stop_gradient(lo + jnp.round((c - lo) / step) * step - c)

    return f


def exact(name: str, bits: int) -> Callable[[jax.Array], jax.Array]:
    rule = getattr(eqxrules, name)
    return lambda x: rule(x, bits=bits)


def _inputs(size: int, lo: float, hi: float) -> jax.Array:
    # A quarter of the range beyond each end, as pre-activations overshoot.
    pad = (hi - lo) / 4
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.uniform(lo - pad, hi + pad, size).astype(np.float32))


def _forward(name: str, bits: int, size: int, job: Job) -> dict[str, Any]:
    lo, hi = GRIDS[name]
    x = _inputs(size, lo, hi)
    ours = xla.figures(exact(name, bits), x)
    theirs = xla.figures(formula(bits, lo, hi), x)
    wall = xla.interleaved(
        ours["compiled"],
        theirs["compiled"],
        (x,),
        2 * job.sizes.pairs,
        job.sizes.target_s,
    )
    per = {k: (ours[k] / size, theirs[k] / size) for k in ("flops", "bytes")}
    return dict(rule=name, bits=bits, size=size, wall=wall, **per)


def _training(width: int, batch: int, bits: int, job: Job) -> dict[str, Any]:
    """One SGD step of a 4-layer MLP (64 -> width -> width -> width -> 10) on the
    digits, with the quantiser on every weight and every hidden pre-activation."""
    ws = nets.uniform_weights([64, width, width, width, 10], seed=0)
    data = nets.digits_batch(batch)

    def step_of(act):
        loss = nets.binarised_mlp_loss(act)

        def step(ws, data):
            value, g = jax.value_and_grad(loss)(ws, data)
            return [w - 1e-3 * gw for w, gw in zip(ws, g)], value

        return step

    ours = xla.figures(step_of(exact("ste_quantize", bits)), ws, data)
    theirs = xla.figures(step_of(formula(bits, -1.0, 1.0)), ws, data)
    # More pairs than the forward: a few percent is the question here.
    wall = xla.interleaved(
        ours["compiled"],
        theirs["compiled"],
        (ws, data),
        4 * job.sizes.pairs,
        job.sizes.target_s,
    )
    ratios = {k: ours[k] / theirs[k] for k in ("flops", "bytes", "temp")}
    return dict(width=width, batch=batch, bits=bits, wall=wall, **ratios)


def run(job: Job) -> dict[str, Any]:
    size = 2**16 if job.quick else 2**20
    sweep = (2**12, 2**14) if job.quick else (2**16, 2**18, 2**20, 2**22)
    nets_ = ((64, 32), (128, 64)) if job.quick else ((512, 256), (1024, 1024))
    forward = []
    for name in GRIDS:
        for bits in BITS:
            job.log(f"  forward {name} {bits} bits")
            forward.append(_forward(name, bits, size, job))
    job.log("  sizes")
    sizes = [_forward("ste_quantize", 8, n, job) for n in sweep]
    training = []
    for width, batch in nets_:
        for bits in (4, 8):
            job.log(f"  training step, width {width}, batch {batch}, {bits} bits")
            training.append(_training(width, batch, bits, job))
    return dict(forward=forward, sizes=sizes, training=training, size=size)


def _meets(ratio: float, target: float) -> str:
    return "yes" if ratio <= target else "**no**"


def render(res: dict[str, Any] | None, results: dict[str, Any]) -> list[str]:
    if res is None:
        return []
    lines = report.opening(
        NAME,
        res,
        results,
        size=f"{res['size']:,}",
        forward_target=FORWARD_TARGET,
        step_target=STEP_TARGET,
    )
    for r in res["forward"]:
        w = r["wall"]
        lines.append(
            f"| `{r['rule']}` | {r['bits']} | {report.spread(w)} | "
            f"{_meets(w['median'], FORWARD_TARGET)} | {w['a_s'] * 1e3:.3f} | "
            f"{w['b_s'] * 1e3:.3f} | {r['flops'][0]:.0f} / {r['flops'][1]:.0f} | "
            f"{r['bytes'][0]:.1f} / {r['bytes'][1]:.1f} |"
        )
    lines += report.fill(NAME, "sizes")
    for r in res["sizes"]:
        w = r["wall"]
        lines.append(
            f"| 2^{int(math.log2(r['size']))} | {report.spread(w)} | "
            f"{w['a_s'] * 1e3:.3f} | {w['b_s'] * 1e3:.3f} |"
        )
    lines += report.fill(NAME, "training", step_target=STEP_TARGET)
    for r in res["training"]:
        w = r["wall"]
        lines.append(
            f"| {r['width']} | {r['batch']} | {r['bits']} | {report.spread(w)} | "
            f"{_meets(w['median'], STEP_TARGET)} | {w['a_s'] * 1e3:.2f} | "
            f"{w['b_s'] * 1e3:.2f} | {r['flops']:.3f} | {r['temp']:.3f} |"
        )
    return lines + report.fill(NAME, "how") + [""]
