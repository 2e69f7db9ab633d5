"""The binarised MLP against the `stop_gradient` trick.

Flops, wall time, and how much of the gradient the trick changes: the generic trick
built from the rule's references, and the textbook one people write."""

from __future__ import annotations

import functools as ft
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import networks as nets, report, xla
from ..baselines import build_variants
from ..cases import rule_label
from ..config import Job, Sizes

NAME = "trick"
DEFAULT = True
BASELINES = {
    "hand": "hand-written (same maths)",
    "trick": "trick from the references",
    "textbook": "textbook `clip` trick",
}


def textbook_trick(clip_value: float) -> Callable:
    """What people write instead of a sign STE:
    `clip(x, -c, c) + stop_gradient(sign(x) - clip(x, -c, c))`."""

    def f(x):
        c = jnp.clip(x, -clip_value, clip_value)
        return c + jax.lax.stop_gradient(
            jnp.where(x >= 0, 1.0, -1.0).astype(x.dtype) - c
        )

    return f


def run(job: Job) -> dict[str, Any]:
    sizes, rule = job.sizes, job.binariser
    kw = rule.call_kwargs(jax.random.key(1))
    variants = build_variants(rule, kw)
    dyn, _ = eqx.partition(rule, eqx.is_inexact_array)
    clip = getattr(rule, "clip_value", 1.0) or 1.0
    acts = {
        "eqxrules": ft.partial(variants["eqxrules"], dyn),
        "hand": ft.partial(variants["hand"], dyn),
        "trick": ft.partial(variants["trick"], dyn),
        "textbook": textbook_trick(clip),
    }
    ws = nets.mlp_weights(sizes)
    data = nets.digits_batch(sizes.batch)
    figures = {
        v: xla.figures(jax.value_and_grad(nets.binarised_mlp_loss(a)), ws, data)
        for v, a in acts.items()
    }
    wall = {
        v: xla.interleaved(
            figures["eqxrules"]["compiled"],
            figures[v]["compiled"],
            (ws, data),
            sizes.pairs,
            sizes.target_s,
        )
        for v in ("trick", "textbook")
    }
    job.log("  gradient differences")
    grads = []
    for width in (sizes.width, sizes.width - 1):
        for seed in range(sizes.seeds):
            grads.append(_gradient_difference(acts, sizes, width, seed, clip))
    return dict(
        rule=rule_label(rule),
        figures={v: xla.deterministic(f) for v, f in figures.items()},
        wall=wall,
        gradients=grads,
    )


def _gradient_difference(
    acts: dict[str, Callable], sizes: Sizes, width: int, seed: int, clip: float
) -> dict[str, Any]:
    ws = nets.mlp_weights(sizes, seed=seed, width=width)
    data = nets.digits_batch(sizes.batch, seed=seed)

    def with_preacts(act):
        def loss(ws, data):
            x, y = data
            h, pre = x, []
            for w in ws[:-1]:
                z = h @ act(w)
                pre.append(z)
                h = act(z)
            logits = h @ act(ws[-1]) / math.sqrt(ws[-1].shape[0])
            return nets.cross_entropy(logits, y), (pre, h)

        return jax.jit(jax.grad(loss, has_aux=True))

    g0, (pre, h0) = with_preacts(acts["eqxrules"])(ws, data)
    on_boundary = float(
        np.mean(np.concatenate([np.abs(np.ravel(p)) == clip for p in pre]))
    )
    out: dict[str, Any] = dict(width=width, seed=seed, on_boundary=on_boundary)
    norm = math.sqrt(sum(float(jnp.sum(g**2)) for g in g0))
    for v in ("trick", "textbook"):
        g1, (_, h1) = with_preacts(acts[v])(ws, data)
        diff = math.sqrt(sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(g0, g1)))
        out[v] = dict(
            relative=diff / norm if norm else float("nan"),
            per_layer=[
                float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(a), 1e-30))
                for a, b in zip(g0, g1)
            ],
            value_mismatch=float(jnp.mean(h0 != h1)),
        )
    return out


def render(res: dict[str, Any] | None, results: dict[str, Any]) -> list[str]:
    if res is None:
        return []
    f = res["figures"]
    o = f["eqxrules"]
    lines = report.opening(NAME, res, results, rule=res["rule"])
    for v, name in BASELINES.items():
        b = f[v]
        lines.append(
            f"| {name} | {report.ratio(o['flops'], b['flops'])} | "
            f"{report.ratio(o['bytes'], b['bytes'])} | "
            f"{report.ratio(o['temp'], b['temp'])} | "
            f"{report.spread(res['wall'].get(v))} |"
        )
    lines += report.fill(NAME, "gradients")
    for g in res["gradients"]:
        t = g["textbook"]
        lines.append(
            f"| {g['width']} | {g['seed']} | {g['on_boundary']:.4f} | "
            f"{t['relative']:.1%} | "
            f"{', '.join(f'{x:.2f}' for x in t['per_layer'])} | "
            f"{t['value_mismatch']:.2%} | {g['trick']['relative']:.1%} |"
        )
    return lines + report.fill(NAME, "why") + [""]
