"""The in-process sections of `benchmarks/gpu.py`: the device's float32 arithmetic,
`quantized_dot_general` against `jax.nn.scaled_dot_general`, and one training step
per recipe. Each takes `quick` (small sizes, for the CPU) and returns its findings
as JSON-ready data, with `"status"`: `"passed"`, `"failed"` (a finding says so) or
`"unavailable"` (what cannot run here, and why). Nothing here is a test: the
script records what it finds."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import eqxrules
from eqxrules import recipes

from . import mxfp8_work, xla

F32 = np.float32
U32 = 2.0**-24
DIMS = (((1,), (0,)), ((), ()))
E4M3 = ml_dtypes.float8_e4m3fn


# -- the device's arithmetic --------------------------------------------------------

# name, JAX function, its float64 NumPy truth, the grid's ends.
_FUNCTIONS: list[tuple[str, Callable, Callable, float, float]] = [
    ("exp", jnp.exp, np.exp, -80.0, 80.0),
    ("log", jnp.log, np.log, 1e-30, 1e30),
    ("log1p", jnp.log1p, np.log1p, -0.9, 10.0),
    ("tanh", jnp.tanh, np.tanh, -10.0, 10.0),
    ("cosh", jnp.cosh, np.cosh, -80.0, 80.0),
    ("logistic", jax.nn.sigmoid, lambda x: 1 / (1 + np.exp(-x)), -80.0, 80.0),
]


def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """`|got - want|` in units of float32's spacing at `want` (float64)."""
    spacing = np.spacing(np.abs(want).astype(F32)).astype(np.float64)
    return np.abs(got.astype(np.float64) - want) / spacing


def _run(f: Callable, *args: Any) -> np.ndarray:
    return np.asarray(jax.jit(f)(*args))


def arithmetic(quick: bool) -> dict[str, Any]:
    """What the backend computes in float32 that the CPU may compute otherwise
    (issue 41 §4): each function's largest error, in float32 ulps, against NumPy's
    float64 on a grid; division's (`div.full` on NVIDIA GPUs is not correctly
    rounded); whether subnormal inputs and results are flushed to zero; and the
    default matrix product's precision (TF32 on an H100)."""
    n = 20_001 if quick else 2_000_001
    functions = {}
    for name, f, truth, lo, hi in _FUNCTIONS:
        if name == "log":
            x = np.geomspace(lo, hi, n).astype(F32)
        else:
            x = np.linspace(lo, hi, n).astype(F32)
        e = _ulps(_run(f, x), truth(x.astype(np.float64)))
        i = int(np.argmax(e))
        functions[name] = {"max_ulps": float(e[i]), "at": float(x[i])}
    rng = np.random.default_rng(0)
    a = rng.uniform(1, 2, n).astype(F32)
    b = rng.uniform(1, 4, n).astype(F32)
    q = _run(jnp.divide, a, b)
    exact = (a.astype(np.float64) / b.astype(np.float64)).astype(F32)
    division = {
        "max_ulps": float(_ulps(q, a.astype(np.float64) / b).max()),
        "not_correctly_rounded": float(np.mean(q != exact)),
    }
    two = jnp.asarray(F32(2.0**30))
    tiny = jnp.asarray(F32(1e-40))  # subnormal
    small = jnp.asarray(F32(2.0**-120))
    subnormals = {
        "flushes_inputs": bool(_run(jnp.multiply, tiny, two) == 0),
        "flushes_results": bool(_run(jnp.multiply, small, F32(2.0**-10)) == 0),
    }
    x = rng.standard_normal((256, 256)).astype(F32)
    w = rng.standard_normal((256, 256)).astype(F32)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w)

    def error(precision: Any) -> float:
        y = _run(lambda a, b: jnp.dot(a, b, precision=precision), x, w)
        return float(np.max(np.abs(y - exact) / scale))

    matmul = {"default": error(None), "highest": error(jax.lax.Precision.HIGHEST)}
    return {
        "status": "passed",
        "functions": functions,
        "division": division,
        "subnormals": subnormals,
        "matmul_error_over_sum_of_magnitudes": matmul,
        "swish_sign_at_the_h100_failure": _swish_point(),
    }


def _swish_point() -> dict[str, float]:
    """`swish_sign`'s JVP (beta 5) and its reference's at the point that failed
    on the H100 (`benchmarks/GPU.md`), on this backend and on the CPU, against the
    float64 value of `2 beta sigma(y) sigma(-y) (2 - y tanh(y/2)) t`, `y = beta x`."""
    rule = eqxrules.SwishSign(5.0)
    x, t = F32(1.6974602), F32(2.1852818)

    def both(device: Any) -> tuple[float, float]:
        with jax.default_device(device):
            xs, ts = jnp.asarray(x), jnp.asarray(t)
            ours = jax.jit(lambda a, b: jax.jvp(rule, (a,), (b,))[1])(xs, ts)
            ref = jax.jit(
                lambda a, b: jax.jvp(rule.reference_derivative, (a,), (b,))[1]
            )(xs, ts)
        return float(ours), float(ref)

    y = 5.0 * np.float64(x)
    s, s_ = 1 / (1 + np.exp(-y)), 1 / (1 + np.exp(y))
    truth = 2 * 5.0 * s * s_ * (2 - y * np.tanh(y / 2)) * np.float64(t)
    here, cpu = both(jax.devices()[0]), both(jax.devices("cpu")[0])
    return {
        "truth": truth,
        "rule_here": here[0],
        "reference_here": here[1],
        "rule_cpu": cpu[0],
        "reference_cpu": cpu[1],
    }


# -- quantized_dot_general against jax.nn.scaled_dot_general -------------------------


def numpy_mxfp8(v: np.ndarray, axis: int) -> np.ndarray:
    """`v` (float32, finite, no all-zero block) in MXFP8 blocks of 32 along `axis`
    with the rounded-up scale rule, `X = 2^ceil(log2(amax / 448))`, elements cast
    to E4M3 by `ml_dtypes` (round to nearest even): written from the rule, in
    NumPy."""
    moved = np.moveaxis(np.asarray(v, F32), axis, -1)
    blocks = moved.reshape(*moved.shape[:-1], -1, 32).astype(np.float64)
    amax = np.max(np.abs(blocks), axis=-1, keepdims=True)
    scale = mxfp8_work.block_scales(amax, "ceil")
    q = (blocks / scale).astype(F32).astype(E4M3).astype(np.float64) * scale
    return np.moveaxis(q.reshape(moved.shape), -1, axis)


def theirs(x: jax.Array, w: jax.Array) -> jax.Array:
    """JAX's own MXFP8 product, `jax.nn.scaled_dot_general`, in float32."""
    configs = [jax.nn.get_scaled_dot_general_config("mxfp8")] * 3
    return jax.nn.scaled_dot_general(x, w, DIMS, configs=configs)


def ours(rounding: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
    recipe = recipes.MXFP8(scale_rounding=rounding)
    return lambda x, w: eqxrules.quantized_dot_general(x, w, DIMS, recipe=recipe)


def summation_bound(qx: np.ndarray, qw: np.ndarray) -> np.ndarray:
    r"""How far two float32 products of the same quantised operands may be apart,
    element by element: $2\gamma_K \sum_k |a_k b_k|$, $\gamma_K = Ku/(1 - Ku)$,
    $u = 2^{-24}$. Each term $a_k b_k$ is exact in float32 (two E4M3 significands
    of 4 bits, power-of-two scales), so each side's only error is its summation,
    at most $\gamma_K \sum_k |a_k b_k|$ in any order (Higham, *Accuracy and
    Stability of Numerical Algorithms*, 3.1), blocks scaled before or after."""
    k = qx.shape[1]
    gamma = k * U32 / (1 - k * U32)
    return 2 * gamma * (np.abs(qx) @ np.abs(qw))


def _data(kind: str, shape: tuple[int, int], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    if kind == "heavy-tailed":  # magnitudes over many binades within each block
        x = x * np.exp2(np.round(4 * rng.standard_normal(shape)))
    return x.astype(F32)


def compare(x: np.ndarray, w: np.ndarray) -> dict[str, Any]:
    """`quantized_dot_general` with `MXFP8(scale_rounding="ceil")` (and, beside it,
    `"floor"`) against `jax.nn.scaled_dot_general` on `x @ w`, each measured from
    the NumPy product of the operands quantised by the rounded-up rule (in float64)
    in units of the largest output; and whether ours and theirs are within the
    float32 summation bound of each other, element by element."""
    qx, qw = numpy_mxfp8(x, 1), numpy_mxfp8(w, 0)
    ref = qx @ qw
    bound = summation_bound(qx, qw)
    top = float(np.max(np.abs(ref)))
    xs, ws = jnp.asarray(x), jnp.asarray(w)
    y_ceil = np.asarray(jax.jit(ours("ceil"))(xs, ws), np.float64)
    y_floor = np.asarray(jax.jit(ours("floor"))(xs, ws), np.float64)
    y_theirs = np.asarray(jax.jit(theirs)(xs, ws), np.float64)

    def off(y: np.ndarray) -> float:
        return float(np.max(np.abs(y - ref)) / top)

    return {
        "ceil_from_reference": off(y_ceil),
        "theirs_from_reference": off(y_theirs),
        "floor_from_reference": off(y_floor),
        "ceil_from_theirs": float(np.max(np.abs(y_ceil - y_theirs)) / top),
        "bound": float(np.max(bound) / top),
        "ceil_within_bound_of_theirs": bool(np.all(np.abs(y_ceil - y_theirs) <= bound)),
        "floor_within_bound_of_theirs": bool(
            np.all(np.abs(y_floor - y_theirs) <= bound)
        ),
        "outputs_equal": float(np.mean(y_ceil == y_theirs)),
    }


def _operand(x: np.ndarray) -> dict[str, Any]:
    """JAX's quantised `x`, made visible as `x @ I` (each column of the identity
    one block holding a single 1, exact under both rules), against ours and the
    NumPy rule, and block by block why they differ (`mxfp8_work.block_causes`)."""
    k = x.shape[1]
    q_theirs = np.asarray(
        jax.jit(theirs)(jnp.asarray(x), jnp.eye(k, dtype=jnp.float32))
    )
    quantise = eqxrules.MXQuantize(format="e4m3", scale_rounding="ceil", axis=1)
    q_ours = np.asarray(quantise(jnp.asarray(x)))
    causes = mxfp8_work.block_causes(x, q_ours, q_theirs, axis=1, rounding="ceil")
    return {
        "elements_equal": float(np.mean(q_ours == q_theirs)),
        "theirs_equal_numpy_rule": bool(np.array_equal(q_theirs, numpy_mxfp8(x, 1))),
        **causes,
    }


def scaled_dot_general(quick: bool) -> dict[str, Any]:
    """The MXFP8 forward product of `quantized_dot_general` (`scale_rounding=
    "ceil"`) against `jax.nn.scaled_dot_general`: it should equal theirs within
    float32 summation (`summation_bound`), and the OCP floor rule should not."""
    backend = f"{jax.default_backend()} at jax {jax.__version__}"
    if not hasattr(jax.nn, "scaled_dot_general"):
        return {
            "status": "unavailable",
            "reason": f"no jax.nn.scaled_dot_general ({backend})",
        }
    shapes = (
        [(64, 256, 32)]
        if quick
        else [(64, 256, 32), (1024, 512, 512), (4096, 4096, 4096)]
    )
    try:
        jax.block_until_ready(jax.jit(theirs)(jnp.ones((32, 32)), jnp.ones((32, 32))))
    except Exception as e:  # noqa: BLE001 - the reason is the finding
        return {
            "status": "unavailable",
            "reason": f"jax.nn.scaled_dot_general does not run on {backend}: "
            f"{type(e).__name__}: {str(e)[:300]}",
        }
    rows = []
    for kind in ("normal", "heavy-tailed"):
        for m, k, n in shapes:
            x, w = _data(kind, (m, k), m + k), _data(kind, (k, n), k + n)
            rows.append({"data": kind, "shape": f"{m}x{k} @ {k}x{n}", **compare(x, w)})
    operands = {
        kind: _operand(_data(kind, (256, 512), 1))
        for kind in ("normal", "heavy-tailed")
    }
    agree = all(r["ceil_within_bound_of_theirs"] for r in rows)
    return {
        "status": "passed" if agree else "failed",
        "backend": backend,
        "products": rows,
        "operands": operands,
    }


# -- one training step -----------------------------------------------------------


def _product(name: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
    if name == "float32":
        return lambda x, w: jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)
    if name == "bfloat16":
        return lambda x, w: jnp.dot(
            x.astype(jnp.bfloat16),
            w.astype(jnp.bfloat16),
            preferred_element_type=jnp.float32,
        )
    recipe = {"fp8": recipes.fp8(), "mxfp8": recipes.mxfp8()}[name]
    return lambda x, w: eqxrules.quantized_dot(x, w, recipe=recipe)


def sgd_step(name: str, learning_rate: float = 1e-3) -> Callable:
    """One plain SGD step of a two-layer MLP (`relu` between), the mean squared
    error against a target, every product computed as `name` says."""
    dot = _product(name)

    def loss(params: list[jax.Array], x: jax.Array, t: jax.Array) -> jax.Array:
        h = jax.nn.relu(dot(x, params[0]))
        return jnp.mean((dot(h, params[1]) - t) ** 2)

    def step(params, x, t):
        value, grads = jax.value_and_grad(loss)(params, x, t)
        return [p - learning_rate * g for p, g in zip(params, grads)], value

    return step


def training(quick: bool) -> dict[str, Any]:
    """One training step (`jax.value_and_grad` and an SGD update) of a two-layer
    MLP at width 4096 and batch 4096 (256 with `quick`), where the products
    dominate: `fp8()`, `mxfp8()`, bfloat16 products (float32 accumulation) and
    float32 ones (`HIGHEST`), each jitted: XLA's flops and temp bytes, the median
    wall time of `reps` steps, and the loss."""
    width = batch = 256 if quick else 4096
    reps = 3 if quick else 20
    rng = np.random.default_rng(0)
    params = [
        jnp.asarray(rng.standard_normal((width, width)) / np.sqrt(width), jnp.float32)
        for _ in range(2)
    ]
    x = jnp.asarray(rng.standard_normal((batch, width)), jnp.float32)
    t = jnp.asarray(rng.standard_normal((batch, width)), jnp.float32)
    rows = {}
    for name in ("bfloat16", "fp8", "mxfp8", "float32"):
        step = sgd_step(name)
        figures = xla.figures(step, params, x, t)
        compiled = figures.pop("compiled")
        jax.block_until_ready(compiled(params, x, t))
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            _, value = jax.block_until_ready(compiled(params, x, t))
            times.append(1e3 * (time.perf_counter() - start))
        rows[name] = {**figures, "ms": statistics.median(times), "loss": float(value)}
    for row in rows.values():
        row["ms_over_bfloat16"] = row["ms"] / rows["bfloat16"]["ms"]
    losses = [r["loss"] for r in rows.values()]
    finite = all(np.isfinite(losses))
    return {
        "status": "passed" if finite else "failed",
        "width": width,
        "batch": batch,
        "reps": reps,
        "steps": rows,
    }
