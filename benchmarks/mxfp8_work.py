"""The eqxrules side of the `qwix` section, and how the two libraries' numbers are
compared. Nothing here needs qwix (its side is `qwix_side`), so the tests run it
without the `bench` extra.

The work, the same in both libraries, MXFP8 in every operand of every product:

- one product `x @ w`, its value and both gradients: `jax.value_and_grad` of
  `vdot(f(x, w), dy)` with respect to `x` and `w`, `dy` random;
- one Adam step (optax) of an MLP on a batch, the mean squared error against a
  random target: `eqxrules.quantize(eqx.nn.MLP(...), recipe=recipes.mxfp8())`
  called on the batch (a `QuantizedLinear` takes `[..., in_features]`), against
  the same MLP in Linen, from the same weights, quantised by qwix.

Why two MXFP8 quantisations of the same operand differ is told block by block
(`block_causes`): the scale each rule gives a block is computed here from the
block's largest magnitude alone, so a block whose values differ while the two
rules give it the same scale is a difference of something else."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqxrules
from eqxrules import recipes

from . import xla

E4M3_MAX = 448.0
E4M3_EMAX = 8  # 448 = 1.75 * 2^8


def scale_rounding(recipe: recipes.Recipe) -> str:
    """The MX scale rule `recipe` rounds with: its `scale_rounding` where it has one,
    else the OCP rule, `"floor"` (eqxrules' `MXFP8` before it had the field)."""
    return getattr(recipe, "scale_rounding", "floor")


def product_problem(shape: tuple[int, int, int]) -> tuple[jax.Array, ...]:
    """`x` (m x k), `w` (k x n) and `dy` (m x n): Gaussian, `w` scaled by 1/sqrt(k)."""
    m, k, n = shape
    rng = np.random.default_rng(0)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy)


def product_loss(f: Callable[[jax.Array, jax.Array], jax.Array]) -> Callable:
    """`loss(x, w, dy) = vdot(f(x, w), dy)`: its gradients are the product's VJP."""
    return lambda x, w, dy: jnp.vdot(f(x, w), dy)


def ours(recipe: recipes.Recipe) -> Callable[[jax.Array, jax.Array], jax.Array]:
    return lambda x, w: eqxrules.quantized_dot(x, w, recipe=recipe)


def float32(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)


def mlp(width: int, depth: int) -> eqx.nn.MLP:
    """`depth` linear layers of `width` (ReLU between them), Equinox's own
    initialisation."""
    return eqx.nn.MLP(width, width, width, depth - 1, key=jax.random.key(0))


def mlp_problem(width: int, batch: int) -> tuple[jax.Array, jax.Array]:
    """The batch and its target."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, width)).astype(np.float32)
    t = rng.standard_normal((batch, width)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(t)


def mse(apply: Callable[[Any, jax.Array], jax.Array]) -> Callable:
    """`loss(params, x, t)`: the mean squared error of `apply(params, x)`."""
    return lambda p, x, t: jnp.mean((apply(p, x) - t) ** 2)


def split(
    model: Any, vmap: bool = False
) -> tuple[Any, Callable[[Any, jax.Array], jax.Array]]:
    """A model's arrays, and `apply(arrays, x)`: the model called on the batch (a
    model of `QuantizedLinear` layers takes it whole), or mapped over it with
    `vmap` (an `eqx.nn.Linear` takes one example)."""
    params, static = eqx.partition(model, eqx.is_array)

    def apply(p: Any, x: jax.Array) -> jax.Array:
        m = eqx.combine(p, static)
        return jax.vmap(m)(x) if vmap else m(x)

    return params, apply


def adam_step(loss: Callable, learning_rate: float = 1e-3) -> tuple[Callable, Any]:
    """`(step, optimiser)`: `step(params, state, x, t)` is one `optax.adam` step of
    `loss(params, x, t)`, returning the new parameters, state and the loss."""
    import optax  # the examples' extra, and the `bench` extra's

    opt = optax.adam(learning_rate)

    def step(params, state, x, t):
        value, grads = jax.value_and_grad(loss)(params, x, t)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return step, opt


def layer_arrays(model: Any) -> list[jax.Array]:
    """An MLP's (or its gradient's) weights and biases, layer by layer, whether its
    layers are `eqx.nn.Linear` or `QuantizedLinear`."""
    out = []
    for layer in model.layers:
        linear = getattr(layer, "linear", layer)
        out += [linear.weight, linear.bias]
    return out


def quantised_layers(model: Any, recipe: recipes.Recipe) -> int:
    """How many of an MLP's layers compute their products with `recipe`."""
    return sum(
        isinstance(layer, eqxrules.QuantizedLinear) and layer.recipe == recipe
        for layer in model.layers
    )


def relative(a: Any, b: Any, ref: Any) -> float:
    """`||a - b|| / ||ref||` (Frobenius, over all leaves of the trees)."""

    def norm(tree: Any) -> float:
        return float(
            np.sqrt(
                sum(np.sum(np.square(np.float64(v))) for v in jax.tree.leaves(tree))
            )
        )

    return norm(jax.tree.map(lambda u, v: np.float64(u) - np.float64(v), a, b)) / norm(
        ref
    )


def _blocks(v: np.ndarray, axis: int, block: int) -> np.ndarray:
    """`v`'s blocks of `block` along `axis`: shape `(blocks, block)`."""
    moved = np.moveaxis(np.asarray(v, np.float64), axis, -1)
    return moved.reshape(-1, block)


def _pow2_at_least(r: np.ndarray) -> np.ndarray:
    """The least power of two at or above each `r > 0`, exactly."""
    k = np.ceil(np.log2(r))
    k = np.where(np.exp2(k - 1) >= r, k - 1, k)
    return np.exp2(np.where(np.exp2(k) < r, k + 1, k))


def block_scales(amax: np.ndarray, rounding: str) -> np.ndarray:
    """The E8M0 scale of an MXFP8 (E4M3) block of largest magnitude `amax` (> 0):
    OCP's `2^(floor(log2 amax) - 8)` for `"floor"`, `2^ceil(log2(amax / 448))`
    (nothing saturates: qwix, NVIDIA's recipe) for `"ceil"`."""
    if rounding == "floor":
        return np.exp2(np.floor(np.log2(amax)) - E4M3_EMAX)
    if rounding == "ceil":
        return _pow2_at_least(amax / E4M3_MAX)
    raise ValueError(
        f"`block_scales`: `rounding` (={rounding!r}) must be floor or ceil."
    )


def block_causes(
    v: Any,
    ours: Any,
    theirs: Any,
    axis: int,
    rounding: str,
    block: int = 32,
) -> dict[str, Any]:
    """How two MXFP8 quantisations of `v` (blocks of `block` along `axis`) differ,
    block by block: `ours` rounds its scales by `rounding`, `theirs` by `"ceil"`.

    **Returns:** the number of blocks; those whose values differ; those the two
    scale rules give different scales; those that differ although the rules agree
    (a cause other than the scale rule); and, for each side, the largest relative
    error, over the blocks, of the block's largest element."""
    b, qo, qt = (_blocks(a, axis, block) for a in (v, ours, theirs))
    amax = np.max(np.abs(b), axis=1)
    live = amax > 0
    rules = np.zeros_like(live)
    safe = np.where(live, amax, 1.0)
    rules[live] = (block_scales(safe, rounding) != block_scales(safe, "ceil"))[live]
    differ = np.any(qo != qt, axis=1)
    top = np.argmax(np.abs(b), axis=1)
    rows = np.arange(len(b))

    def top_error(q: np.ndarray) -> float:
        err = np.abs(q[rows, top] - b[rows, top]) / safe
        return float(np.max(np.where(live, err, 0.0)))

    return dict(
        blocks=int(len(b)),
        differ=int(differ.sum()),
        rules_differ=int(rules.sum()),
        unexplained=int((differ & ~rules).sum()),
        top_error_ours=top_error(qo),
        top_error_theirs=top_error(qt),
    )


def residuals(f: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """What `jax.vjp(f, *args)` saves for the backward pass: the bytes, and each
    array as `"256x512 float32"`, the arguments saved whole marked `(argument)`."""
    saved = xla.saved_residuals(f, *args)
    arrays = collections.Counter()
    total = 0
    for aval, source in saved:
        n = int(np.prod(aval.shape)) * jnp.dtype(aval.dtype).itemsize
        total += n
        shape = "x".join(map(str, aval.shape)) or "scalar"
        tag = " (argument)" if source.startswith("from the argument") else ""
        arrays[f"{shape} {jnp.dtype(aval.dtype).name}{tag}"] += 1
    return dict(
        bytes=total,
        arrays=[f"{n} x {a}" if n > 1 else a for a, n in sorted(arrays.items())],
    )
