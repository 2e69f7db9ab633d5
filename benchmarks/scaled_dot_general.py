"""`eqxrules.quantized_dot`'s MXFP8 forward product against JAX's own
`jax.nn.scaled_dot_general` on the device at hand (issue 26 §5).

    python benchmarks/scaled_dot_general.py

JAX runs `scaled_dot_general` only on a GPU (jax 0.10), so on a CPU this prints
why it stops. Both sides quantise `x` and `w` in blocks of 32 along the reduced
dimension `K`, E4M3 elements and power-of-two (E8M0) scales, and multiply in
float32. What can differ is the scale a block gets, hence its elements: the
product by an identity matrix makes JAX's quantised `x` visible element by
element (each column of the identity is one block holding a single 1, which
both rules represent exactly), so the script compares the quantised operands
themselves, then the products on random data against a float64 reference.
Nothing here is a test: it prints what it finds, for `benchmarks/RESULTS.md`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import eqxrules
from eqxrules import recipes

BLOCK = 32


def _theirs(x: jax.Array, w: jax.Array) -> jax.Array:
    configs = [jax.nn.get_scaled_dot_general_config("mxfp8")] * 3
    dims = (((1,), (0,)), ((), ()))
    return jax.nn.scaled_dot_general(x, w, dims, configs=configs)


def _ours(x: jax.Array, w: jax.Array) -> jax.Array:
    return eqxrules.quantized_dot(x, w, recipe=recipes.mxfp8())


def _our_operand(x: jax.Array, axis: int) -> jax.Array:
    """`x` as the MXFP8 recipe's forward product quantises it, along `axis`."""
    q = recipes.mxfp8().products().fwd.lhs
    return dataclasses.replace(q, axis=axis)(x)


def _median_ms(fn, *args, repeats: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def _data(kind: str, key: jax.Array, shape: tuple[int, int]) -> jax.Array:
    k1, k2 = jax.random.split(key)
    x = jax.random.normal(k1, shape, jnp.float32)
    if kind == "heavy-tailed":  # magnitudes over many binades within each block
        x = x * jnp.exp2(jnp.round(4 * jax.random.normal(k2, shape)))
    return x


def main() -> None:
    dev = jax.devices()[0]
    print(f"device: {dev.platform} {dev.device_kind}; jax {jax.__version__}")
    if not hasattr(jax.nn, "scaled_dot_general"):
        print("this JAX has no jax.nn.scaled_dot_general")
        return
    ours, theirs = jax.jit(_ours), jax.jit(_theirs)

    print("\n## The quantised operand (x @ I reveals JAX's Q(x))\n")
    print("| data | x | elements equal | blocks equal | JAX's / ours, where unequal |")
    print("|---|---|---|---|---|")
    for kind in ("normal", "heavy-tailed"):
        x = _data(kind, jax.random.key(0), (256, 512))
        try:
            q_theirs = np.asarray(theirs(x, jnp.eye(512, dtype=jnp.float32)))
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            print(f"scaled_dot_general failed here: {type(e).__name__}: {e}")
            return
        q_ours = np.asarray(_our_operand(x, 1))
        equal = q_theirs == q_ours
        blocks = equal.reshape(256, -1, BLOCK).all(-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = q_theirs[~equal] / q_ours[~equal]
        ratios = np.unique(np.round(ratio[np.isfinite(ratio)], 4))[:6]
        print(
            f"| {kind} | 256x512 | {equal.mean():.4f} | {blocks.mean():.4f} | "
            f"{', '.join(map(str, ratios)) or '-'} |"
        )

    print("\n## The forward product\n")
    print(
        "| data | x @ w | rel. error ours | rel. error JAX's | ours == Q(x)Q(w) "
        "(max rel diff) | outputs equal | ms ours | ms JAX's | ms float32 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    f32 = jax.jit(jnp.dot)
    for kind in ("normal", "heavy-tailed"):
        for m, k, n in ((1024, 512, 512), (4096, 4096, 4096)):
            kx, kw = jax.random.split(jax.random.key(m + k))
            x, w = _data(kind, kx, (m, k)), _data(kind, kw, (k, n))
            exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
            y_ours, y_theirs = np.asarray(ours(x, w)), np.asarray(theirs(x, w))
            own = np.asarray(
                jnp.dot(
                    _our_operand(x, 1),
                    _our_operand(w, 0),
                    precision=jax.lax.Precision.HIGHEST,
                )
            )

            def rel(a: np.ndarray, b: np.ndarray) -> float:
                return float(np.linalg.norm(a - b) / np.linalg.norm(b))

            print(
                f"| {kind} | {m}x{k} @ {k}x{n} | {rel(y_ours, exact):.3e} | "
                f"{rel(y_theirs, exact):.3e} | {rel(y_ours, own):.1e} | "
                f"{np.mean(y_ours == y_theirs):.4f} | "
                f"{_median_ms(ours, x, w):.3f} | {_median_ms(theirs, x, w):.3f} | "
                f"{_median_ms(f32, x, w):.3f} |"
            )


if __name__ == "__main__":
    main()
