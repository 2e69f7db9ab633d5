"""Trace, lowering and compile time of a 64-layer binarised net."""

from __future__ import annotations

import functools as ft
import statistics
import time
from typing import Any

import equinox as eqx
import jax

from .. import networks as nets, report, xla
from ..baselines import VARIANT_NAMES, build_variants
from ..cases import rule_label
from ..config import Job

NAME = "trace"
DEFAULT = True
STAGES = ("trace", "lower", "compile", "total")


def run(job: Job) -> dict[str, Any]:
    sizes, binariser = job.sizes, job.binariser
    kw = binariser.call_kwargs(jax.random.key(1))
    dyn, _ = eqx.partition(binariser, eqx.is_inexact_array)
    variants = build_variants(binariser, kw)
    ws = nets.uniform_weights([64] + [sizes.deep_width] * sizes.deep_layers + [10], 0)
    data = nets.digits_batch(sizes.deep_batch)

    def loss(v: str):
        return nets.binarised_mlp_loss(ft.partial(variants[v], dyn))

    def stages(v: str) -> dict[str, float]:
        jax.clear_caches()
        fn = jax.jit(jax.value_and_grad(loss(v)))
        t0 = time.perf_counter()
        traced = fn.trace(ws, data)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        lowered.compile()
        t3 = time.perf_counter()
        return dict(trace=t1 - t0, lower=t2 - t1, compile=t3 - t2, total=t3 - t0)

    stages("eqxrules")  # first-use costs (imports, backend) out of the way
    out: dict[str, Any] = {}
    for v in ("hand", "hand_ref", "trick"):
        ours, theirs = [], []
        for i in range(sizes.trace_pairs):
            if i % 2 == 0:
                ours.append(stages("eqxrules"))
                theirs.append(stages(v))
            else:
                theirs.append(stages(v))
                ours.append(stages("eqxrules"))
        out[v] = {
            k: dict(
                **xla.ratio_summary([a[k] / b[k] for a, b in zip(ours, theirs)]),
                ours_s=statistics.median(a[k] for a in ours),
                theirs_s=statistics.median(b[k] for b in theirs),
            )
            for k in STAGES
        }
        job.log(f"  vs {v}: total x{out[v]['total']['median']:.3f}")
    # Where the time goes, deterministically: the size of what is traced and lowered
    # (a rule call that stays a `custom_jvp_call` in the differentiated program is
    # more to trace and lower), and whether XLA ends up with the same program.
    programs = {}
    for v in ("eqxrules", "hand"):
        traced = jax.jit(jax.value_and_grad(loss(v))).trace(ws, data)
        text = str(traced.jaxpr)
        programs[v] = dict(
            jaxpr_chars=len(text),
            custom_jvp_calls=text.count("custom_jvp_call"),
            hlo=xla.normalised_hlo(traced.lower().compile().as_text()),
        )
    same_hlo = programs["eqxrules"].pop("hlo") == programs["hand"].pop("hlo")
    res = dict(
        rule=rule_label(binariser),
        layers=sizes.deep_layers,
        width=sizes.deep_width,
        batch=sizes.deep_batch,
        pairs=sizes.trace_pairs,
        ratios=out,
        programs=programs,
        same_optimised_hlo=same_hlo,
    )
    old = job.previous
    if old is not None:
        # Wall-clock ratios move with the load: keep earlier headlines.
        res["earlier"] = [
            *old.get("earlier", []),
            dict(old["measured"], total=old["ratios"]["hand"]["total"]),
        ]
    return res


def render(res: dict[str, Any] | None, results: dict[str, Any]) -> list[str]:
    if res is None:
        return []
    lines = report.opening(NAME, res, results, res=res)
    for v, r in res["ratios"].items():
        lines.append(
            f"| {VARIANT_NAMES[v]} | "
            + " | ".join(report.spread(r[k]) for k in STAGES)
            + f" | {r['total']['ours_s']:.2f} | {r['total']['theirs_s']:.2f} |"
        )
    t = res["ratios"]["hand"]["total"]["median"]
    lines += report.fill(
        NAME, "goal", verdict="met" if t <= 1.15 else "NOT met", total=t
    )
    for old in res.get("earlier", []):
        lines += report.fill(
            NAME,
            "earlier",
            old=old,
            commit=f", commit `{old['code']}`" if "code" in old else "",
            load=old["load"][0],
        )
    pr = res.get("programs")
    if pr:
        lines += report.fill(
            NAME,
            "programs",
            o=pr["eqxrules"],
            h=pr["hand"],
            same="identical" if res["same_optimised_hlo"] else "DIFFERENT",
        )
        lines.append("")
    return lines
