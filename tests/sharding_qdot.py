"""`quantized_dot` with 8-device data parallelism: run by `sharding_worker.py` (in
its 8-device subprocess), checked by `test_sharding.py`.

A linear layer as a model calls it: `jax.vmap` over examples, each `[K]`, with a
batch of 256 = 8 devices x 32 rows (so each device holds whole blocks of the
weight-gradient product). Its value and both cotangents are computed under `jax.jit`
on one device and with the batch sharded over the mesh (`NamedSharding`, the
weight replicated); each must be the reference of `lowp_helpers` (public quantisers,
exact product, Higham's float32 bound): per-tensor scales are the global batch's.

The compiled program's collectives are listed beside those of the same program
with `jnp.dot`, whose gradient needs one all-reduce of the weight's cotangent.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from lowp_helpers import mismatches, reference

import eqxrules
from eqxrules import recipes

M, K, N = 256, 64, 64
SR = eqxrules.StochasticRound()
RECIPES = {
    "identity": recipes.identity(),
    "mxfp8": recipes.mxfp8(),
    "fp8": recipes.fp8(),
    "nvfp4": recipes.nvfp4(),
    "nvfp4_1d_nearest_rht": recipes.NVFP4(
        square_weight_blocks=False, gradient_rounding="nearest"
    ),
    "stochastic_round": recipes.Custom(
        dx=recipes.Product(SR, None), dw=recipes.Product(SR, SR, hadamard=16)
    ),
}
# Planted: blocks of 64 rows straddle two devices' 32, so the weight-gradient
# product must move the batch between devices. The collective check must flag it
# (its values are still right). On a mesh of `Auto` axes: with explicit sharding
# JAX refuses the reshape that splits the batch into such blocks.
PLANTED = "planted_straddling_blocks", recipes.MXFP8(block_size=64)
COLLECTIVE = re.compile(
    r"= (\(?[^=]*?) (all-reduce|all-gather|all-to-all|collective-permute|"
    r"reduce-scatter)(?:-start)?\("
)


def _program(dot: Any):
    def run(x, w, c, key):
        y, pull = jax.vjp(lambda x, w: jax.vmap(lambda xi: dot(xi, w, key))(x), x, w)
        return (y, *pull(c))

    return run


def collectives(text: str) -> list[tuple[str, list[int]]]:
    """Each collective of compiled HLO `text`: its op and its operands' sizes."""
    return [
        (
            op,
            [
                int(np.prod([int(d) for d in dims.split(",") if d]))
                for dims in re.findall(r"\w+\[([\d,]*)\]", shapes)
            ],
        )
        for shapes, op in COLLECTIVE.findall(text)
    ]


def _auto(mesh):
    """`mesh` with `Auto` axes (JAX < 0.7 has no other kind)."""
    kinds = getattr(jax.sharding, "AxisType", None)
    if kinds is None:
        return mesh
    axes = (kinds.Auto,) * len(mesh.axis_names)
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=axes)


def check(mesh) -> dict[str, Any]:
    """Every recipe on `mesh` (explicit sharding where JAX defaults to it), the
    planted one on `mesh` with `Auto` axes."""
    return {**_check(mesh, RECIPES), **_check(_auto(mesh), dict([PLANTED]))}


def _check(mesh, cases: dict[str, Any]) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32)
    c = rng.standard_normal((M, N)).astype(np.float32)
    key = jax.random.key(5)
    batch, replicated = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    sharded = (
        jax.device_put(x, batch),
        jax.device_put(w, replicated),
        jax.device_put(c, batch),
        key,
    )
    single = (
        jax.device_put(x, one),
        jax.device_put(w, one),
        jax.device_put(c, one),
        key,
    )
    plain = jax.jit(_program(lambda xi, w, key: jnp.dot(xi, w)))
    plain_collectives = collectives(plain.lower(*sharded).compile().as_text())
    out: dict[str, Any] = {}
    for name, recipe in cases.items():
        program = jax.jit(
            _program(
                lambda xi, w, key, r=recipe: eqxrules.quantized_dot(
                    xi, w, recipe=r, key=key
                )
            )
        )
        failures = []
        try:
            ref = reference(recipe, x, w, c, key)
            for where, args in (("one device", single), ("sharded", sharded)):
                for part, got in zip(("y", "dx", "dw"), program(*args)):
                    bad = mismatches(got, *ref[part])
                    if bad:
                        failures.append(f"{where}: {part}: {bad} elements off")
            compiled = collectives(program.lower(*sharded).compile().as_text())
        except Exception as e:  # reported, not raised: one JSON for every case
            failures.append(f"raised {type(e).__name__}: {str(e).splitlines()[0]}")
            compiled = []
        out[name] = {
            "failures": failures,
            "collectives": compiled,
            "plain": plain_collectives,
        }
    return out
