"""The price of stochastic rounding in a training step (issue 26 §4).

A jitted training step (forward, backward and an SGD update) of an `eqx.nn.MLP` of
four 512x512 layers on a batch of 256, as `eqxrules.Keyed(eqxrules.quantize(mlp,
recipe=...))` with `recipes.nvfp4()` (its gradients rounded stochastically), the
same recipe with `gradient_rounding="nearest"`, and the float32 MLP. Wall time is
the median of interleaved A/B pairs; XLA's flops and temp bytes are deterministic.
Beside it, the bits one 256x512 gradient reads: `random_bits` (the counter-based
hash) against `jax.random.bits(key, shape, jnp.uint32)` (threefry, what it drew
before)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqxrules
from eqxrules import recipes
from eqxrules._rules._formats import random_bits

from .. import report, xla
from ..config import Job

NAME = "sr_step"
DEFAULT = True
WALL_TARGET = 1.08  # issue 26 §4: the SR step at most this times the nearest step
SIZES = {False: (512, 4, 256), True: (64, 4, 32)}  # width, linear layers, batch
PAIRS = {False: 21, True: 3}
TARGET_S = {False: 0.2, True: 0.02}
MODELS = ("stochastic", "nearest", "float32")
COMPARED = (
    ("stochastic", "nearest"),
    ("stochastic", "float32"),
    ("nearest", "float32"),
)


def model(kind: str, width: int, layers: int) -> eqxrules.Keyed:
    mlp = eqx.nn.MLP(width, width, width, layers - 1, key=jax.random.key(0))
    if kind == "float32":
        return eqxrules.Keyed(mlp)
    recipe = recipes.nvfp4()
    if kind == "nearest":
        recipe = dataclasses.replace(recipe, gradient_rounding="nearest")
    return eqxrules.Keyed(eqxrules.quantize(mlp, recipe=recipe))


def step(static: Any):
    """`step(params, x, y, key)`: one SGD step on the mean squared error, the model
    put together from its arrays and `static`, returning the new arrays and the
    loss."""

    def loss(params, x, y, key):
        m = eqx.combine(params, static)
        out = jax.vmap(lambda xi: m(xi, key=key))(x)
        return jnp.mean((out - y) ** 2)

    def fn(params, x, y, key):
        value, grads = jax.value_and_grad(loss)(params, x, y, key)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), value

    return fn


def _programs(quick: bool) -> dict[str, tuple[dict[str, Any], tuple[Any, ...]]]:
    width, layers, batch = SIZES[quick]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((batch, width)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((batch, width)), jnp.float32)
    out = {}
    for kind in MODELS:
        params, static = eqx.partition(model(kind, width, layers), eqx.is_array)
        args = (params, x, y, jax.random.key(1))
        out[kind] = (xla.figures(step(static), *args), args)
    return out


def _bits(quick: bool, pairs: int, target_s: float) -> dict[str, Any]:
    width, _, batch = SIZES[quick]
    shape, key = (batch, width), jax.random.key(2)
    counter = jax.jit(lambda k: random_bits(k, shape))
    threefry = jax.jit(lambda k: jax.random.bits(k, shape, jnp.uint32))
    return dict(
        shape=list(shape),
        wall=xla.interleaved(counter, threefry, (key,), pairs, target_s),
    )


def run(job: Job) -> dict[str, Any]:
    pairs, target_s = PAIRS[job.quick], TARGET_S[job.quick]
    programs = _programs(job.quick)
    wall = {}
    for a, b in COMPARED:
        job.log(f"  {a} / {b}")
        (fa, args_a), (fb, args_b) = programs[a], programs[b]
        wall[f"{a}/{b}"] = xla.interleaved(
            lambda: fa["compiled"](*args_a),
            lambda: fb["compiled"](*args_b),
            (),
            pairs,
            target_s,
        )
    job.log("  bits")
    return dict(
        sizes=list(SIZES[job.quick]),
        figures={k: xla.deterministic(f) for k, (f, _) in programs.items()},
        wall=wall,
        bits=_bits(job.quick, pairs, target_s),
        pairs=pairs,
        target_s=target_s,
        load=os.getloadavg()[0],
    )


def render(res: dict[str, Any] | None, results: dict[str, Any]) -> list[str]:
    if res is None:
        return []
    width, layers, batch = res["sizes"]
    lines = report.opening(
        NAME,
        res,
        results,
        width=width,
        layers=layers,
        batch=batch,
        wall_target=WALL_TARGET,
    )
    f32 = res["figures"]["float32"]
    for kind in MODELS:
        f = res["figures"][kind]
        lines.append(
            f"| {kind} | {f['flops']:.4g} | {report.ratio(f['flops'], f32['flops'])} "
            f"| {report.mib(f['temp'])} |"
        )
    lines += report.fill(NAME, "wall", pairs=res["pairs"], target_s=res["target_s"])
    for pair, w in res["wall"].items():
        a, b = pair.split("/")
        lines.append(
            f"| {a} / {b} | {w['a_s'] * 1e3:.2f} | {w['b_s'] * 1e3:.2f} | "
            f"{report.spread(w)} |"
        )
    sr = res["wall"]["stochastic/nearest"]["median"]
    bits = res["bits"]
    lines += report.fill(
        NAME,
        "goals",
        ratio=sr,
        wall_target=WALL_TARGET,
        verdict="within" if sr <= WALL_TARGET else "above",
        shape="x".join(map(str, bits["shape"])),
        counter_us=bits["wall"]["a_s"] * 1e6,
        threefry_us=bits["wall"]["b_s"] * 1e6,
        bits=report.spread(bits["wall"]),
        load=res["load"],
    )
    return lines + [""]
