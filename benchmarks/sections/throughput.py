"""A binarised-MLP training step in examples/s, against the memory-bandwidth floor.

The floor is the bytes XLA moves over the measured copy bandwidth. This part of the
report is always written: without a GPU it says how to measure on one."""

from __future__ import annotations

import functools as ft
import json
import pathlib
import statistics
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import networks as nets, report, xla
from ..baselines import build_variants
from ..config import Job

NAME = "throughput"
DEFAULT = True


def copy_bandwidth(mib: int, reps: int = 5) -> float:
    """Bytes per second of a jitted elementwise pass (read + write) over `mib` MiB."""
    a = jnp.ones(mib * 2**20 // 4, jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    jax.block_until_ready(f(a))
    times = [xla.seconds_per_call(f, (a,), 1) for _ in range(reps)]
    return 2 * a.nbytes / statistics.median(times)


def run(job: Job) -> dict[str, Any]:
    sizes, binariser = job.sizes, job.binariser
    kw = binariser.call_kwargs(jax.random.key(1))
    dyn, _ = eqx.partition(binariser, eqx.is_inexact_array)
    variants = build_variants(binariser, kw)
    ws = nets.mlp_weights(sizes)
    data = nets.digits_batch(sizes.batch)
    try:
        import optax

        opt = optax.adam(1e-3)
        opt_name = "optax.adam"
    except ImportError:
        opt = None
        opt_name = "SGD"
    out: dict[str, Any] = dict(optimizer=opt_name, batch=sizes.batch)
    steps: dict[str, Any] = {}
    for v in ("eqxrules", "hand"):
        loss = nets.binarised_mlp_loss(ft.partial(variants[v], dyn))

        def step(ws, state, data, loss=loss):
            value, g = jax.value_and_grad(loss)(ws, data)
            if opt is None:
                return [w - 1e-3 * gw for w, gw in zip(ws, g)], state, value
            updates, state = opt.update(g, state, ws)
            return optax.apply_updates(ws, updates), state, value

        state = opt.init(ws) if opt is not None else None
        fig = xla.figures(step, ws, state, data)
        steps[v] = (fig, state)
    bw = copy_bandwidth(sizes.copy_mib)
    fig, state = steps["eqxrules"]
    compiled = fig["compiled"]
    args = (ws, state, data)
    jax.block_until_ready(compiled(*args))
    times = [xla.seconds_per_call(compiled, args, 1) for _ in range(sizes.train_steps)]
    step_s = statistics.median(times)
    floor_s = fig["bytes"] / bw
    out.update(
        step_s=step_s,
        step_min_s=min(times),
        step_max_s=max(times),
        examples_per_s=sizes.batch / step_s,
        bytes=fig["bytes"],
        flops=fig["flops"],
        bandwidth=bw,
        floor_s=floor_s,
        floor_examples_per_s=sizes.batch / floor_s,
        vs_hand=xla.interleaved(
            compiled,
            steps["hand"][0]["compiled"],
            args,
            sizes.pairs,
            sizes.target_s,
        ),
    )
    job.log(
        f"  {out['examples_per_s']:.0f} examples/s, floor {out['floor_examples_per_s']:.0f}"
    )
    return out


def render(res: dict[str, Any] | None, results: dict[str, Any]) -> list[str]:
    m = results["machine"]
    lines = report.fill(NAME, "heading")
    if res is not None:
        lines += report.opening(
            NAME,
            res,
            results,
            "throughput",
            res=res,
            m=m,
            step_ms=res["step_s"] * 1e3,
            step_min_ms=res["step_min_s"] * 1e3,
            step_max_ms=res["step_max_s"] * 1e3,
            mb=res["bytes"] / 1e6,
            gbs=res["bandwidth"] / 1e9,
            floor_ms=res["floor_s"] * 1e3,
            reached=res["floor_s"] / res["step_s"],
            gflop=res["flops"] / 1e9,
            vs_hand=report.spread(res["vs_hand"]),
        )
    if m["platform"] != "gpu":
        gpu = _gpu_figures()
        if gpu is None:
            lines += report.fill(NAME, "no_gpu", script=report.SCRIPT) + [""]
        else:
            g = gpu["throughput"]
            lines += report.fill(
                NAME,
                "gpu",
                g=g,
                m=gpu["machine"],
                step_ms=g["step_s"] * 1e3,
                reached=g["floor_s"] / g["step_s"],
                vs_hand=report.spread(g["vs_hand"]),
            ) + [""]
    return lines


GPU_RESULTS = pathlib.Path(__file__).resolve().parent.parent / "RESULTS.gpu.json"


def _gpu_figures() -> dict[str, Any] | None:
    """The figures of the last run on a GPU (`benchmarks/RESULTS.gpu.json`), if any."""
    if not GPU_RESULTS.exists():
        return None
    results = json.loads(GPU_RESULTS.read_text())
    if results["machine"]["platform"] != "gpu" or "throughput" not in results:
        return None
    return results
