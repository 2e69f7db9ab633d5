r"""The public quantised products over `lax.dot_general`:
[`quantized_dot_general`][eqxrules.quantized_dot_general] and
[`quantized_dot`][eqxrules.quantized_dot], a linear layer's product
([`quantized_einsum`][eqxrules.quantized_einsum] is in `einsum`). Each checks
its arguments, then runs the quantised core (`core._Bilinear`) on a `core.DotGeneral`
operation, whose dimension numbers say what each of the three products contracts.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .. import _axis_names
from .._catalogue import _JAX_REVERSE_ONLY, REVERSE_ONLY_MESSAGE
from .._inputs import check_float_array, check_key
from . import residuals
from .core import _Bilinear
from .ops import DotGeneral, Op
from .recipes import Custom, Product, Recipe, block_lengths, reads_key

_NAME = "quantized_dot"


def check_call(
    name: str, recipe: Any, operands: dict[str, Any], key: Any, axis_name: Any
) -> tuple[Custom, bool]:
    """The checks every quantised product makes of its arguments (a `TypeError` or
    `ValueError` naming `name`): `recipe` a recipe, each operand a floating-point
    array, `key` a PRNG key if given and given if the recipe draws, each name of
    `axis_name` bound. Returns the recipe's products and whether they read the
    key."""
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"`{name}`: `recipe` (={recipe!r}) must be an "
            "`eqxrules.recipes.Recipe`, e.g. `eqxrules.recipes.mxfp8()`."
        )
    for argument, value in operands.items():
        check_float_array(name, (value,), argument=argument)
    products = recipe.products()
    if key is not None:  # even where the recipe reads none: a bad key is a bug
        check_key(name, key)
    random = reads_key(products)
    if random and key is None:
        raise TypeError(
            f"`{name}`: `recipe` draws random numbers ({', '.join(random)}), so it "
            "needs a PRNG key: pass `key=`."
        )
    _axis_names.check_bound(name, axis_name)
    return products, bool(random)


def run(
    op: Op,
    products: Custom,
    a: Array,
    b: Array,
    key: Any,
    random: bool,
    axis_name: Any,
    extras: tuple[Array, ...] = (),
) -> Array:
    """The quantised core on `op`, its named axes joined (a `vmap`'s) or spanned
    with collectives (a `shard_map`'s). A key the recipe does not read is
    dropped, so that it cannot constrain `vmap`."""
    vmapped, collective = _axis_names.split(axis_name)
    key = key if random else None
    if vmapped:  # the batch's blocks: `a` kept, the products of its join
        rule = _Bilinear(op, products, vmapped, collective)
        tags = _axis_names.tags(vmapped)
        return rule(a, b, key=key, extras=extras, tags=tags)
    # Residuals in their formats (`residuals`).
    config = residuals.Config(op, products, collective)
    try:
        return residuals.bilinear(config, a, b, key, extras)
    except TypeError as e:
        if _JAX_REVERSE_ONLY not in str(e):
            raise
        raise TypeError(
            f"`{op.name}` {REVERSE_ONLY_MESSAGE}: its backward pass is not linear "
            "in the cotangent, so it has no JVP. Use `jax.grad`, `jax.vjp` or "
            "`jax.jacrev` instead of `jax.jvp` or `jax.jacfwd`."
        ) from e


def length_error(
    spec: Product,
    product: str,
    length: int,
    dimension: str,
    operands: tuple[str, str] = ("`lhs`", "`rhs`"),
) -> str | None:
    """The body of the `ValueError` when a block of `spec` (its quantisers' or its
    Hadamard transform's) does not divide `length`, a feature dimension that
    `product` contracts (named `dimension`), which is not padded; else `None`.
    `operands` names what the product's `lhs` and `rhs` quantise."""
    for part, size in block_lengths(spec):
        if length % size:
            names = {"lhs": operands[0], "rhs": operands[1]}
            what = (
                f"its `{part}` ({names[part]}, in blocks of {size})"
                if part in names
                else f"its Hadamard transform (in blocks of {size})"
            )
            return (
                f"the {product} product reduces {dimension} (={length}), which "
                f"{what} must divide"
            )
    return None


# What the products of a linear layer quantise, by product.
OPERANDS = {
    "forward": ("`x`", "`w`"),
    "input-gradient": ("the output's cotangent", "`w`"),
}


_DimensionNumbers = tuple[
    tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]
]


def _dot_op(name: str, lhs: Any, rhs: Any, dimension_numbers: Any) -> DotGeneral:
    """The operation, its dimension numbers checked (a `ValueError` naming `name`
    with `lax.dot_general`'s own reason) and made tuples of ints."""
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        dims = (
            (tuple(map(int, lc)), tuple(map(int, rc))),
            (tuple(map(int, lb)), tuple(map(int, rb))),
        )
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"`{name}`: `dimension_numbers` (={dimension_numbers!r}) must be "
            "`((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`, "
            "sequences of axes, as `jax.lax.dot_general` takes them."
        ) from e
    shapes = [jax.ShapeDtypeStruct(jnp.shape(v), jnp.float32) for v in (lhs, rhs)]
    try:
        jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dims), *shapes)
    except TypeError as e:
        raise ValueError(
            f"`{name}`: `dimension_numbers` (={dimension_numbers!r}) do not fit "
            f"`lhs` (shape {shapes[0].shape}) and `rhs` (shape {shapes[1].shape}): "
            f"{e}"
        ) from e
    ndims = len(shapes[0].shape), len(shapes[1].shape)

    def axes(pair: tuple[tuple[int, ...], tuple[int, ...]]) -> Any:
        return tuple(d % ndims[0] for d in pair[0]), tuple(
            d % ndims[1] for d in pair[1]
        )

    nonneg = (axes(dims[0]), axes(dims[1]))
    return DotGeneral(nonneg, ndims, name=name)


def quantized_dot_general(
    lhs: Float[Array, ...],
    rhs: Float[Array, ...],
    dimension_numbers: _DimensionNumbers,
    *,
    recipe: Recipe,
    key: PRNGKeyArray | None = None,
    axis_name: Hashable | tuple[Hashable, ...] | None = None,
) -> Float[Array, ...]:
    r"""`jax.lax.dot_general(lhs, rhs, dimension_numbers)` with each operand of each
    of its three products, forward and backward, quantised as `recipe` says.

    With $a$ = `lhs`, $b$ = `rhs` and $y = a \cdot b$ the contraction the dimension
    numbers give, and $Q^p$ the quantisers of product $p$ (the recipe's `fwd`, `dx`,
    `dw`), each blocked along what that product contracts:

    $$y = Q^{\mathrm{fwd}}(a) \cdot Q^{\mathrm{fwd}}(b)
    \quad \text{(along the contracting dimensions)},$$

    $$\bar a = Q^{\mathrm{dx}}(\bar y) \cdot Q^{\mathrm{dx}}(b)
    \quad \text{(along } b\text{'s free dimensions)}, \qquad
    \bar b = Q^{\mathrm{dw}}(a) \cdot Q^{\mathrm{dw}}(\bar y)
    \quad \text{(along } a\text{'s free dimensions)},$$

    the two gradient products being `dot_general`'s own transposes (its VJP) on the
    quantised operands. `dx`'s `lhs` quantises $\bar y$ and its `rhs` $b$; `dw`'s
    `lhs` quantises $a$ and its `rhs` $\bar y$. Batch dimensions are never
    contracted, so never blocked across.

    Conventions:

    - **Several contracted dimensions** are moved to the front in the order the
        dimension numbers list them (for $\bar a$ and $\bar b$, ascending), and
        flattened row-major into one, blocked as one.
    - **A contracted length a block does not divide** is padded with zeros at the
        end (the partial block is the last), before any Hadamard transform. Zeros
        change no block's amax, so no scale, quantise to zero and add nothing: the
        result is, bit for bit, that of the padded operands. (Unlike
        [`quantized_dot`][eqxrules.quantized_dot], which keeps its feature
        dimensions an error, every contracted length is padded here: a
        contraction has no notion of which dimension is a feature.)
    - **A random Hadamard transform** (`Product.hadamard`) rotates both operands
        of its product along the flattened, padded contracted dimension, with the
        same signs; its quantisers then block along it (square blocks cannot
        follow it: a `ValueError`).
    - **Square blocks** (`NVFP4Quantize(axis=(0, 1))`) cover the two axes they
        name of their operand, as they are.
    - **With the identity recipe** ([`recipes.identity`][eqxrules.recipes.identity]),
        the value and both cotangents equal `lax.dot_general`'s bit for bit
        (tested on the CPU).
    - **Under `jax.vmap`** it is what `vmap` means: `vmap(f)(xs)[i]` is
        `f(xs[i])`, each example its own call (its own per-tensor scales and
        weight-gradient blocks), `jax.vmap(jax.grad(loss))` each example's own
        gradient, and a key mapped with the examples draws for each as its own
        call does. For the scales and blocks of one call on the whole batch, name
        the axis: see `axis_name`.

    Quantisation and products are computed in float32 (`preferred_element_type`);
    the value has the dtype of `lhs · rhs`, each cotangent its primal's. Reverse
    mode only (`jax.grad`, `jax.vjp`); the derivative is not differentiated again.

    **Arguments:**

    - `lhs`, `rhs`: floating-point arrays.
    - `dimension_numbers`: `((lhs_contracting, rhs_contracting), (lhs_batch,
        rhs_batch))`, as `jax.lax.dot_general` takes them.
    - `recipe`: an [`eqxrules.recipes.Recipe`][], e.g. `recipes.mxfp8()`.
    - `key`: a PRNG key, required when the recipe rounds stochastically or
        rotates (a `TypeError` otherwise); split in three, one per product, and
        each product's in three (its two operands, its Hadamard signs).
    - `axis_name`: `None`, or the name (or a tuple of names) of mapped axes the
        products span, as `eqx.nn.BatchNorm` takes it (see
        [`quantized_dot`][eqxrules.quantized_dot] for what it means under `vmap`
        and `shard_map`). An axis name not bound here is a `ValueError`.

    **Returns:**

    `lax.dot_general`'s result: batch dimensions, then the free dimensions of
    `lhs`, then those of `rhs`.

    !!! Example

        ```python
        q = jax.random.normal(jax.random.key(0), (4, 16, 64))  # heads, tokens, d
        k = jax.random.normal(jax.random.key(1), (4, 16, 64))
        scores = eqxrules.quantized_dot_general(
            q, k, (((2,), (2,)), ((0,), (0,))), recipe=eqxrules.recipes.mxfp8()
        )  # [4, 16, 16]
        ```
    """
    name = "quantized_dot_general"
    operands = {"lhs": lhs, "rhs": rhs}
    products, random = check_call(name, recipe, operands, key, axis_name)
    op = _dot_op(name, lhs, rhs, dimension_numbers)
    return run(op, products, lhs, rhs, key, random, axis_name)


def quantized_dot(
    x: Float[Array, "*batch K"],
    w: Float[Array, "K N"],
    *,
    recipe: Recipe,
    key: PRNGKeyArray | None = None,
    axis_name: Hashable | tuple[Hashable, ...] | None = None,
) -> Float[Array, "*batch N"]:
    r"""`jnp.dot(x, w)` with each operand of each of its three products, forward and
    backward, quantised as `recipe` says: how FP8, MXFP8 and NVFP4 training compute a
    linear layer.

    With $x$ flattened to $M \times K$ (every leading axis is batch):

    $$y = Q(x)\,Q(w), \qquad
    \bar x = Q(\bar y)\,Q(w)^\top, \qquad
    \bar w = Q(x)^\top Q(\bar y)$$

    where each product has its own operand quantisers, blocked along the
    dimension it reduces: $K$ for $y$, $N$ for $\bar x$, the batch $M$ for
    $\bar w$. A product whose recipe asks for it first rotates both operands along
    that dimension by the same random Hadamard transform (blocks of 16, say), which
    leaves the unquantised product unchanged.

    A batch $M$ that the weight-gradient product's blocks (its quantisers' and its
    Hadamard transform's) do not divide, a ragged last batch or one example, is
    padded with zero rows at the end, in $x$ and $\bar y$ alike, to the least
    multiple $M'$ of every block length, before the rotation:

    $$\bar w = Q\begin{pmatrix} x \\ 0 \end{pmatrix}^\top
    Q\begin{pmatrix} \bar y \\ 0 \end{pmatrix}
    \quad (M' \text{ rows}).$$

    Zeros change no block's amax, so no scale (the last block's, or a per-tensor
    one), quantise to zero and add nothing: $\bar w$ is, bit for bit, that of the
    call on the padded batch (whose own cotangent's padded rows are zero), and the
    unquantised product $x^\top \bar y$ is unchanged. $K$ and $N$ are not padded:
    they are the layer's features, and padding them would change the layer.

    Quantisation is computed in float32,
    and so are the products (`jax.lax.dot_general` with float32 output, at JAX's
    default precision); the value has the dtype of `x · w`, each cotangent its
    primal's.

    A recipe made only of `None` quantisers
    ([`recipes.identity`][eqxrules.recipes.identity]) gives `jnp.dot` and its VJP
    bit for bit (tested on the CPU, float32 and bfloat16).

    **Arguments:**

    - `x`: an array `[..., K]` of floating point.
    - `w`: a matrix `[K, N]` of floating point (an `eqx.nn.Linear`'s `weight`,
        `[out_features, in_features]`, is its transpose).
    - `recipe`: an [`eqxrules.recipes.Recipe`][], e.g. `recipes.mxfp8()`.
    - `key`: a PRNG key, required when the recipe rounds stochastically or
        rotates (a `TypeError` otherwise). It is split in three, one key per
        product, and each product's in three (its two operands, its Hadamard
        signs), so no two draws share one.
    - `axis_name`: `None`, a name or a tuple of names of mapped axes (a `vmap`'s
        or a `shard_map`'s) that the products span (below); a name not bound
        here is a `ValueError`.

    **Returns:**

    `[..., N]`, the value of `Q(x) · Q(w)`.

    **Raises:**

    `ValueError` at the call when the forward product's blocks do not divide $K$,
    or the input-gradient product's $N$ (a feature dimension, not padded). Never for
    the batch $M$, which the weight-gradient product pads.

    **`vmap` means `vmap`.** With `axis_name=None` (the default),
    `jax.vmap(f)(xs)[i]` is `f(xs[i])`: each example is its own call, with its own
    per-tensor scales, its own weight-gradient blocks (its rows padded to the
    block) and, with a key mapped beside it, its own draws; so
    `jax.vmap(jax.grad(loss))` gives per-example gradients (DP-SGD, per-example
    norms).

    **Batch-wide by name.** A layer of a model written per example and mapped
    with `vmap` usually wants the scales and blocks of the whole batch, as
    hardware recipes take them. Ask for it by name, as `eqx.nn.BatchNorm` does:
    `axis_name="batch"` under `jax.vmap(..., axis_name="batch")` joins that axis
    to the rows, so the value, and the gradient of every unmapped argument (`w`),
    are those of one call on the whole batch: per-tensor scales span the
    examples and the weight-gradient product's blocks run along them. Per-example
    gradients are then coupled through the shared scales and blocks, as with
    `BatchNorm`. The key must then be the same for every example (a mapped key
    is a `ValueError`). A tuple names several axes (`("batch", "tokens")` for a
    model mapped over examples and, inside, over tokens); an axis mapped without
    a name keeps `vmap`'s meaning inside a named one.

    Under `jax.shard_map` over a mesh axis of that name (data parallelism), each
    device computes on its own rows, the weight-gradient product's blocks stay
    within them (as Transformer Engine's data-parallel weight gradient does) and
    per-tensor scales span the devices, with one `pmax` of a scalar per tensor. A
    replicated `w`'s cotangent is summed over the devices, as `jnp.dot`'s is (from
    JAX 0.7). Where each device's rows are a multiple of the blocks, the value and
    the summed gradient are those of one unsharded call (stochastic rounding aside,
    whose draws follow each device's own rows).

    (With explicit sharding, a named `vmap` over a sharded axis needs the mesh
    set, `jax.set_mesh(mesh)`, as any `lax.axis_index` there does.)

    Reverse mode only (`jax.grad`, `jax.vjp`); its derivative is not
    differentiated again.

    !!! Example

        ```python
        x = jax.random.normal(jax.random.key(0), (64, 256))
        w = jax.random.normal(jax.random.key(1), (256, 128)) / 16
        y = eqxrules.quantized_dot(x, w, recipe=eqxrules.recipes.mxfp8())
        ```
    """
    name = _NAME
    products, random = check_call(name, recipe, {"x": x, "w": w}, key, axis_name)
    x_shape, w_shape = tuple(jnp.shape(x)), tuple(jnp.shape(w))
    if len(w_shape) != 2:
        raise ValueError(f"`{name}`: `w` (shape {w_shape}) must be a matrix [K, N].")
    if not x_shape or x_shape[-1] != w_shape[0]:
        raise ValueError(
            f"`{name}`: the last axis of `x` (shape {x_shape}) must have the length "
            f"of the first axis of `w` (shape {w_shape}), K = {w_shape[0]}."
        )
    for spec, which, length, dimension in (
        (products.fwd, "forward", w_shape[0], DIMENSIONS["K"]),
        (products.dx, "input-gradient", w_shape[1], DIMENSIONS["N"]),
    ):
        message = length_error(spec, which, length, dimension, OPERANDS[which])
        if message is not None:
            raise ValueError(f"`{name}`: {message}.")
    dims = (((len(x_shape) - 1,), (0,)), ((), ()))
    op = DotGeneral(dims, (len(x_shape), 2), name=name)
    return run(op, products, x, w, key, random, axis_name)


# `w` is [K, N] here: an `eqx.nn.Linear`'s weight ([out, in]) transposed.
DIMENSIONS = {
    "K": "K, the last axis of `x` and the first of `w`",
    "N": "N, the last axis of `w`",
}


__all__ = ["quantized_dot", "quantized_dot_general"]
