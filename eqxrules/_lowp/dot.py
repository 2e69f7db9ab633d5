r"""`quantized_dot`: a matrix product whose three products, forward and backward,
each quantise their operands as a recipe says. One custom VJP reads the recipe.

With $x$ flattened to $M \times K$ (its leading axes are the batch) and $w$ of
$K \times N$, and $Q^{p}_{a}$ the quantiser the recipe gives operand $a$ of product
$p$, blocked along that product's reduced dimension:

$$y = Q^{\mathrm{fwd}}_{x}(x)\, Q^{\mathrm{fwd}}_{w}(w) \quad (\text{along } K),
\qquad
\bar x = Q^{\mathrm{dx}}_{\bar y}(\bar y)\, Q^{\mathrm{dx}}_{w}(w)^\top
\quad (\text{along } N),
\qquad
\bar w = Q^{\mathrm{dw}}_{x}(x)^\top Q^{\mathrm{dw}}_{\bar y}(\bar y)
\quad (\text{along } M).$$

Each product is evaluated by one function, `_evaluate`, from its
[`Product`][eqxrules.recipes.Product] and its layout (`FORWARD`, `INPUT_GRADIENT`,
`WEIGHT_GRADIENT`: which axis of each stored operand it reduces). The
weight-gradient product pads a batch its blocks do not divide with zero rows at the
end (`_pad_batch`), before its Hadamard transform and quantisers: zeros change no
block's scale nor any sum, so the result is that of the padded batch, bit for bit.

Under `jax.vmap`, a product whose batch operand is mapped runs once on the whole
batch, the mapped axis joined to the rows (a `custom_vmap` rule): the weight-gradient
product's blocks, and any per-tensor scale, then see the batch, exactly as when
`quantized_dot` is called on it.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.custom_batching import custom_vmap
from jaxtyping import Array, Float, PRNGKeyArray

from .._catalogue import VJPRule
from .._inputs import check_float_array, check_key
from .hadamard import random_signs, rotate
from .recipes import Custom, Product, Recipe, block_lengths, reads_key

_F32 = jnp.float32
_NAME = "quantized_dot"


class Layout(NamedTuple):
    """One product `lhs · rhs` of 2-D float32 operands stored as the layer holds
    them: it reduces axis `lhs_axis` of `lhs` with axis `rhs_axis` of `rhs`. `rows`
    says which operands have the batch (rows, axis 0); `name`, `reduced` and
    `operands` (what `lhs` and `rhs` are) are for messages."""

    name: str
    lhs_axis: int
    rhs_axis: int
    rows: tuple[bool, bool]
    reduced: str
    operands: tuple[str, str]

    @property
    def output_rows(self) -> bool:
        """Whether the product's output keeps the batch (as its axis 0)."""
        return self.rows[0] and self.lhs_axis != 0


# y = x·w: x [M, K], w [K, N].
FORWARD = Layout("forward", 1, 0, (True, False), "K", ("`x`", "`w`"))
# dx = dy·wᵀ: dy [M, N], w [K, N].
INPUT_GRADIENT = Layout(
    "input-gradient", 1, 1, (True, False), "N", ("the output's cotangent", "`w`")
)
# dw = xᵀ·dy: x [M, K], dy [M, N].
WEIGHT_GRADIENT = Layout(
    "weight-gradient", 0, 0, (True, True), "M", ("`x`", "the output's cotangent")
)


def _quantise(q: Any, a: Array, axis: int, key: PRNGKeyArray | None) -> Array:
    if q is None:
        return a
    fit = getattr(q, "for_reduction_axis", None)
    if fit is not None:
        q = fit(axis, a.shape[axis], f"a `{_NAME}` operand of shape {a.shape}")
    return q(a, key=key)


def _evaluate(
    product: Product, layout: Layout, lhs: Array, rhs: Array, w: Array, key: Any
) -> Array:
    """`Q(lhs) · Q(rhs)` in float32, reduced as `layout` says, after the random
    Hadamard transform of both operands if `product` asks for it. `w` is the
    weight, whose sharding the weight-gradient product takes. The weight-gradient
    product first pads a ragged batch (`_pad_batch`)."""
    if layout is WEIGHT_GRADIENT:
        lhs, rhs = _pad_batch(product, lhs, rhs)
    k_lhs = k_rhs = None
    if key is not None:
        k_lhs, k_rhs, k_signs = operand_keys(key)
        if product.hadamard is not None:
            # The same signs on both operands: R Rᵀ = I leaves the product alone.
            signs = random_signs(k_signs, product.hadamard)
            lhs = rotate(lhs, layout.lhs_axis, signs)
            rhs = rotate(rhs, layout.rhs_axis, signs)
    q_lhs = _quantise(product.lhs, lhs, layout.lhs_axis, k_lhs)
    q_rhs = _quantise(product.rhs, rhs, layout.rhs_axis, k_rhs)
    dims = (((layout.lhs_axis,), (layout.rhs_axis,)), ((), ()))
    sharding = _sharding_of(w) if layout is WEIGHT_GRADIENT else {}
    return jax.lax.dot_general(
        q_lhs, q_rhs, dims, preferred_element_type=_F32, **sharding
    )


def _pad_batch(product: Product, lhs: Array, rhs: Array) -> tuple[Array, Array]:
    """`lhs` and `rhs` (the weight-gradient product's `x` [M, K] and cotangent
    [M, N]) with zero rows appended, up to the least multiple of every block length
    of `product` (its quantisers' and its Hadamard transform's) at least M: the
    same arrays where M is one already. Zero rows add nothing to the product, change
    no block's amax (so no scale, block or per-tensor) and quantise to zero; at the
    end, the partial block is the last one and every other block is as it was."""
    block = math.lcm(1, *(size for _, size in block_lengths(product)))
    pad = -lhs.shape[0] % block
    if not pad:
        return lhs, rhs
    rows = ((0, pad), (0, 0))
    return jnp.pad(lhs, rows), jnp.pad(rhs, rows)


def _sharding_of(w: Array) -> dict[str, Any]:
    """`{"out_sharding": w's sharding}`, as `jnp.dot`'s transpose gives its
    weight's cotangent: with explicit sharding (JAX >= 0.7) a product reducing a
    sharded batch must be told its output's. Empty where JAX has no such thing."""
    typeof = getattr(jax, "typeof", None)
    if typeof is None or "out_sharding" not in _DOT_PARAMETERS:
        return {}
    sharding = getattr(typeof(w), "sharding", None)
    if sharding is None or sharding.mesh.empty:
        return {}
    return {"out_sharding": sharding}


_DOT_PARAMETERS = inspect.signature(jax.lax.dot_general).parameters


# One compiled program per product when called eagerly (op by op, the quantisers
# alone compile dozens of small programs); inlined under an enclosing `jit`.
_compiled = jax.jit(_evaluate, static_argnums=(0, 1))


def operand_keys(key: PRNGKeyArray) -> tuple[Array, Array, Array]:
    """A product's keys: its left operand's, its right operand's (independent, so
    that the expectation of a product of two stochastically rounded operands is
    the product of their expectations), and its Hadamard signs'."""
    k = jax.random.split(key, 3)
    return k[0], k[1], k[2]


def length_error(
    product: Product, layout: Layout, length: int, dimension: str | None = None
) -> str | None:
    """The body of the `ValueError` when a block of `product` (its quantisers' or
    its Hadamard transform's) does not divide the reduced `length`, named
    `dimension` (by default as `quantized_dot` names it: K or N); else `None`. The
    batch M has none: the weight-gradient product pads it (`_pad_batch`)."""
    for part, size in block_lengths(product):
        if length % size:
            operands = {"lhs": layout.operands[0], "rhs": layout.operands[1]}
            what = operands.get(part, "the Hadamard transform")
            dimension = dimension or _DIMENSIONS[layout.reduced]
            return (
                f"the {layout.name} product reduces {dimension} (={length}), which "
                f"its `{part}` ({what}, in blocks of {size}) must divide"
            )
    return None


# `w` is [K, N] here: an `eqx.nn.Linear`'s weight ([out, in]) transposed.
_DIMENSIONS = {
    "K": "K, the last axis of `x` and the first of `w`",
    "N": "N, the last axis of `w`",
}


def product(layout: Layout, spec: Product) -> Any:
    """`_evaluate` for `layout` and `spec`, as a function of `(lhs, rhs, w, key)`
    whose `vmap` joins the mapped axis to the batch (the rows) unless the weight
    `w` (an operand, or for the weight-gradient product a witness only) or the
    key is mapped."""
    return _not_differentiated(_product(layout, spec))


def _product(layout: Layout, spec: Product) -> Any:
    """`product`'s function. Under `vmap`, `custom_vmap` traces it on one example
    (whose batch the weight-gradient product pads, unevaluated), then replaces it
    with its rule's: the same function on the whole batch."""

    @custom_vmap
    def run(lhs: Array, rhs: Array, w: Array, key: Any) -> Array:
        return _compiled(spec, layout, lhs, rhs, w, key)

    @run.def_vmap
    def batched(size: int, in_batched: Any, lhs: Array, rhs: Array, w: Array, key):
        lhs_b, rhs_b, w_b, key_b = in_batched
        key_b = any(jtu.tree_leaves(key_b))
        rows_b = any(b for b, r in zip((lhs_b, rhs_b), layout.rows) if r)
        if w_b or (key_b and not rows_b):
            # An ensemble (the weight mapped), or independent draws (the key
            # mapped): each slice is its own product. `lax.map`, not `vmap`, so
            # that an enclosing `vmap` over the batch still reaches this rule.
            args, mapped = (lhs, rhs, w, key), (lhs_b, rhs_b, w_b, key_b)
            return _map(run, args, mapped), True
        if key_b:
            raise ValueError(
                f"`{_NAME}`: under `jax.vmap`, `key` is mapped with the batch of "
                "`x`. The mapped axis of `x` joins the batch of the products (the "
                "weight-gradient product's blocks run along it), which take one "
                "key: pass the same key to every example, e.g. "
                "`jax.vmap(lambda x: f(x, key=key))(xs)` or `in_axes=None` for it."
            )
        a, b = (
            _fold(v, mapped, size) if rows else v
            for v, mapped, rows in zip((lhs, rhs), (lhs_b, rhs_b), layout.rows)
        )
        out = run(a, b, w, key)
        if layout.output_rows:
            return out.reshape(size, -1, out.shape[-1]), True
        return out, False

    return run


def _not_differentiated(f: Any) -> Any:
    """`f`, with a clear error when differentiated: a product of the backward pass
    is, only by a second derivative (`custom_vmap` has no derivative of its own)."""

    @jax.custom_jvp
    def g(*args: Any) -> Array:
        return f(*args)

    @g.defjvp
    def _(primals: Any, tangents: Any) -> Any:
        raise TypeError(
            f"`{_NAME}` has no second derivative: its derivative quantises the "
            "cotangent, which has no derivative. Differentiate it once "
            "(`jax.grad`, `jax.vjp`)."
        )

    return g


def _map(f: Any, args: tuple[Any, ...], mapped: tuple[bool, ...]) -> Array:
    """`f(*args)` on each slice (along axis 0) of the `mapped` arguments, the
    others whole."""

    def one(slices: list[Any]) -> Array:
        it = iter(slices)
        return f(*(next(it) if m else a for a, m in zip(args, mapped)))

    return jax.lax.map(one, [a for a, m in zip(args, mapped) if m])


def _fold(v: Array, mapped: bool, size: int) -> Array:
    """The rows of `v` ([B, M, ·] if `mapped`, else [M, ·], the same for every
    example) as one [B·M, ·] matrix."""
    if not mapped:
        v = jnp.broadcast_to(v, (size, *v.shape))
    return v.reshape(-1, v.shape[-1])


class _QuantizedDot(VJPRule):
    """`quantized_dot` as a rule of the library's one custom-VJP function (so its
    cotangents have their primals' dtypes, and forward mode is a clear error)."""

    recipe: Custom = eqx.field(static=True)

    elementwise: ClassVar[bool] = False

    @classmethod
    def rule_name(cls) -> str:
        return _NAME

    def primal(self, x: Array, w: Array, *, key: Any = None) -> Array:
        k = _keys(key)
        x2 = x.reshape(-1, x.shape[-1]).astype(_F32)
        w32 = w.astype(_F32)
        y = product(FORWARD, self.recipe.fwd)(x2, w32, w32, k[0])
        return y.reshape(*x.shape[:-1], w.shape[1]).astype(jnp.result_type(x, w))

    def bwd(
        self, residuals: Any, cotangent: Array, args: tuple[Any, ...], **kwargs: Any
    ) -> tuple[Array, Array]:
        x, w = args
        k = _keys(kwargs.get("key"))
        x2 = x.reshape(-1, x.shape[-1]).astype(_F32)
        dy = cotangent.reshape(-1, w.shape[1]).astype(_F32)
        w32 = w.astype(_F32)
        dx = product(INPUT_GRADIENT, self.recipe.dx)(dy, w32, w32, k[1])
        dw = product(WEIGHT_GRADIENT, self.recipe.dw)(x2, dy, w32, k[2])
        return dx.reshape(x.shape), dw


def _keys(key: PRNGKeyArray | None) -> tuple[Any, Any, Any]:
    """One key per product (forward, input gradient, weight gradient)."""
    if key is None:
        return None, None, None
    k = jax.random.split(key, 3)
    return k[0], k[1], k[2]


def quantized_dot(
    x: Float[Array, "*batch K"],
    w: Float[Array, "K N"],
    *,
    recipe: Recipe,
    key: PRNGKeyArray | None = None,
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

    **Returns:**

    `[..., N]`, the value of `Q(x) · Q(w)`.

    **Raises:**

    `ValueError` at the call when the forward product's blocks do not divide $K$,
    or the input-gradient product's $N$ (a feature dimension, not padded). Never for
    the batch $M$, which the weight-gradient product pads.

    Under `jax.vmap` over `x`, the mapped axis joins the batch: the result (value
    and gradients) is that of one call on the whole batch, its weight-gradient
    blocks and per-tensor scales spanning the examples, as a layer of a model
    mapped with `vmap` needs. A mapped `w` (an ensemble) or a mapped `key` with an
    unmapped `x` maps the whole product instead; a mapped `key` with a mapped `x` is
    a `ValueError` (the batch's products take one key). So `jax.vmap(jax.grad(f))`
    does not give per-example gradients of `w`: each is the batch's. Under
    `jax.shard_map`, each device's call sees its own rows (its per-tensor scales
    and batch blocks are its own), and a replicated `w`'s cotangent is summed over
    the devices, as `jnp.dot`'s is (a device whose rows its blocks do not divide
    pads its own). Reverse mode only (`jax.grad`, `jax.vjp`); its
    derivative is not differentiated again.

    !!! Example

        ```python
        x = jax.random.normal(jax.random.key(0), (64, 256))
        w = jax.random.normal(jax.random.key(1), (256, 128)) / 16
        y = eqxrules.quantized_dot(x, w, recipe=eqxrules.recipes.mxfp8())
        ```
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"`{_NAME}`: `recipe` (={recipe!r}) must be an "
            "`eqxrules.recipes.Recipe`, e.g. `eqxrules.recipes.mxfp8()`."
        )
    check_float_array(_NAME, (x,), argument="x")
    check_float_array(_NAME, (w,), argument="w")
    x_shape, w_shape = tuple(jnp.shape(x)), tuple(jnp.shape(w))
    if len(w_shape) != 2:
        raise ValueError(f"`{_NAME}`: `w` (shape {w_shape}) must be a matrix [K, N].")
    if not x_shape or x_shape[-1] != w_shape[0]:
        raise ValueError(
            f"`{_NAME}`: the last axis of `x` (shape {x_shape}) must have the length "
            f"of the first axis of `w` (shape {w_shape}), K = {w_shape[0]}."
        )
    products = recipe.products()
    for spec, layout, length in (
        (products.fwd, FORWARD, w_shape[0]),
        (products.dx, INPUT_GRADIENT, w_shape[1]),
    ):
        message = length_error(spec, layout, length)
        if message is not None:
            raise ValueError(f"`{_NAME}`: {message}.")
    if key is not None:  # even where the recipe reads none: a bad key is a bug
        check_key(_NAME, key)
    random = reads_key(products)
    if random and key is None:
        raise TypeError(
            f"`{_NAME}`: `recipe` draws random numbers ({', '.join(random)}), so it "
            "needs a PRNG key: pass `key=`."
        )
    # A key the recipe does not read is dropped, so that it cannot constrain `vmap`.
    return _QuantizedDot(products)(x, w, key=key if random else None)


__all__ = ["quantized_dot"]
