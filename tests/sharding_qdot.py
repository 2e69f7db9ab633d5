"""`quantized_dot` with 8-device data parallelism: run by `sharding_worker.py` (in
its 8-device subprocess), checked by `test_sharding.py`.

A linear layer as a model calls it: `jax.vmap` over examples, each `[K]`, the
`vmap` named `examples` by the layer's `axis_name` (so one call on the batch; a
name other than the mesh axis's, which explicit sharding keeps), with a batch
of 256 = 8 devices x 32 rows (so each device holds whole blocks of the
weight-gradient product). Its value and both cotangents are computed under `jax.jit`
on one device and with the batch sharded over the mesh (`NamedSharding`, the
weight replicated); each must be the reference of `lowp_helpers` (public quantisers,
exact product, Higham's float32 bound): per-tensor scales are the global batch's.

The compiled program's collectives are listed beside those of the same program
with `jnp.dot`, whose gradient needs one all-reduce of the weight's cotangent.

Then under `jax.shard_map`, where each device runs the program on its own 32 rows
(the weight and the key replicated), its local `vmap` named `rows`:

- with `axis_name="rows"`, each device's value and input cotangent must be the
  reference of its rows alone (per-tensor scales are then the device's, the draws
  the same key's on every device), and the weight's cotangent, summed over the
  devices by the transpose of its replication, the sum of those references.
  Planted beside it: a weight cotangent summed once more;
- with `axis_name=("batch", "rows")`, naming the mesh axis too, the per-tensor
  scales span the devices (one `pmax` of a scalar each), the blocks stay within
  each device's rows: value and summed cotangents are the whole batch's reference
  (each recipe that draws nothing, or whose draws follow no per-tensor scale).
  Planted beside it: the same program without the mesh axis's name, whose
  per-tensor scales are each device's own.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from lowp_helpers import U32, gamma, mismatches, reference

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


def _program(dot: Any, name: str = "examples"):
    """The value and cotangents of `dot` mapped over the examples (a `vmap` named
    `name`)."""

    def run(x, w, c, key):
        def f(x, w):
            return jax.vmap(lambda xi: dot(xi, w, key), axis_name=name)(x)

        y, pull = jax.vjp(f, x, w)
        return (y, *pull(c))

    return run


def _dot(recipe, axis_name):
    return lambda xi, w, key: eqxrules.quantized_dot(
        xi, w, recipe=recipe, key=key, axis_name=axis_name
    )


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


def in_mesh(mesh):
    """The context that explicit sharding asks for around a program on `mesh`
    (`jax.set_mesh`, from jax 0.7; `lax.axis_index` of a `vmap` over a sharded
    axis needs it), or none where JAX has no explicit sharding (no
    `jax.sharding.AxisType`: jax 0.5's experimental `use_mesh` there breaks a
    plain `vmap` of `jnp.dot` over a sharded batch)."""
    setter = getattr(jax, "set_mesh", None) or getattr(jax.sharding, "use_mesh", None)
    if setter is None or not hasattr(jax.sharding, "AxisType"):
        return contextlib.nullcontext()
    return setter(mesh)


def _auto(mesh):
    """`mesh` with `Auto` axes (JAX < 0.7 has no other kind)."""
    kinds = getattr(jax.sharding, "AxisType", None)
    if kinds is None:
        return mesh
    axes = (kinds.Auto,) * len(mesh.axis_names)
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=axes)


def check(mesh, shard_map: Any, sums_replicated: bool) -> dict[str, Any]:
    """Every recipe on `mesh` (explicit sharding where JAX defaults to it), the
    planted one on `mesh` with `Auto` axes; then every recipe under `shard_map`
    (`sums_replicated`: whether its transpose sums a replicated argument's
    cotangent over the devices, as from JAX 0.7; before, the program does)."""
    return {
        **_check(mesh, RECIPES),
        **_check(_auto(mesh), dict([PLANTED])),
        "shard_map": _check_shard_map(mesh, shard_map, sums_replicated),
    }


def _data() -> tuple[np.ndarray, np.ndarray, np.ndarray, jax.Array]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32)
    c = rng.standard_normal((M, N)).astype(np.float32)
    return x, w, c, jax.random.key(5)


def _per_device_reference(recipe: Any, devices: int) -> dict[str, Any]:
    """`{"y": (value, bound), "dx": ..., "dw": ...}` when each of `devices` devices
    computes on its own rows: `y` and `dx` are the references of each device's
    rows, stacked; `dw` the sum of the devices' references, within their bounds
    plus that of summing `devices` float32 values (`gamma(devices)` of the sum of
    magnitudes, Higham 4.2, whatever the all-reduce's order)."""
    x, w, c, key = _data()
    rows = M // devices
    refs = [
        reference(
            recipe, x[d * rows : (d + 1) * rows], w, c[d * rows : (d + 1) * rows], key
        )
        for d in range(devices)
    ]
    out = {
        part: tuple(np.concatenate([r[part][i] for r in refs]) for i in (0, 1))
        for part in ("y", "dx")
    }
    values = np.stack([r["dw"][0] for r in refs])
    bounds = np.stack([r["dw"][1] for r in refs])
    g = gamma(devices, U32)
    out["dw"] = (
        values.sum(0),
        bounds.sum(0) * (1 + g) + g * (np.abs(values) + bounds).sum(0),
    )
    return out


def _whole_batch_reference(recipe: Any, devices: int) -> dict[str, Any]:
    """The reference of one call on the whole batch, the bound of `dw` widened by
    that of summing `devices` partial sums (as `_per_device_reference`)."""
    x, w, c, key = _data()
    out = dict(reference(recipe, x, w, c, key))
    value, bound = out["dw"]
    g = gamma(devices, U32)
    out["dw"] = (value, bound * (1 + g) + g * (np.abs(value) + bound))
    return out


# The recipes whose spanned per-device run is the whole batch's: those whose
# quantisers draw nothing (a key draws the same numbers on each device's rows as
# on the first rows of the batch, not those of the device's rows in the batch).
# The Hadamard signs draw from the key too, but the same signs for every block.
SPANNED = ("identity", "mxfp8", "fp8", "nvfp4_1d_nearest_rht")


def _check_shard_map(mesh, shard_map: Any, sums_replicated: bool) -> dict[str, Any]:
    x, w, c, key = _data()
    batch, replicated = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())
    args = (
        jax.device_put(x, batch),
        jax.device_put(w, replicated),
        jax.device_put(c, batch),
        key,
    )
    devices = len(mesh.devices.flat)
    # (recipe, extra sums of dw, the layer's axis names, the reference).
    cases = {
        name: (recipe, 0, "rows", _per_device_reference(recipe, devices))
        for name, recipe in RECIPES.items()
    }
    cases["planted_weight_cotangent_summed_twice"] = (
        RECIPES["identity"],
        1,
        "rows",
        _per_device_reference(RECIPES["identity"], devices),
    )
    for name in SPANNED:
        whole = _whole_batch_reference(RECIPES[name], devices)
        cases[f"spanned_{name}"] = (RECIPES[name], 0, ("batch", "rows"), whole)
    cases["planted_scales_not_spanned"] = (
        RECIPES["fp8"],
        0,
        "rows",
        _whole_batch_reference(RECIPES["fp8"], devices),
    )
    out: dict[str, Any] = {}
    for name, (recipe, extra_sums, names, ref) in cases.items():

        def local(
            x, w, c, key, r=recipe, n=names, sums=extra_sums + (not sums_replicated)
        ):
            y, dx, dw = _program(_dot(r, n), "rows")(x, w, c, key)
            for _ in range(sums):
                dw = jax.lax.psum(dw, "batch")
            return y, dx, dw

        program = jax.jit(
            shard_map(
                local,
                mesh=mesh,
                in_specs=(P("batch"), P(), P("batch"), P()),
                out_specs=(P("batch"), P("batch"), P()),
            )
        )
        failures = []
        try:
            for part, got in zip(("y", "dx", "dw"), program(*args)):
                bad = mismatches(got, *ref[part])
                if bad:
                    failures.append(f"{part}: {bad} elements off")
            if name == "spanned_fp8":
                text = program.lower(*args).compile().as_text()
                out["spanned_fp8_collectives"] = collectives(text)
        except Exception as e:  # reported, not raised: one JSON for every case
            failures.append(f"raised {type(e).__name__}: {str(e).splitlines()[0]}")
        out[name] = failures
    return out


def _check(mesh, cases: dict[str, Any]) -> dict[str, Any]:
    x, w, c, key = _data()
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
    with in_mesh(mesh):
        plain_collectives = collectives(plain.lower(*sharded).compile().as_text())
    out: dict[str, Any] = {}
    for name, recipe in cases.items():
        program = jax.jit(_program(_dot(recipe, "examples")))
        failures = []
        try:
            ref = reference(recipe, x, w, c, key)
            for where, args in (("one device", single), ("sharded", sharded)):
                context = (
                    in_mesh(mesh) if where == "sharded" else contextlib.nullcontext()
                )
                with context:
                    got = program(*args)
                for part, value in zip(("y", "dx", "dw"), got):
                    bad = mismatches(value, *ref[part])
                    if bad:
                        failures.append(f"{where}: {part}: {bad} elements off")
            with in_mesh(mesh):
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
