"""What the quantised products keep for their backward pass (issue 41 §2), and
the XLA temp bytes of the low-precision example's training step.

**Residuals per product.** For each function (`quantized_dot`, `quantized_einsum`,
`quantized_conv`, `quantized_ragged_dot`) and recipe, the residuals that
`jax.vjp` keeps (`jax.ad_checkpoint`'s listing, `xla.saved_residuals`) besides
the arguments, plus `x` where it is kept whole: bytes, and their ratio to the
float32 `x`'s bytes. The weight is left out (it lives on anyway). The plain
float32 product (`jnp.dot`, `jnp.einsum`, `lax.conv_general_dilated`,
`lax.ragged_dot`) keeps `x` itself: 1.0. The ragged product's group sizes are
traced (an argument of a `jax.jit`), as a router gives them.

**The training step.** `examples/lowp_training.py`'s model at its full settings,
one jitted `value_and_grad` of its loss (`loss_fn`) per recipe row, and XLA's
`memory_analysis().temp_size_in_bytes` against the float32 row's. The example's
layers run under a `vmap` that `axis_name` names (each product on the whole
batch's tokens), where the core keeps `x` whole (`core._Bilinear`: the
weight-gradient product's blocks span the batch, which one example's forward
pass cannot quantise), so its temp bytes show what quantising costs there, not
what residuals in their formats save.

Both are deterministic; nothing here is timed."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqxrules
from eqxrules import recipes

from .. import report, xla
from ..config import ROOT, Job

NAME = "lowp_memory"
DEFAULT = True
TARGET = 0.3  # issue 41 §2: at most this times the float32 input's bytes
KEY = jax.random.key(7)
_INT8 = eqxrules.SteQuantize(bits=8, lo=-128.0, hi=127.0)
RECIPES: dict[str, Any] = {
    "float32": None,  # the plain product
    "identity": recipes.identity(),
    "fp8()": recipes.fp8(),
    "mxfp8()": recipes.mxfp8(),
    "nvfp4()": recipes.nvfp4(),
    "fp8_blockwise()": recipes.fp8_blockwise(),
    "fp8_rowwise()": recipes.fp8_rowwise(),
    "mxfp4()": recipes.mxfp4(),
    "int8 grid (`SteQuantize`)": recipes.Custom(
        fwd=recipes.Product(_INT8, _INT8),
        dx=recipes.Product(_INT8, _INT8),
        dw=recipes.Product(_INT8, _INT8),
    ),
}
# The issue's: x 2048x256, w 256x256; a convolution; two ragged products, the
# test's (3 groups) and section 13's (8 experts, one empty).
RAGGED = {"3 groups": (512, 256, 256, (100, 200, 212))}
RAGGED_FULL = {
    "8 groups": (1024, 256, 256, (30, 0, 90, 120, 150, 180, 210, 244)),
}
# The example's recipe rows measured (its others are ablations of these).
STEP_ROWS = (
    "float32",
    "fp8",
    "mxfp8",
    "nvfp4",
    "fp8_blockwise, blocks of 32",
    "fp8_rowwise",
    "mxfp4",
)


def nbytes(v: Any) -> int:
    """An array's bytes (a PRNG key counts none: a few words whatever the
    shapes)."""
    if jnp.issubdtype(v.dtype, jax.dtypes.prng_key):
        return 0
    return int(np.prod(v.shape)) * jnp.dtype(v.dtype).itemsize


def kept(f: Callable[..., Any], x: jax.Array, w: jax.Array) -> dict[str, Any]:
    """What `jax.vjp(f, x, w)` keeps beyond its arguments, `x` counted if kept:
    bytes, their ratio to `x`'s float32 bytes, and the residuals listed."""
    saved = xla.saved_residuals(f, x, w)
    own = sum(nbytes(v) for v, src in saved if "argument" not in src)
    kept_x = any("argument" in src and v.shape == x.shape for v, src in saved)
    total = own + (nbytes(x) if kept_x else 0)
    listed = [
        v.str_short(short_dtypes=True)
        for v, src in saved
        if ("argument" not in src or v.shape == x.shape) and nbytes(v)
    ]
    return dict(bytes=total, ratio=total / nbytes(x), saved=listed)


def _for_conv(recipe: Any) -> Any:
    """A convolution's products take no Hadamard transform, and its 32 input
    features no tiles of 128 (`fp8_blockwise()`'s: tiles of 32)."""
    if getattr(recipe, "hadamard", None) is not None:
        recipe = dataclasses.replace(recipe, hadamard=None)
    if isinstance(recipe, recipes.FP8Blockwise):
        recipe = dataclasses.replace(recipe, block_size=32)
    return recipe


def cases(recipe: Any, quick: bool = False) -> dict[str, tuple[Any, ...]]:
    """`{label: (f, x, w)}` for every function, with `recipe` (`None`: the plain
    float32 product)."""
    k = jax.random.split(jax.random.key(0), 8)
    x = jax.random.normal(k[0], (2048, 256))
    w = jax.random.normal(k[1], (256, 256))
    xc = jax.random.normal(k[2], (8, 32, 16, 16))
    wc = jax.random.normal(k[3], (64, 32, 3, 3))
    q = dict(recipe=recipe, key=KEY)

    def dot(x, w):
        return jnp.dot(x, w) if recipe is None else eqxrules.quantized_dot(x, w, **q)

    def einsum(x, w):
        if recipe is None:
            return jnp.einsum("ij,jk->ik", x, w)
        return eqxrules.quantized_einsum("ij,jk->ik", x, w, **q)

    def conv(x, w):
        if recipe is None:
            return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME")
        return eqxrules.quantized_conv(
            x, w, (1, 1), "SAME", recipe=_for_conv(recipe), key=KEY
        )

    out = {
        "quantized_dot, 2048x256 @ 256x256": (dot, x, w),
        "quantized_einsum, ij,jk->ik": (einsum, x, w),
        "quantized_conv, 8x32x16x16 * 64x32x3x3": (conv, xc, wc),
    }
    ragged = RAGGED if quick else {**RAGGED, **RAGGED_FULL}
    for label, (m, kk, n, sizes) in ragged.items():
        g = len(sizes)
        xr = jax.random.normal(k[4], (m, kk))
        wr = jax.random.normal(k[5], (g, kk, n)) / np.sqrt(kk)
        out[f"quantized_ragged_dot, {m}x{kk}, {label}"] = (
            _ragged(recipe, jnp.asarray(sizes, jnp.int32)),
            xr,
            wr,
        )
    return out


def _ragged(recipe: Any, sizes: jax.Array) -> Callable[..., Any]:
    """`f(x, w)`: the ragged product with `sizes` traced (a `jit` argument)."""

    @jax.jit
    def f(x, w, s):
        if recipe is None:
            return jax.lax.ragged_dot(x, w, s, preferred_element_type=jnp.float32)
        return eqxrules.quantized_ragged_dot(x, w, s, recipe=recipe, key=KEY)

    return lambda x, w: f(x, w, sizes)


def _example() -> Any:
    """`examples/lowp_training.py` as a module (its directory on `sys.path`, as
    when Python runs it)."""
    examples = ROOT / "examples"
    if str(examples) not in sys.path:
        sys.path.append(str(examples))
    spec = importlib.util.spec_from_file_location(
        "examples_lowp_training", examples / "lowp_training.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def step_temp(quick: bool) -> list[dict[str, Any]]:
    """XLA temp bytes of one jitted `value_and_grad` of the example's loss, per
    recipe row."""
    ex = _example()
    s = ex.QUICK if quick else ex.FULL
    rows = {r.name: r for r in ex.ROWS}
    batch = jax.random.randint(
        jax.random.key(3), (s.batch, s.context + 1), 0, 256, jnp.int32
    )
    out = []
    for name in STEP_ROWS:
        model = ex.build(rows[name], s, 0)
        params, static = eqx.partition(model, eqx.is_inexact_array)

        def value_and_grad(params, batch, key, static=static):
            def loss(p):
                return ex.loss_fn(eqx.combine(p, static), batch, key)

            return jax.value_and_grad(loss)(params)

        figs = xla.figures(value_and_grad, params, batch, jax.random.key(4))
        out.append(dict(row=name, **xla.deterministic(figs)))
    return out


def run(job: Job) -> dict[str, Any]:
    products = []
    for name, recipe in RECIPES.items():
        job.log(f"  {name}")
        for label, (f, x, w) in cases(recipe, job.quick).items():
            products.append(dict(recipe=name, function=label, **kept(f, x, w)))
    job.log("  the training step")
    return dict(products=products, step=step_temp(job.quick))


def _saved(r: dict[str, Any]) -> str:
    return ", ".join(f"`{s}`" for s in r["saved"]) or "nothing"


def render(res: dict[str, Any] | None, results: dict[str, Any]) -> list[str]:
    if res is None:
        return []
    lines = report.opening(NAME, res, results, target=TARGET)
    rows = res["products"]
    for r in rows:
        lines.append(
            f"| {r['function']} | {r['recipe']} | {r['bytes'] / 2**10:.1f} | "
            f"{r['ratio']:.4f} | {_saved(r)} |"
        )
    steps = res["step"]
    base = next(r for r in steps if r["row"] == "float32")
    lines += report.fill(NAME, "step")
    for r in steps:
        lines.append(
            f"| {r['row']} | {report.mib(r['temp'])} | "
            f"{report.ratio(r['temp'], base['temp'])} | {r['flops']:.4g} | "
            f"{report.ratio(r['flops'], base['flops'])} |"
        )
    named = ("fp8()", "mxfp8()", "nvfp4()")
    within = [r for r in rows if r["recipe"] in named]
    quantised = [r for r in rows if r["recipe"] not in ("float32", "identity")]
    lines += report.fill(
        NAME,
        "goals",
        target=TARGET,
        within=sum(r["ratio"] <= TARGET for r in within),
        total=len(within),
        others_within=sum(r["ratio"] <= TARGET for r in quantised),
        others=len(quantised),
        above=", ".join(
            f"{r['recipe']} on {r['function']} ({r['ratio']:.3f})"
            for r in quantised
            if r["ratio"] > TARGET
        )
        or "none",
    )
    return lines + [""]
