"""The qwix side of the `qwix` section: the same MXFP8 work as a qwix user writes
it, a Flax (Linen) model quantised by `qwix.quantize_model` with a
`qwix.QtProvider` (qwix's quantised training, "QT": forward and backward products
quantised; `docs/source/qt.md` of google/qwix).

qwix and Flax are the `bench` extra, never dependencies of eqxrules: they are
imported here only, and only when a function needs them, so that the other
sections, and the tests of this one, run without them. Without them, `modules()`
raises an `ImportError` saying what to install.

qwix's rule for MXFP8 in all three products of a layer, field by field, is
`rule()`'s: what its `QtProvider` leaves out by default is said there."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

EXTRA = "python -m pip install -e '.[bench]'"
"""How to install what this side needs, from the checkout."""


def modules() -> tuple[Any, Any]:
    """`(qwix, flax.linen)`, or an `ImportError` saying how to install them."""
    try:
        import qwix
        from flax import linen
    except ImportError as e:
        raise ImportError(
            "The `qwix` benchmark section runs the same MXFP8 work in qwix, so it "
            f"needs qwix and Flax, the `bench` extra (`{e.name}` is missing): "
            f"`{EXTRA}` in the checkout, then `python -m benchmarks --only qwix`."
        ) from e
    return qwix, linen


def versions() -> dict[str, str]:
    """The versions measured: qwix's and Flax's."""
    qwix, _ = modules()
    import flax

    return dict(qwix=qwix.__version__, flax=flax.__version__)


def rule(block: int = 32) -> Any:
    """qwix's rule for MXFP8 in every operand of every product, as its own tests
    configure quantised training in MX formats (`test_nnx_multi_head_attention_qt_bwd`
    in `tests/_src/providers/qt_test.py`), with the backward products' second
    operands quantised too, as eqxrules' `mxfp8()` quantises them."""
    qwix, _ = modules()
    return qwix.QtRule(
        module_path=".*",
        # The forward product: x and the kernel in MXFP8 (E4M3 elements, scales
        # 2^ceil(log2(amax / 448))), blocks of `block` along the contraction
        # (qwix asks for the tile size of an MX format explicitly).
        weight_qtype="mxfp8",
        act_qtype="mxfp8",
        tile_size=block,
        # The backward products: the incoming gradient in MXFP8, along what each
        # contracts: the batch for the weight gradient (`bwd_weight_grad_tile_size`),
        # the output features for the input gradient (`dlhs_tile_size`, which
        # `QtProvider` sets only when the weight is the left operand; in `x @ W`
        # it is the right).
        bwd_qtype="mxfp8",
        bwd_weight_grad_tile_size=block,
        additional_qt_config=dict(
            dlhs_tile_size=block,
            drhs_tile_size=block,
            # qwix saves the float inputs for the backward pass whenever the
            # forward operands are MX (`_get_residual_for_backward`); without a
            # residual qtype the backward products' second operand (the kernel
            # for the input gradient, x for the weight gradient) stays float32.
            dlhs_residual_qtype="mxfp8",
            drhs_residual_qtype="mxfp8",
        ),
    )


def flax_params(mlp: eqx.nn.MLP) -> dict[str, Any]:
    """The Linen parameters of `mlp`'s layers, for `mlp_apply`: `Dense_i`'s kernel
    is layer `i`'s weight transposed (Linen's `[in, out]`, Equinox's `[out, in]`),
    its bias the layer's. Needs neither qwix nor Flax."""
    return {
        "params": {
            f"Dense_{i}": {"kernel": layer.weight.T, "bias": layer.bias}
            for i, layer in enumerate(mlp.layers)
        }
    }


def eqx_order(params: dict[str, Any]) -> list[jax.Array]:
    """`flax_params`'s arrays (or their gradients) in Equinox's layout and order:
    each layer's weight (the kernel transposed), then its bias."""
    layers = params["params"]
    out = []
    for i in range(len(layers)):
        layer = layers[f"Dense_{i}"]
        out += [layer["kernel"].T, layer["bias"]]
    return out


def mlp_apply(depth: int, width: int, params: Any, x: jax.Array) -> Callable:
    """`apply(params, x)` of an MLP in Linen, quantised by qwix for MXFP8 training:
    `depth` `nn.Dense(width)` layers with ReLU between them, none after the last
    (`eqx.nn.MLP`'s defaults). A `ValueError` unless `params` (`flax_params` of
    the Equinox MLP) have the names and shapes the model initialises for `x`, so
    that both libraries train the same network from the same weights."""
    qwix, nn = modules()

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(depth):
                x = nn.Dense(width)(x)
                if i < depth - 1:
                    x = nn.relu(x)
            return x

    model = qwix.quantize_model(MLP(), qwix.QtProvider([rule()]))
    shapes = jax.eval_shape(model.init, jax.random.key(0), x)
    if jax.tree.map(jnp.shape, shapes) != jax.tree.map(jnp.shape, params):
        raise ValueError(
            "`mlp_apply`: the Linen MLP's parameters "
            f"{jax.tree.map(jnp.shape, shapes)} are not those given "
            f"{jax.tree.map(jnp.shape, params)}."
        )
    return model.apply


def product_apply(n: int) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """`f(x, w)`: one product `x @ w` (`w` of `n` columns) as qwix quantises it, a
    bias-free `nn.Dense(n)` whose kernel is `w`."""
    qwix, nn = modules()
    model = qwix.quantize_model(nn.Dense(n, use_bias=False), qwix.QtProvider([rule()]))
    return lambda x, w: model.apply({"params": {"kernel": w}}, x)


def quantised(v: jax.Array, axis: int, block: int = 32) -> jax.Array:
    """`v` as qwix's MXFP8 quantises it for a product contracting `axis`: blocks of
    `block` along `axis`, one scale per block, dequantised."""
    qwix, _ = modules()
    q = qwix.quantize(
        v,
        "mxfp8",
        channelwise_axes=[a for a in range(v.ndim) if a != axis % v.ndim],
        tiled_axes={axis % v.ndim: block},
    )
    return qwix.dequantize(q).astype(jnp.float32)
