"""`quantized_conv` with 8-device data parallelism (issue 26 §5): run by
`sharding_worker.py` in its 8-device subprocess, checked by `test_sharding.py`.

A convolution as a model calls it: `jax.vmap` over examples, each `[32, 8, 8]`,
the `vmap` named by the layer's `axis_name` (one call on the batch), with a batch of 32 = 8 devices x 4 examples, so that each device holds 4·64 = 256
of the weight-gradient product's positions (whole blocks of 32 and 16). Its value
and both cotangents are computed under `jax.jit` on one device and with the batch
sharded over the mesh (`NamedSharding`, the kernel replicated). The sharded result
must equal the one-device result within twice Higham's float32 bound (a device's
partial sums of the weight gradient are added in another order), and the
one-device result is the statement's (tested in `test_quantized_products.py`).

The compiled program's collectives are listed beside those of the same program
with `lax.conv_general_dilated`, whose weight gradient needs one all-reduce of the
kernel's cotangent. Planted beside it: weight-gradient blocks of 512 positions,
which straddle two devices' 256.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from sharding_qdot import _auto, collectives, in_mesh

import eqxrules
from eqxrules import recipes

B, C, S = 32, 32, 8
U32 = 2.0**-24
NO_RHT = eqxrules.recipes.NVFP4(hadamard=None)
RECIPES = {
    "identity": recipes.identity(),
    "mxfp8": recipes.mxfp8(),
    "fp8": recipes.fp8(),
    "nvfp4": NO_RHT,
}
_WIDE = eqxrules.MXQuantize(format="e4m3", block_size=512)
PLANTED = (
    "planted_straddling_blocks",
    recipes.Custom(
        fwd=recipes.mxfp8().products().fwd,
        dx=recipes.mxfp8().products().dx,
        dw=recipes.Product(_WIDE, _WIDE),
    ),
)


def _program(conv: Any):
    def run(x, w, c, key):
        def f(x, w):
            return jax.vmap(lambda xi: conv(xi, w, key), axis_name="examples")(x)

        y, pull = jax.vjp(f, x, w)
        return (y, *pull(c))

    return run


def _quantized(recipe):
    return lambda xi, w, key: eqxrules.quantized_conv(
        xi[None], w, (1, 1), "SAME", recipe=recipe, key=key, axis_name="examples"
    )[0]


def _plain(xi, w, key):
    return jax.lax.conv_general_dilated(xi[None], w, (1, 1), "SAME")[0]


def _data():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((B, C, S, S)).astype(np.float32)
    w = (rng.standard_normal((C, C, 3, 3)) / 16).astype(np.float32)
    c = rng.standard_normal((B, C, S, S)).astype(np.float32)
    return x, w, c, jax.random.key(9)


def _bound(x, w, c) -> list[np.ndarray]:
    """Twice Higham's bound of a float32 sum of at most `n` terms, on the sums of
    the terms' magnitudes (themselves float32 sums, hence the `1 + γ`)."""
    n = x.size + w.size
    g = n * U32 / (1 - n * U32)
    absolute = jax.jit(_program(_plain))(np.abs(x), np.abs(w), np.abs(c), None)
    return [2 * g * (1 + g) * np.asarray(v, np.float64) for v in absolute]


def check(mesh) -> dict[str, Any]:
    """Every recipe on `mesh`, the planted one on `mesh` with `Auto` axes."""
    return {**_check(mesh, RECIPES), **_check(_auto(mesh), dict([PLANTED]))}


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
    single = tuple(jax.device_put(v, one) for v in (x, w, c)) + (key,)
    plain = jax.jit(_program(_plain))
    with in_mesh(mesh):
        plain_collectives = collectives(plain.lower(*sharded).compile().as_text())
    bounds = _bound(x, w, c)
    out: dict[str, Any] = {}
    for name, recipe in cases.items():
        program = jax.jit(_program(_quantized(recipe)))
        failures = []
        try:
            want = program(*single)
            with in_mesh(mesh):
                got = program(*sharded)
            for part, g, v, b in zip(("y", "dx", "dw"), got, want, bounds):
                far = np.abs(np.asarray(g, np.float64) - np.asarray(v)) > b
                if far.any() or not np.isfinite(np.asarray(g)).all():
                    failures.append(f"{part}: {int(far.sum())} elements off")
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
