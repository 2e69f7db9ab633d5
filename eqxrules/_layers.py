"""Layers built from rules: `Quantized` wraps a layer with a `weight`, and `quantize`
wraps every such layer of a model, with quantisers or a recipe (`calibrate`, in
`_calibrate`, initialises learned input quantisers from data).

A layer `quantize` reaches has two settings, each a wrapper in a fixed order:
`Quantized(QuantizedLinear(linear, recipe), ...)` (or `QuantizedConv(conv, recipe)`
for a convolution). A call sets one of them on the
layers it selects (`where` sees the plain layer inside the wrappers) and keeps the
other, so quantising again replaces and never nests, and the order of two calls
does not matter. (Mixing them by nesting in call order built models that failed
when called: `Quantized` reads its layer's `weight`, `QuantizedLinear` its
`in_features`.)

`quantize` also warns (`NonNegativeSignInputWarning`, in `_sign_warning`) where a
sign input quantiser provably sees only non-negative inputs.

A quantiser with learned parameters (an [`LSQ`][] step, say) joins in through one
method, `initialised_from(array) -> quantiser`: a copy of itself fitted to `array`.
`quantize` calls it on each layer's weight, `calibrate` on each layer's input;
nothing here names a quantiser."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu
from jaxtyping import Array, PRNGKeyArray

from ._axis_names import check_names
from ._inputs import check_key
from ._lowp.layer import (
    LAYERS,
    QuantizedConv,
    QuantizedLinear,
    check_conv_layer,
    check_layer,
)
from ._lowp.recipes import Recipe
from ._recipe_argument import check_recipe, recipe_of
from ._rules.blocks import BlockQuantizer
from ._sign_warning import warn_constant_sign
from ._tangents import call_with_key

_M = TypeVar("_M")

Quantizer = Callable[..., Array]


def _check_quantizer(where: str, name: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"`{where}`: `{name}` (={value!r}) must be callable or None.")


class Quantized(eqx.Module):
    """Wraps an Equinox layer so that it computes with a quantised weight and a
    quantised input, while the float ("latent") weight is what is trained.

    The value is exactly `layer` with its weight replaced by `kernel_quantizer(weight)`,
    applied to `input_quantizer(x)`. Gradients reach the latent weight through the
    quantiser's rule (for [`SteSign`][], `[abs(weight) <= clip_value]` times the
    gradient with respect to the binary weight).

    **Arguments:**

    - `layer`: any Equinox layer with a `weight` array: `eqx.nn.Linear`,
        `eqx.nn.Conv1d`, `Conv2d`, `Conv3d`, ...; or a [`QuantizedLinear`][]:
        the quantisers then act on its float weight and input first, and the
        recipe's products quantise what they give, forward and backward (a
        binarised weight trained with an MXFP8 backward pass, say). This is what
        [`quantize`][] builds when a layer is given both, in either order.
    - `kernel_quantizer`: a callable applied to the weight, e.g. `eqxrules.SteSign()`.
        `None` leaves the weight as it is.
    - `input_quantizer`: a callable applied to the input. `None` leaves it as it is.

    A learned quantiser ([`LSQ`][], [`PACT`][]) keeps its step as an array leaf of
    this Module, so an optimiser trains it with the weight. Built directly, it is
    used as given; [`quantize`][] fits it to the layer's weight, and
    [`calibrate`][] an input quantiser to the layer's input.

    Block quantisers ([`MXQuantize`][], [`NVFP4Quantize`][]) are put along the
    layer's reduction (input) dimension, whatever their own `axis`: the weight's
    input axis (axis 1: `in_features` of a `Linear`, the input channels of a `Conv`)
    and the input's feature (channel) axis, as MX hardware expects. A block that
    does not divide that dimension is a `ValueError` naming the layer (from
    [`quantize`][], by its path in the model: `model.layers[1]`), when the
    `Quantized` is built. (Any quantiser with a method
    `for_reduction_axis(axis, length, where)` returning the quantiser to use is
    treated so.)

    Called with `key=`, as `eqx.nn.Sequential` calls it, the key is split in three:
    for `input_quantizer`, `kernel_quantizer` and `layer`, in that order. Each gets
    its part only if it takes a `key` (so [`StochasticRound`][] can quantise, and a
    layer with dropout gets its key); the others are called without one.

    !!! Example

        ```python
        linear = eqx.nn.Linear(4, 3, key=jax.random.key(0))
        binary = eqxrules.Quantized(
            linear, kernel_quantizer=eqxrules.SteSign(),
            input_quantizer=eqxrules.SteSign(),
        )
        y = binary(jnp.ones(4))
        ```
    """

    layer: Any
    kernel_quantizer: Quantizer | None = eqx.field(default=None, kw_only=True)
    input_quantizer: Quantizer | None = eqx.field(default=None, kw_only=True)

    def __check_init__(self) -> None:
        weight = getattr(_weighted(self.layer), "weight", None)
        if not eqx.is_array(weight):
            raise TypeError(
                f"`Quantized`: `layer` (a {type(self.layer).__name__}) must have a "
                "`weight` array, like `eqx.nn.Linear` or `eqx.nn.Conv2d`."
            )
        if not callable(self.layer):
            raise TypeError(f"`Quantized`: `layer` (={self.layer!r}) must be callable.")
        _check_quantizer("Quantized", "kernel_quantizer", self.kernel_quantizer)
        _check_quantizer("Quantized", "input_quantizer", self.input_quantizer)
        self._along_reduction(self.kernel_quantizer, "weight")
        self._along_reduction(self.input_quantizer, "input")

    def _along_reduction(self, quantizer: Any, role: str) -> Any:
        return _along_reduction(self.layer, quantizer, role, "`Quantized`'s layer")

    @property
    def quantized_layer(self) -> Any:
        """The wrapped layer with its weight replaced by the quantised weight (a
        `kernel_quantizer` that needs a key cannot be applied here: call the layer
        with `key=` instead)."""
        return self._quantized_layer(None)

    def _quantized_layer(self, key: PRNGKeyArray | None) -> Any:
        if self.kernel_quantizer is None:
            return self.layer
        kernel_quantizer = self._along_reduction(self.kernel_quantizer, "weight")
        weight = call_with_key(kernel_quantizer, _weighted(self.layer).weight, key)
        return eqx.tree_at(lambda layer: _weighted(layer).weight, self.layer, weight)

    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        """**Arguments:**

        - `x`: the input, as the wrapped layer takes it.
        - `key`: an optional PRNG key, split between the input quantiser, the kernel
            quantiser and the layer (each gets its part only if it takes a `key`).

        **Returns:**

        The wrapped layer's output on the quantised weight and input.
        """
        if key is None:
            input_key = kernel_key = layer_key = None
        else:
            check_key("Quantized", key)
            input_key, kernel_key, layer_key = jax.random.split(key, 3)
        if self.input_quantizer is not None:
            input_quantizer = self._along_reduction(self.input_quantizer, "input")
            x = call_with_key(input_quantizer, x, input_key)
        return call_with_key(self._quantized_layer(kernel_key), x, layer_key)


def _weighted(layer: Any) -> Any:
    """The layer holding the `weight` of a `Quantized`'s `layer`."""
    if isinstance(layer, QuantizedLinear):
        return layer.linear
    return layer.conv if isinstance(layer, QuantizedConv) else layer


def _plain(node: Any) -> Any:
    """The layer inside any wrapper that `quantize` puts in (`Quantized`,
    `QuantizedLinear`, or both), the node itself if none."""
    if isinstance(node, Quantized):
        node = node.layer
    return _weighted(node)


def _along_reduction(layer: Any, quantizer: Any, role: str, name: str) -> Any:
    """`quantizer`, put along the reduction dimension of `layer` if it asks to be
    (a block quantiser), for the layer's weight or input (`role`); an error names
    the layer as `name`."""
    layer = _weighted(layer)
    axes = _reduction_axes(layer)
    if not isinstance(quantizer, BlockQuantizer) or axes is None:
        return quantizer
    axis, length = axes[role]
    where = (
        f"the {role} of {name}, a {type(layer).__name__} with weight shape "
        f"{tuple(layer.weight.shape)}"
    )
    return quantizer.for_reduction_axis(axis, length, where)


def _reduction_axes(layer: Any) -> dict[str, tuple[int, int]] | None:
    """`{"weight": (axis, length), "input": (axis, length)}` of the reduction
    dimension of a `Linear` or `Conv` (the input's axes counted from the end, so a
    batch axis in front changes nothing); `None` for another layer."""
    if isinstance(layer, eqx.nn.Linear):
        n = layer.weight.shape[1]
        return {"weight": (1, n), "input": (-1, n)}
    if isinstance(layer, eqx.nn.Conv):
        n = layer.weight.shape[1]
        channels = n * layer.groups
        return {"weight": (1, n), "input": (-1 - layer.num_spatial_dims, channels)}
    return None


def _has_weight_layer(node: Any) -> bool:
    return isinstance(node, (eqx.nn.Linear, eqx.nn.Conv))


def quantize(
    model: _M,
    *,
    kernel_quantizer: Quantizer | None = None,
    input_quantizer: Quantizer | None = None,
    recipe: Recipe | Callable[[str], Recipe | None] | None = None,
    where: Callable[[Any], bool] = _has_weight_layer,
    axis_name: Hashable | tuple[Hashable, ...] | None = None,
) -> _M:
    """Quantise every matching layer of `model`, by tree surgery (`eqx.tree_at`):
    with quantisers, each `eqx.nn.Linear` and `eqx.nn.Conv` becomes a
    [`Quantized`][] (a whole `eqx.nn.MLP` or CNN binarised in one call); with a
    `recipe`, each `eqx.nn.Linear` becomes a [`QuantizedLinear`][] and each
    `eqx.nn.Conv` (`Conv1d/2d/3d`) a [`QuantizedConv`][]. A recipe cannot compute
    a transposed convolution (`eqx.nn.ConvTranspose`): it stays in float32, with a
    warning.

    A layer has two independent settings, its quantisers and its recipe, and a call
    sets one of them on the layers it selects, whatever they had:

    - Quantising again replaces, never nests: `quantize(quantize(mlp,
        recipe=recipes.mxfp8()), recipe=recipes.identity())` computes in float32,
        and the quantisers of a `Quantized` are replaced by the new call's (both
        of them: a layer becomes what the call would make of its plain layer).
    - The two compose: quantisers on a layer that has a recipe (or a recipe on a
        layer that has quantisers) give `Quantized(QuantizedLinear(linear,
        recipe), ...)`: the quantisers act on the float weight and input first,
        then the recipe's products quantise what they give, forward and backward.
        Either order gives this one layer.

    **Arguments:**

    - `model`: any pytree of layers, e.g. an `eqx.nn.MLP` or `eqx.nn.Sequential`.
    - `kernel_quantizer`, `input_quantizer`: as for [`Quantized`][]. A learned
        kernel quantiser (one with an `initialised_from` method, as [`LSQ`][] and
        [`PACT`][] have) is fitted to each layer's own weight, so every layer gets
        its own learnable step (per output channel, the weight's axis 0 in
        `Linear` and `Conv1d/2d/3d`, if the quantiser has `axis=0`). A learned input
        quantiser is fitted with [`calibrate`][].
    - `recipe`: instead of the quantisers, an [`eqxrules.recipes.Recipe`][]: each
        matching `eqx.nn.Linear` (those inside `eqx.nn.MLP`,
        `eqx.nn.MultiheadAttention` and the like included) computes its product
        with [`quantized_dot`][], and each `eqx.nn.Conv` with
        [`quantized_conv`][], forward and backward quantised. Or a function of
        each selected layer's path in `model` (`"layers[1]"`, as
        `jax.tree_util.keystr` writes it, without the leading dot) returning
        that layer's recipe, or `None` to leave the layer as it is: a recipe per
        layer. Wrap the model in [`Keyed`][] to give each layer a key at every
        call, as a recipe that draws random numbers needs.
    - `axis_name`: with `recipe`, the `axis_name` of every layer it builds
        ([`QuantizedLinear`][], [`QuantizedConv`][]): `None` (each call its own,
        under `jax.vmap` too, so `vmap(grad(...))` gives per-example gradients),
        or the name (a tuple of names) of the mapped axes whose examples the
        products span, as `eqx.nn.BatchNorm` takes it. A model written per example
        and trained as `jax.vmap(model, axis_name="batch")` with
        `axis_name="batch"` computes each layer as one call on the whole batch
        (batch-wide per-tensor scales and weight-gradient blocks), as hardware
        recipes do.
    - `where`: a predicate choosing the layers, given each plain layer (the
        `eqx.nn.Linear` or `Conv` inside any wrapper a previous call put in, so the
        same predicate selects the same layers every time). Default: every
        `eqx.nn.Linear` and `eqx.nn.Conv` (so `Conv1d`, `Conv2d`, `Conv3d`).

    **Returns:**

    A copy of `model` with each selected layer quantised as above.

    **Raises:**

    `ValueError` if no layer is selected: `model` has no `eqx.nn.Linear` or
    `eqx.nn.Conv`, or none matches the given `where`; or if a recipe's blocks do
    not divide what a selected layer's products reduce (naming the layer's path,
    `model.layers[2]`). `TypeError` if `where` selects a layer that is neither an
    `eqx.nn.Linear` nor an `eqx.nn.Conv`; if `recipe` is neither a recipe nor a
    function of one argument (a recipe class or factory passed uncalled,
    `recipe=recipes.mxfp8`, is named, with the call to make:
    `recipe=recipes.mxfp8()`); or if that function returns anything but a
    recipe or `None`.

    **Warns:**

    `UserWarning` when `recipe` is given without `where` and `model` has
    transposed convolutions (`eqx.nn.ConvTranspose`), which stay in float32; the
    warning names them.

    [`NonNegativeSignInputWarning`][] (a `UserWarning`) when `input_quantizer` is a
    sign whose value is +1 on every non-negative input (a rule that declares
    `constant_on_non_negative = True`: [`SteSign`][], [`ApproxSign`][],
    [`SwishSign`][], [`QuadraticSign`][], or their functional forms) and a layer it
    is put on provably sees only non-negative inputs (so the sign is constant and
    the network trains at chance): a layer after the first of an `eqx.nn.MLP`
    (exactly that class, anywhere in `model`) whose `activation` is `jax.nn.relu`
    (the default), `relu6`, `sigmoid`, `hard_sigmoid`, `softplus`,
    `sparse_plus`, `sparse_sigmoid`, `softmax`, `jnp.abs` or `jnp.exp`. Not
    detected: the first layer (its input is the data: centre pixels in [0, 1]
    yourself), activations in an `eqx.nn.Sequential` or a model of your own, other
    non-negative functions, a sign wrapped in another callable, and
    [`Quantized`][] built directly.

    !!! Example

        ```python
        mlp = eqx.nn.MLP(64, 10, 128, 2, key=jax.random.key(0))
        binary = eqxrules.quantize(mlp, kernel_quantizer=eqxrules.SteSign())
        ```
    """
    _check_quantizer("quantize", "kernel_quantizer", kernel_quantizer)
    _check_quantizer("quantize", "input_quantizer", input_quantizer)
    if recipe is not None and (kernel_quantizer, input_quantizer) != (None, None):
        raise ValueError(
            "`quantize`: give `recipe` or the quantisers (`kernel_quantizer`, "
            "`input_quantizer`), not both in one call. To put quantisers before a "
            "recipe's products on the same layers, quantise twice: "
            "`quantize(quantize(model, recipe=...), kernel_quantizer=...)`."
        )
    check_recipe("quantize", recipe)
    check_names("quantize", axis_name)
    if axis_name is not None and recipe is None:
        raise ValueError(
            f"`quantize`: `axis_name` (={axis_name!r}) is the named axis a recipe's "
            "products span: give it with `recipe=`."
        )
    default = where is _has_weight_layer

    def is_leaf(node: Any) -> bool:
        return isinstance(node, (Quantized, *LAYERS)) or where(node)

    nodes = jtu.tree_flatten_with_path(model, is_leaf=is_leaf)[0]
    # `where` is asked about the model's own nodes (so a predicate may test
    # identity); `eqx.tree_at` then replaces them by their paths.
    targets = [(p, node) for p, node in nodes if where(_plain(node))]
    if not targets:
        raise ValueError(_nothing_selected(model, recipe, default))
    if recipe is None:
        warn_constant_sign(model, input_quantizer, targets)
    elif default:
        _warn_float_convolutions(model)

    def wrap(path: tuple[Any, ...], node: Any) -> Any:
        # Checked here first, so that an error names the layer by its path.
        name = f"the layer at `{_path(path)}`"
        layer = _plain(node)
        if recipe is not None:
            chosen = recipe_of(recipe, jtu.keystr(path).removeprefix("."), name)
            if chosen is None:
                return node
            return _with_recipe(node, layer, chosen, path, name, axis_name)
        if not _has_weight_layer(layer):
            raise TypeError(
                f"`quantize`: `where` selected {name}, a {type(layer).__name__}; "
                "the quantisers wrap `eqx.nn.Linear` and `eqx.nn.Conv` layers only."
            )
        _along_reduction(layer, kernel_quantizer, "weight", name)
        _along_reduction(layer, input_quantizer, "input", name)
        return Quantized(
            node.layer if isinstance(node, Quantized) else node,
            kernel_quantizer=_initialised(kernel_quantizer, layer.weight),
            input_quantizer=input_quantizer,
        )

    return eqx.tree_at(
        lambda m: [_get(m, path) for path, _ in targets],
        model,
        [wrap(path, node) for path, node in targets],
    )


def _path(path: tuple[Any, ...]) -> str:
    return f"model{jtu.keystr(path)}"


def _with_recipe(
    node: Any,
    layer: Any,
    recipe: Recipe,
    path: tuple[Any, ...],
    name: str,
    axis_name: Any,
) -> Any:
    """`node` (a plain layer, or one `quantize` wrapped before) computing `layer`
    with `recipe`, its quantisers (if any) kept."""
    if isinstance(layer, eqx.nn.Linear):
        check_layer(layer, recipe, "quantize", name)
        computed: Any = QuantizedLinear(
            layer, recipe, path=_path(path), axis_name=axis_name
        )
    elif isinstance(layer, eqx.nn.Conv):
        check_conv_layer(layer, recipe, "quantize", name)
        computed = QuantizedConv(layer, recipe, path=_path(path), axis_name=axis_name)
    else:
        raise TypeError(
            f"`quantize`: `recipe` computes `eqx.nn.Linear` and `eqx.nn.Conv` "
            f"layers; {name} is a {type(layer).__name__}: leave it out with "
            "`where=`."
        )
    if not isinstance(node, Quantized):
        return computed
    kernel, inputs = node.kernel_quantizer, node.input_quantizer
    return Quantized(computed, kernel_quantizer=kernel, input_quantizer=inputs)


# What a recipe cannot compute: transposed convolutions.
_CONVOLUTIONS = (eqx.nn.ConvTranspose,)


def _convolutions(model: Any) -> list[str]:
    """The paths of the transposed convolutions of `model`."""
    nodes = jtu.tree_flatten_with_path(
        model, is_leaf=lambda n: isinstance(n, _CONVOLUTIONS)
    )[0]
    return [f"`{_path(p)}`" for p, n in nodes if isinstance(n, _CONVOLUTIONS)]


def _warn_float_convolutions(model: Any) -> None:
    convolutions = _convolutions(model)
    if convolutions:
        warnings.warn(
            "`quantize`: `recipe` computes `eqx.nn.Linear` and `eqx.nn.Conv` "
            "layers, not transposed convolutions, so the `eqx.nn.ConvTranspose` "
            f"layers at {', '.join(convolutions)} stay in float32. Pass `where=` "
            "(selecting the other layers) to say that this is meant and silence "
            "this warning.",
            UserWarning,
            stacklevel=3,
        )


def _nothing_selected(model: Any, recipe: Any, default: bool) -> str:
    """The message of the `ValueError` when no layer of `model` is selected."""
    name = f"`model` (a {type(model).__name__})"
    if not default:
        return f"`quantize`: no layer of {name} matches `where`."
    message = f"`quantize`: {name} has no `eqx.nn.Linear` or `eqx.nn.Conv` layer"
    convolutions = _convolutions(model) if recipe is not None else []
    if convolutions:
        message += (
            f" (its transposed convolutions, {', '.join(convolutions)}, cannot take "
            "a recipe)"
        )
    return message + "."


def _initialised(quantizer: Any, array: Array) -> Any:
    """`quantizer` fitted to `array` if it is learned (has `initialised_from`)."""
    fit = getattr(quantizer, "initialised_from", None)
    return quantizer if fit is None else fit(array)


def _get(tree: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        if isinstance(key, jtu.GetAttrKey):
            tree = getattr(tree, key.name)
        elif isinstance(key, jtu.SequenceKey):
            tree = tree[key.idx]
        elif isinstance(key, jtu.DictKey):
            tree = tree[key.key]
        else:
            raise TypeError(
                f"`quantize`: cannot follow the path {jtu.keystr(path)} into the "
                "model: a pytree node without keyed children is on the way."
            )
    return tree
