"""Data-parallel training of a `ScaledModel` on 8 (simulated) devices.

The batch is split over the devices with a `NamedSharding`; the model is replicated.
`jax.jit` partitions the training step, and the gradient of the replicated
parameters is summed across devices automatically. The same step on one device
gives the same losses, step by step: the rule's derivative does not depend on how
the batch is laid out.

On a CPU the 8 devices are simulated with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`, which this script sets itself
when run (it must be set before JAX starts). On a machine with 8 accelerators, it
uses them.

Run: python examples/data_parallel.py [--quick]
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "jax" not in sys.modules:
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = (
            f"{_flags} --xla_force_host_platform_device_count=8".strip()
        )

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import (  # noqa: E402
    NamedSharding,
    PartitionSpec as P,
    SingleDeviceSharding,
)

import eqxrules  # noqa: E402

DEVICES = 8


def make_data(n: int, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inputs in [-4, 4]^3 and a smooth target of them."""
    k1, k2 = jax.random.split(key)
    x = jax.random.uniform(k1, (n, 3), minval=-4.0, maxval=4.0)
    w = jax.random.normal(k2, (3,))
    return x, jnp.sin(x @ w)[:, None]


def loss(model: eqxrules.ScaledModel, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


OPTIM = optax.sgd(0.1)


@eqx.filter_jit
def step(model, state, x, y):
    value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
    # `grads` is `None` on the non-array leaves (the activation, the scale); the
    # optimiser sees only the floating-point arrays, replicated like the model.
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, state = OPTIM.update(grads, state, params)
    return eqx.apply_updates(model, updates), state, value


def train(model, x, y, steps: int) -> list[float]:
    state = OPTIM.init(eqx.filter(model, eqx.is_inexact_array))
    losses = []
    for _ in range(steps):
        model, state, value = step(model, state, x, y)
        losses.append(float(value))
    return losses


def main(quick: bool = False) -> dict:
    devices = jax.devices()
    if len(devices) < DEVICES:
        raise RuntimeError(
            f"`data_parallel`: needs {DEVICES} devices, found {len(devices)}. Run it "
            "as a script (it sets `XLA_FLAGS` itself), or set "
            f"`XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES}` before "
            "importing JAX."
        )
    steps, n = (10, 64) if quick else (100, 512)
    k_model, k_data = jax.random.split(jax.random.key(0))
    mlp = eqx.nn.MLP(3, 1, 16, 2, activation=jnp.tanh, key=k_model)
    # The MLP sees x / 4, in [-1, 1]; the gradient is the exact one.
    model = eqxrules.ScaledModel(mlp, 4.0, mode="exact")
    x, y = make_data(n, k_data)

    mesh = jax.make_mesh((DEVICES,), ("batch",), devices=devices[:DEVICES])
    batch = NamedSharding(mesh, P("batch"))
    replicated = NamedSharding(mesh, P())
    sharded_model = eqx.filter_shard(model, replicated)
    x_sharded, y_sharded = jax.device_put(x, batch), jax.device_put(y, batch)

    one = SingleDeviceSharding(devices[0])
    single_model = eqx.filter_shard(model, one)
    x_one, y_one = jax.device_put(x, one), jax.device_put(y, one)

    sharded = train(sharded_model, x_sharded, y_sharded, steps)
    single = train(single_model, x_one, y_one, steps)
    diff = np.abs(np.array(sharded) - np.array(single)) / np.abs(np.array(single))
    max_rel = float(diff.max())
    matches = max_rel <= 1e-5

    print(f"batch of {n} split over {DEVICES} devices: {x_sharded.sharding}")
    for i in sorted({0, steps // 2, steps - 1}):
        print(
            f"step {i:3d}: loss {sharded[i]:.6f} on {DEVICES} devices, "
            f"{single[i]:.6f} on one"
        )
    verdict = "matches" if matches else "DOES NOT match"
    print(
        f"loss {verdict} the single-device run: max relative difference "
        f"{max_rel:.2g} over {steps} steps"
    )
    return {
        "devices": DEVICES,
        "steps": steps,
        "sharded_losses": sharded,
        "single_losses": single,
        "max_rel_diff": max_rel,
        "matches": matches,
    }


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
