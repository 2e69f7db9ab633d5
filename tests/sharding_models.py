"""Data parallelism with JAX itself (issue 38 §2): a 2-layer MLP and a 2-layer CNN,
quantised with `axis_name=("batch", "examples")`, trained under `jax.shard_map`
over the 8 devices of a mesh axis `batch` (each device `vmap`ping its own examples,
that `vmap` named `examples`). Run by `sharding_worker.py` in its 8-device
subprocess, checked by `test_sharding.py`.

The reference is one device: the same model quantised with `axis_name="examples"`,
`vmap`ped over the whole batch. Each device's rows are a multiple of the blocks,
so the blocks (within a device's rows) are the whole batch's, and the per-tensor
scales span the devices: the loss and the gradients, summed over the devices by
the transpose of the replicated parameters, are the reference's. The data are
small dyadic numbers (integers times powers of two, with peaks that a block's
scale clips or keeps, `_with_peaks`) and the recipes' scales powers
of two (`identity`, `mxfp8()`), so every product and sum is exact in float32,
whatever its order: the comparison is bit for bit. (`fp8()`'s and `nvfp4()`'s
scales are not powers of two: their spanning is checked on single products, with
Higham's bound, in `sharding_qdot.py`.) Planted beside it: weight-gradient blocks
longer than a device's rows (64 rows of the MLP's 32 a device; 1024 positions of
the CNN's 512), which straddle two devices in the one-device run.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxrules
from eqxrules import recipes

EXAMPLES = 256  # 8 devices x 32: whole blocks of 32 on each
RECIPES = {"identity": recipes.identity(), "mxfp8": recipes.mxfp8()}
BOTH = ("batch", "examples")


def _dyadic(rng, shape, scale: float) -> np.ndarray:
    return (rng.integers(-3, 4, shape) * scale).astype(np.float32)


def _mlp(rng) -> Any:
    mlp = eqx.nn.MLP(64, 32, 64, 1, key=jax.random.key(0))
    for i, layer in enumerate(mlp.layers):
        w = _dyadic(rng, layer.weight.shape, 2.0**-4)
        mlp = eqx.tree_at(lambda m, i=i: m.layers[i].weight, mlp, w)
        b = _dyadic(rng, layer.bias.shape, 2.0**-3)
        mlp = eqx.tree_at(lambda m, i=i: m.layers[i].bias, mlp, b)
    xs = _dyadic(rng, (EXAMPLES, 64), 2.0**-2)
    return mlp, _with_peaks(xs)


def _cnn(rng) -> Any:
    conv = eqx.nn.Conv2d(32, 32, 3, padding=1, use_bias=False, key=jax.random.key(1))
    conv = eqx.tree_at(
        lambda c: c.weight, conv, _dyadic(rng, conv.weight.shape, 2.0**-5)
    )
    cnn = eqx.nn.Sequential(
        [conv, eqx.nn.Lambda(jax.nn.relu), eqx.nn.Lambda(lambda x: jnp.sum(x, (1, 2)))]
    )
    xs = _dyadic(rng, (EXAMPLES, 32, 4, 4), 2.0**-2)
    # Examples of other magnitudes (powers of two), so that a block's scale
    # depends on which examples it holds.
    return cnn, _with_peaks(xs)


def _with_peaks(xs: np.ndarray) -> np.ndarray:
    """`xs` (values up to 0.75) with one peak per example, at its element
    `e % 32`: 1.875 on even devices, 2 on odd ones. MXFP8's scale (the OCP rule)
    clips 1.875 to 1.75 in a block whose largest magnitude it is, but keeps it in
    a block that also holds a 2: so a block across two devices' rows quantises
    otherwise than each device's own."""
    out = xs.reshape(EXAMPLES, -1).copy()
    examples = np.arange(EXAMPLES)
    out[examples, examples % 32] = np.where(examples // 32 % 2, 2.0, 1.875)
    return out.reshape(xs.shape)


MODELS = {"mlp": _mlp, "cnn": _cnn}


def _value_and_grad(model, xs, weights):
    """The loss, a weighted sum of the outputs (a dyadic cotangent, sharded with
    the examples), and its gradient with respect to the parameters and `xs`."""
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(params, xs):
        out = jax.vmap(eqx.combine(params, static), axis_name="examples")(xs)
        return jnp.sum(out * weights)

    return jax.value_and_grad(loss, argnums=(0, 1))(params, xs)


def _weights(shape) -> np.ndarray:
    n = int(np.prod(shape))
    return ((np.arange(n).reshape(shape) % 7 - 3) * 2.0**-3).astype(np.float32)


def _straddling(block: int) -> recipes.Custom:
    mx = recipes.mxfp8().products()
    wide = eqxrules.MXQuantize(format="e4m3", block_size=block)
    return recipes.Custom(fwd=mx.fwd, dx=mx.dx, dw=recipes.Product(wide, wide))


PLANTED = {"mlp": _straddling(64), "cnn": _straddling(1024)}


def check(mesh, shard_map: Any, sums_replicated: bool) -> dict[str, Any]:
    """`{model: {recipe: failures}}` for each model and recipe, and the planted
    case."""
    out: dict[str, Any] = {}
    for model_name, build in MODELS.items():
        rng = np.random.default_rng(3)
        plain, xs = build(rng)
        cases = {**RECIPES, "planted_straddling_blocks": PLANTED[model_name]}
        out[model_name] = {
            name: _failures(mesh, shard_map, sums_replicated, plain, xs, r)
            for name, r in cases.items()
        }
    return out


def _failures(mesh, shard_map, sums_replicated, plain, xs, recipe) -> list:
    reference_model = eqxrules.quantize(plain, recipe=recipe, axis_name="examples")
    model = eqxrules.quantize(plain, recipe=recipe, axis_name=BOTH)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    out_shape = jax.eval_shape(jax.vmap(plain), xs).shape
    weights = _weights(out_shape)
    want = eqx.filter_jit(_value_and_grad)(
        reference_model, jax.device_put(xs, one), jax.device_put(weights, one)
    )

    def local(params, xs, weights):
        model = eqx.combine(params, static)
        loss, (g_params, g_xs) = _value_and_grad(model, xs, weights)
        loss = jax.lax.psum(loss, "batch")
        if not sums_replicated:
            g_params = jax.lax.psum(g_params, "batch")
        return loss, (g_params, g_xs)

    program = jax.jit(
        shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), P("batch"), P("batch")),
            out_specs=(P(), (P(), P("batch"))),
        )
    )
    batch = NamedSharding(mesh, P("batch"))
    try:
        got = program(
            jax.device_put(params, NamedSharding(mesh, P())),
            jax.device_put(xs, batch),
            jax.device_put(weights, batch),
        )
    except Exception as e:  # reported, not raised: one JSON for every case
        return [f"raised {type(e).__name__}: {str(e).splitlines()[0]}"]
    failures = []
    got_leaves = jax.tree.leaves(got)
    want_leaves = jax.tree.leaves(want)
    if len(got_leaves) != len(want_leaves):
        return [f"{len(got_leaves)} leaves, expected {len(want_leaves)}"]
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        g, w = np.asarray(g), np.asarray(w)
        if not np.array_equal(g, w):
            failures.append(f"leaf {i}: max abs error {np.max(np.abs(g - w))}")
    return failures
