"""A recipe in a model: `QuantizedLinear` computes an `eqx.nn.Linear` with
[`quantized_dot`][eqxrules.quantized_dot], `QuantizedConv` an `eqx.nn.Conv` with
[`quantized_conv`][eqxrules.quantized_conv], and `Keyed` gives each of a model's
quantised layers its own key at every call. `quantize(model, recipe=...)` puts the
layers in.

How keys reach the layers. Most models call their layers without a key
(`eqx.nn.MLP`, `eqx.nn.MultiheadAttention`'s projections), yet stochastic rounding
and the Hadamard transform need a fresh one at every step. `Keyed` takes the key of
its own call, splits it, and puts one part into each `QuantizedLinear` of a copy of
the model that lives only for that call. The alternative, a key held in each layer
and advanced by the user at every step, fails silently when the user forgets: the
same draws every step, the "fixed key" bug that makes stochastic rounding biased
over training. Here a stored model never holds a key, and a call without one, when
the recipe needs one, is an error.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PRNGKeyArray

from .._axis_names import check_names
from .._inputs import check_key
from .._tangents import takes_key
from .conv import check_conv, quantized_conv
from .dot import OPERANDS, length_error, quantized_dot_general
from .ops import Conv
from .recipes import Recipe, reads_key


class QuantizedLinear(eqx.Module):
    """An `eqx.nn.Linear` whose product is [`quantized_dot`][eqxrules.quantized_dot]
    with `recipe`: the value is `quantized_dot(x, linear.weight.T, recipe=recipe,
    key=key) + linear.bias`, the bias added in the output's precision, unquantised.
    The float weight and bias are what is trained.

    Built by [`quantize`][eqxrules.quantize] with `recipe=`. A recipe that draws
    random numbers needs a key at every call: wrap the model in
    [`Keyed`][eqxrules.Keyed], which gives each layer its own.

    **Arguments:**

    - `linear`: the `eqx.nn.Linear`. Its `in_features` must be divisible by the
        blocks of the forward product and its `out_features` by those of the
        input-gradient product (a `ValueError` otherwise). (Its weight is
        `[out_features, in_features]`; `quantized_dot`'s `w` is its transpose.)
    - `recipe`: an [`eqxrules.recipes.Recipe`][].
    - `key`: a key to use when the call gives none (set by `Keyed` for one call;
        leave it `None`).
    - `path`: where the layer is in its model, as `model.layers[1]` (`quantize`
        sets it; `None` for a layer built directly), to tell layers apart when
        reading a model. No call needs it: the batch has no block to fit, the
        weight-gradient product padding a batch its blocks do not divide with zero
        rows (see [`quantized_dot`][eqxrules.quantized_dot]).
    - `axis_name`: `None` (each call its own, under `vmap` too), or the name (a
        tuple of names) of the mapped axes whose examples the products span, as
        `eqx.nn.BatchNorm` takes it: under `jax.vmap(model, axis_name="batch")`,
        a layer with `axis_name="batch"` computes as one call on the whole batch
        (per-tensor scales and weight-gradient blocks across the examples, so
        per-example gradients are coupled, as with `BatchNorm`); under
        `jax.shard_map` over a mesh axis of that name, per-tensor scales span
        the devices (see [`quantized_dot`][eqxrules.quantized_dot]).
    """

    linear: eqx.nn.Linear
    recipe: Recipe = eqx.field(static=True)
    key: PRNGKeyArray | None = None
    path: str | None = eqx.field(default=None, static=True, kw_only=True)
    axis_name: Hashable | tuple[Hashable, ...] | None = eqx.field(
        default=None, static=True, kw_only=True
    )

    def __check_init__(self) -> None:
        if not isinstance(self.linear, eqx.nn.Linear):
            raise TypeError(
                f"`QuantizedLinear`: `linear` (a {type(self.linear).__name__}) must "
                "be an `eqx.nn.Linear`."
            )
        check_layer(self.linear, self.recipe, "QuantizedLinear", "`linear`")
        check_names("QuantizedLinear", self.axis_name)

    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        """**Arguments:**

        - `x`: the input, `[in_features]` (or `[..., in_features]`; `()` for
            `in_features="scalar"`).
        - `key`: a PRNG key, if the recipe needs one (else ignored); defaults to
            the layer's own `key`.

        **Returns:**

        The layer's output, `[out_features]` (`()` for `out_features="scalar"`).
        """
        key = self.key if key is None else key
        _needs_key(self, self.recipe, key, "QuantizedLinear")
        linear = self.linear
        if linear.in_features == "scalar":
            x = jnp.reshape(x, (*jnp.shape(x), 1))
        # `x · weightᵀ` as one `dot_general` on the weight as stored, contracting
        # its `in_features` axis: quantising `weight.T` made XLA copy every
        # weight into the transposed layout (a transpose and a copy of each
        # weight per step, measured on a 4-layer MLP: 21 and 43).
        contract = (((jnp.ndim(x) - 1,), (1,)), ((), ()))
        y = quantized_dot_general(
            x,
            linear.weight,
            contract,
            recipe=self.recipe,
            key=key,
            axis_name=self.axis_name,
        )
        if linear.bias is not None:
            y = y + linear.bias
        return y[..., 0] if linear.out_features == "scalar" else y


def check_layer(linear: eqx.nn.Linear, recipe: Recipe, function: str, name: str):
    """A `ValueError` from `function`, naming the layer as `name`, unless the
    forward product's blocks divide its `in_features` and the input-gradient
    product's its `out_features`; a `TypeError` unless `recipe` is a recipe."""
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"`{function}`: `recipe` (={recipe!r}) must be an "
            "`eqxrules.recipes.Recipe`, e.g. `eqxrules.recipes.mxfp8()`."
        )
    n_out, n_in = linear.weight.shape
    products = recipe.products()
    for spec, which, length, features in (
        (products.fwd, "forward", n_in, "in_features"),
        (products.dx, "input-gradient", n_out, "out_features"),
    ):
        message = length_error(
            spec, which, length, f"its `{features}`", OPERANDS[which]
        )
        if message is not None:
            advice = " Leave it out with `where=`." if function == "quantize" else ""
            raise ValueError(
                f"`{function}`: {name} ({_features(linear)}) cannot take `recipe`: "
                f"{message}.{advice}"
            )


def _features(linear: eqx.nn.Linear) -> str:
    """The layer's sizes in its own terms (the weight is `[out, in]`)."""
    n_out, n_in = linear.weight.shape
    return (
        f"an `eqx.nn.Linear` with `in_features`={n_in} and `out_features`={n_out}, "
        f"weight shape {(n_out, n_in)}"
    )


def _needs_key(layer: Any, recipe: Recipe, key: Any, name: str) -> None:
    """The checks of a quantised layer's key at its call: a PRNG key if given, and
    given if the recipe draws."""
    if key is not None:
        check_key(name, key)
    random = reads_key(recipe.products())
    if random and key is None:
        raise TypeError(
            f"`{name}`: its recipe draws random numbers "
            f"({', '.join(random)}), so the layer needs a PRNG key: wrap the "
            "model in `eqxrules.Keyed` and call it with `key=` (it gives each "
            "layer its own), or call this layer with `key=`."
        )


class QuantizedConv(eqx.Module):
    """An `eqx.nn.Conv` (`Conv1d`, `Conv2d`, `Conv3d`) whose convolution is
    [`quantized_conv`][eqxrules.quantized_conv] with `recipe`: the value is that of
    `conv`, with `lax.conv_general_dilated` replaced by `quantized_conv(x,
    conv.weight, conv.stride, conv.padding, rhs_dilation=conv.dilation,
    feature_group_count=conv.groups, recipe=recipe, key=key)`, and the bias added
    in the output's precision, unquantised. The float weight and bias are what is
    trained.

    Built by [`quantize`][eqxrules.quantize] with `recipe=`. A recipe that draws
    random numbers needs a key at every call: wrap the model in
    [`Keyed`][eqxrules.Keyed], which gives each layer its own. Under `jax.vmap`
    over examples each example is its own call, unless `axis_name` names that
    `vmap`: then the mapped axis joins the convolution's batch, so the
    weight-gradient product's blocks and per-tensor scales see the whole batch.

    **Arguments:**

    - `conv`: the `eqx.nn.Conv`, with `padding_mode="ZEROS"` (another mode is a
        `ValueError`). The forward product's blocks must divide its input channels
        per group (the weight's axis 1) and the input-gradient product's its
        `out_channels`; its recipe must have no Hadamard transform (a `ValueError`
        otherwise, see `quantized_conv`).
    - `recipe`: an [`eqxrules.recipes.Recipe`][].
    - `key`: a key to use when the call gives none (set by `Keyed` for one call;
        leave it `None`).
    - `path`: where the layer is in its model, as `model.layers[1]` (`quantize`
        sets it), for messages and reading a model.
    - `axis_name`: as for [`QuantizedLinear`][eqxrules.QuantizedLinear].
    """

    conv: eqx.nn.Conv
    recipe: Recipe = eqx.field(static=True)
    key: PRNGKeyArray | None = None
    path: str | None = eqx.field(default=None, static=True, kw_only=True)
    axis_name: Hashable | tuple[Hashable, ...] | None = eqx.field(
        default=None, static=True, kw_only=True
    )

    def __check_init__(self) -> None:
        if not isinstance(self.conv, eqx.nn.Conv):
            raise TypeError(
                f"`QuantizedConv`: `conv` (a {type(self.conv).__name__}) must be an "
                "`eqx.nn.Conv` (`Conv1d`, `Conv2d`, `Conv3d`)."
            )
        check_conv_layer(self.conv, self.recipe, "QuantizedConv", "`conv`")
        check_names("QuantizedConv", self.axis_name)

    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        """**Arguments:**

        - `x`: the input, `[in_channels, *spatial]` as `eqx.nn.Conv` takes it, or
            a batch of them, `[batch, in_channels, *spatial]`.
        - `key`: a PRNG key, if the recipe needs one (else ignored); defaults to
            the layer's own `key`.

        **Returns:**

        The layer's output, `[out_channels, *spatial']` (with the batch in front
        if `x` has one).
        """
        key = self.key if key is None else key
        _needs_key(self, self.recipe, key, "QuantizedConv")
        conv = self.conv
        n = conv.num_spatial_dims
        if jnp.ndim(x) not in (n + 1, n + 2):
            raise ValueError(
                f"`QuantizedConv`: `x` (shape {jnp.shape(x)}) must have rank {n + 1} "
                f"([in_channels, *spatial]) or {n + 2} (with a batch in front)."
            )
        unbatched = jnp.ndim(x) == n + 1
        y = quantized_conv(
            x[None] if unbatched else x,
            conv.weight,
            conv.stride,
            conv.padding,
            rhs_dilation=conv.dilation,
            feature_group_count=conv.groups,
            recipe=self.recipe,
            key=key,
            axis_name=self.axis_name,
        )
        y = y[0] if unbatched else y
        if conv.bias is not None:
            y = y + conv.bias
        return y


def check_conv_layer(conv: eqx.nn.Conv, recipe: Recipe, function: str, name: str):
    """A `ValueError` from `function`, naming the layer as `name`, unless `recipe`
    can compute `conv` (see `QuantizedConv`); a `TypeError` unless it is a
    recipe."""
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"`{function}`: `recipe` (={recipe!r}) must be an "
            "`eqxrules.recipes.Recipe`, e.g. `eqxrules.recipes.mxfp8()`."
        )
    described = (
        f"an `eqx.nn.Conv` with `in_channels`={conv.in_channels}, "
        f"`out_channels`={conv.out_channels}, `groups`={conv.groups}, weight shape "
        f"{tuple(conv.weight.shape)}"
    )
    mode = getattr(conv, "padding_mode", "ZEROS")
    if mode != "ZEROS":
        raise ValueError(
            f"`{function}`: {name} ({described}) has `padding_mode`={mode!r}; a "
            "recipe computes convolutions with `padding_mode='ZEROS'` only."
        )
    axes = tuple(range(conv.num_spatial_dims + 2))
    op = Conv((), "VALID", None, None, (axes, axes, axes), conv.groups)
    try:
        check_conv(function, op, recipe.products(), conv.weight.shape)
    except ValueError as e:
        advice = " Leave it out with `where=`." if function == "quantize" else ""
        message = str(e).removeprefix(f"`{function}`: ")
        raise ValueError(
            f"`{function}`: {name} ({described}) cannot take `recipe`: "
            f"{message}{advice}"
        ) from None


LAYERS = (QuantizedLinear, QuantizedConv)


def _is_layer(node: Any) -> bool:
    return isinstance(node, LAYERS)


def _layers(model: Any) -> list[Any]:
    return [n for n in jtu.tree_leaves(model, is_leaf=_is_layer) if _is_layer(n)]


class Keyed(eqx.Module):
    """A model whose quantised layers ([`QuantizedLinear`][eqxrules.QuantizedLinear],
    [`QuantizedConv`][eqxrules.QuantizedConv]) each get a key of their own at every
    call, whether or not the model passes keys to its
    layers (`eqx.nn.MLP` does not).

    Called as `keyed(*args, key=key, **kwargs)`: `key` is split into one key per
    quantised layer (in the order of the model's leaves) and one more, passed to
    the model itself if it takes a `key` (for its dropout, say). Each layer's key
    lives in a copy of the model made for this call only, so the stored model
    never holds one: a call without `key`, when a layer's recipe needs one, is a
    `TypeError`, never the same draws step after step. (The alternative, a key
    kept in each layer and advanced by the user at every step, fails silently
    when a step forgets: stochastic rounding with the same draws at every step is
    biased over training. The price of the wrapper: the model is reached as
    `keyed.model`.)

    Under `jax.vmap`, give every example the same key
    (`jax.vmap(lambda x: keyed(x, key=key), axis_name="batch")(xs)`) where the
    layers' `axis_name` names that `vmap`: their products then run on the whole
    batch with that one key, as [`quantized_dot`][eqxrules.quantized_dot] on the
    batch would. Without `axis_name`, each example is its own call, and a key
    mapped with the examples gives each its own draws. A layer called several times within one call (weights
    shared across positions, a `lax.scan` over time) gets the same key each time:
    each product is still unbiased, but the draws repeat across those calls; call
    the layer with `key=` yourself if that matters.

    **Arguments:**

    - `model`: any model; its `QuantizedLinear` and `QuantizedConv` layers are the
        ones keyed.
    """

    model: Any

    def __call__(self, *args: Any, key: PRNGKeyArray | None = None, **kwargs: Any):
        """**Arguments:** the model's own, and `key`, a PRNG key (required when a
        layer's recipe draws random numbers).

        **Returns:** the model's output.
        """
        model = self.model
        if key is None:
            return model(*args, **kwargs)
        check_key("Keyed", key)
        layers = _layers(model)
        keys = jax.random.split(key, len(layers) + 1)
        model = eqx.tree_at(
            lambda m: [layer.key for layer in _layers(m)],
            model,
            list(keys[:-1]),
            is_leaf=lambda node: node is None,
        )
        if takes_key(model):
            return model(*args, key=keys[-1], **kwargs)
        return model(*args, **kwargs)
