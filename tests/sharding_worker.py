"""Every catalogue example on 8 simulated CPU devices; run by `test_sharding.py` in a
subprocess, so that the rest of the suite keeps one device.

For each example, the summed loss of a batch of 16 inputs and its gradient with
respect to the rule's floating-point arrays and the batch are computed three ways:

- `jax.jit` on one device (the reference);
- the same function under `jax.jit`, the batch placed with a `NamedSharding` over
  the `batch` axis of an 8-device mesh and the rule replicated;
- `jax.shard_map` over that mesh: each device takes 2 inputs; the loss is summed
  with `psum`, the gradient of the replicated rule is summed by shard_map's own
  transpose.

Both must equal the reference. Then `examples/data_parallel.py` runs with
`quick=True`. Prints one JSON object: `{"devices": ..., "entries": {name:
{"examples": n, "failures": [...]}}, "data_parallel": {...}}`.

Run: XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_worker.py
"""

from __future__ import annotations

import functools as ft
import importlib.util
import json
import os
import pathlib
import sys
import traceback

if "jax" not in sys.modules:
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = (
            f"{_flags} --xla_force_host_platform_device_count=8".strip()
        )

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import numpy as np  # noqa: E402
import sharding_models  # noqa: E402
import sharding_qconv  # noqa: E402
import sharding_qdot  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import eqxrules  # noqa: E402
from eqxrules._domain import call  # noqa: E402

OLD_SHARD_MAP = not hasattr(jax, "shard_map")
if not OLD_SHARD_MAP:  # public as `jax.shard_map` from jax 0.7
    shard_map = jax.shard_map
else:
    from jax.experimental.shard_map import shard_map as _old_shard_map  # noqa: E402

    # The old replication checker has no rule for any custom JVP/VJP (hand-written
    # ones included) and asks for `check_rep=False`, its documented workaround.
    shard_map = ft.partial(_old_shard_map, check_rep=False)

DEVICES = 8
BATCH = 16
ROOT = pathlib.Path(__file__).resolve().parent.parent
# Every program here runs once on tiny inputs: spend little time compiling it.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


@ft.cache
def _examples(entry: eqxrules.Entry) -> list[eqxrules.Rule]:
    return list(entry.examples(jax.random.key(0)))


def _loss(out):
    total = jnp.zeros((), jnp.float32)
    for o in jtu.tree_leaves(out):
        if eqx.is_inexact_array(o):
            n = int(np.prod(o.shape, dtype=np.int64))
            w = np.cos(np.arange(n) * 0.7 + 0.3).reshape(o.shape).astype(np.float32)
            total = total + jnp.sum(o.astype(jnp.float32) * w)
    return total


def _compare(actual, expected, what: str) -> list[str]:
    a_leaves = jtu.tree_leaves_with_path(actual)
    e_leaves = jtu.tree_leaves(expected)
    if len(a_leaves) != len(e_leaves):
        return [f"{what}: {len(a_leaves)} leaves, expected {len(e_leaves)}"]
    failures = []
    for (path, a), e in zip(a_leaves, e_leaves):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        if a.shape != e.shape or not np.allclose(
            a, e, rtol=1e-5, atol=1e-6, equal_nan=True
        ):
            err = np.max(np.abs(a - e)) if a.shape == e.shape else "shape"
            failures.append(f"{what}{jtu.keystr(path)}: max abs error {err}")
    return failures


@ft.cache
def _plain_custom_jvp_keeps_layout(mesh) -> bool:
    """Whether this JAX keeps the batch gradient sharded through a hand-written
    straight-through `jax.custom_jvp` (sign forward, identity backward) under `vmap`
    and `jit(NamedSharding)`. jax 0.5's partitioner does not: it returns that
    gradient on one device. There the layout is JAX's choice, not the rule's, and
    only the values are compared."""
    ste = jax.custom_jvp(jnp.sign)
    ste.defjvp(lambda ps, ts: (jnp.sign(ps[0]), ts[0]))

    def loss(p, xs):
        return jnp.sum(jax.vmap(lambda x: _loss(ste(p * x)))(xs))

    # A replicated parameter, as in `check_entry`, puts the program on the mesh.
    p = jax.device_put(np.float32(1.0), NamedSharding(mesh, P()))
    xs = jax.device_put(
        np.ones((BATCH, 4, 3), np.float32), NamedSharding(mesh, P("batch"))
    )
    grad_xs = jax.jit(jax.grad(loss, argnums=1))(p, xs)
    return not grad_xs.sharding.is_fully_replicated


def _batch(domain: eqxrules.Domain):
    """`BATCH` samples of `domain`, stacked along a new leading axis."""
    samples = [domain.sample(jax.random.key(100 + i)) for i in range(BATCH)]
    return jtu.tree_map(lambda *a: np.stack([np.asarray(b) for b in a]), *samples)


def check_entry(entry: eqxrules.Entry, mesh) -> list[str]:
    """Every example of `entry`, in one program per way of running it."""
    keeps_layout = _plain_custom_jvp_keeps_layout(mesh)
    rules = _examples(entry)
    kwargs = [rule.call_kwargs(jax.random.key(2)) for rule in rules]
    # Per example, one input per row from the example's own domain (its shape may
    # be the example's: a block size must divide it), an `eqxrules.Args` of them
    # for a rule of several.
    xs = [_batch(rule.input_domain()) for rule in rules]
    params, static = eqx.partition(rules, eqx.is_inexact_array)

    def value_and_grad(params, xs):
        def loss(params_and_xs, i):
            params, xs = params_and_xs
            rule = eqx.combine(params, static[i])
            return jnp.sum(jax.vmap(lambda x: _loss(call(rule, x, **kwargs[i])))(xs))

        # With respect to the parameters and every floating-point input (a mask
        # gets `None`).
        return [
            eqx.filter_value_and_grad(loss)((p, x), i)
            for i, (p, x) in enumerate(zip(params, xs))
        ]

    def local(params, xs):
        # `params` is replicated (unvarying over `batch`): from jax 0.7 the
        # transpose of its broadcast sums its gradient over the devices; the old
        # `shard_map` without replication checking leaves that sum to us.
        return [
            (
                jax.lax.psum(value, "batch"),
                (jax.lax.psum(g_params, "batch") if OLD_SHARD_MAP else g_params, g_xs),
            )
            for value, (g_params, g_xs) in value_and_grad(params, xs)
        ]

    jitted = jax.jit(value_and_grad, compiler_options=COMPILER_OPTIONS)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    reference = jitted(jax.device_put(params, one), jax.device_put(xs, one))
    batch, replicated = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())
    sharded_xs = jax.device_put(xs, batch)
    replicated_params = jax.device_put(params, replicated)
    mapped = jax.jit(
        shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), P("batch")),
            out_specs=[(P(), (P(), P("batch")))] * len(rules),
        ),
        compiler_options=COMPILER_OPTIONS,
    )

    failures = []
    for name, run in (("jit(NamedSharding)", jitted), ("shard_map", mapped)):
        try:
            results = run(replicated_params, sharded_xs)
        except Exception as e:
            # The first line of the message: JAX appends a note about its
            # filtered traceback after it.
            first = (str(e).strip().splitlines() or [""])[0]
            failures.append(f"{name}: raised {type(e).__name__}: {first}")
            continue
        for i, (result, expected) in enumerate(zip(results, reference)):
            failures += _compare(result, expected, f"example {i}: {name}")
            g_x = jtu.tree_leaves(result[1][1])[0]
            if keeps_layout and g_x.sharding.is_fully_replicated:
                failures.append(
                    f"example {i}: {name}: the batch gradient is replicated"
                )
    return failures


def _example_module():
    path = ROOT / "examples" / "data_parallel.py"
    spec = importlib.util.spec_from_file_location("data_parallel", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> dict:
    mesh = jax.make_mesh((DEVICES,), ("batch",))
    entries = {}
    for entry in eqxrules.catalogue():
        try:
            failures = check_entry(entry, mesh)
        except Exception as e:
            # The message's first line (JAX appends a note about its filtered
            # traceback after it).
            first = (str(e).strip().splitlines() or [""])[0]
            failures = [f"raised {type(e).__name__}: {first}"]
        entries[entry.name] = {
            "examples": len(_examples(entry)),
            "failures": failures,
        }
    result = {"devices": len(jax.devices()), "entries": entries}
    result["quantized_dot"] = sharding_qdot.check(mesh, shard_map, not OLD_SHARD_MAP)
    result["quantized_conv"] = sharding_qconv.check(mesh)
    result["models"] = sharding_models.check(mesh, shard_map, not OLD_SHARD_MAP)
    try:
        figures = _example_module().main(quick=True)
        result["data_parallel"] = {
            k: figures[k] for k in ("devices", "steps", "max_rel_diff", "matches")
        }
    except Exception:
        result["data_parallel"] = {"error": traceback.format_exc()}
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
