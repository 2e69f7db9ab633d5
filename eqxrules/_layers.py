"""Layers built from rules: `Quantized` wraps a layer with a `weight`, and `quantize`
wraps every such layer of a model (`calibrate`, in `_calibrate`, initialises learned
input quantisers from data).

`quantize` also warns (`NonNegativeSignInputWarning`) where a sign input
quantiser provably sees only non-negative inputs (after an `eqx.nn.MLP`'s ReLU, say):
its output is then +1 everywhere.

A quantiser with learned parameters (an [`LSQ`][] step, say) joins in through one
method, `initialised_from(array) -> quantiser`: a copy of itself fitted to `array`.
`quantize` calls it on each layer's weight, `calibrate` on each layer's input;
nothing here names a quantiser: the warning's sign rules are those that declare
`constant_on_non_negative: ClassVar[bool] = True` (their value is +1 on every
non-negative input)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PRNGKeyArray

from ._catalogue import Rule
from ._inputs import check_key
from ._lowp.layer import quantize_with_recipe
from ._lowp.recipes import Recipe
from ._registry import catalogue
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
        `eqx.nn.Conv1d`, `Conv2d`, `Conv3d`, ...
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
        weight = getattr(self.layer, "weight", None)
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
        weight = call_with_key(kernel_quantizer, self.layer.weight, key)
        return eqx.tree_at(lambda layer: layer.weight, self.layer, weight)

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


def _along_reduction(layer: Any, quantizer: Any, role: str, name: str) -> Any:
    """`quantizer`, put along the reduction dimension of `layer` if it asks to be
    (a block quantiser), for the layer's weight or input (`role`); an error names
    the layer as `name`."""
    fit = getattr(quantizer, "for_reduction_axis", None)
    axes = _reduction_axes(layer)
    if fit is None or axes is None:
        return quantizer
    axis, length = axes[role]
    where = (
        f"the {role} of {name}, a {type(layer).__name__} with weight shape "
        f"{tuple(layer.weight.shape)}"
    )
    return fit(axis, length, where)


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


class NonNegativeSignInputWarning(UserWarning):
    """Warned by [`quantize`][] when a sign input quantiser is put on a layer whose
    input is provably never negative: the sign is then +1 everywhere (`sign(0) = +1`),
    so the layer sees the same input whatever the data, and the network trains at
    chance. What is detected is listed under [`quantize`][]."""


# Activations whose value is never negative (NaN aside), named as a user writes them.
_NON_NEGATIVE = (
    (jax.nn.relu, "jax.nn.relu"),
    (jax.nn.relu6, "jax.nn.relu6"),
    (jax.nn.sigmoid, "jax.nn.sigmoid"),
    (jax.nn.hard_sigmoid, "jax.nn.hard_sigmoid"),
    (jax.nn.softplus, "jax.nn.softplus"),
    (jax.nn.sparse_plus, "jax.nn.sparse_plus"),
    (jax.nn.sparse_sigmoid, "jax.nn.sparse_sigmoid"),
    (jax.nn.softmax, "jax.nn.softmax"),
    (jnp.abs, "jnp.abs"),
    (jnp.exp, "jnp.exp"),
)


def _is_sign(quantizer: Any) -> bool:
    """Whether `quantizer` (a rule, or a rule's functional form) declares that its
    value is +1 on every non-negative input (sign(0) = +1)."""
    if isinstance(quantizer, Rule):
        rule: Any = type(quantizer)
    else:
        rule = next((e.module for e in catalogue() if e.function is quantizer), None)
    return bool(getattr(rule, "constant_on_non_negative", False))


def _non_negative_name(activation: Any) -> str | None:
    return next((name for f, name in _NON_NEGATIVE if activation is f), None)


def _warn_constant_sign(
    model: Any, input_quantizer: Any, targets: list[tuple[Any, Any]]
) -> None:
    """Warn, once per `eqx.nn.MLP` of `model`, if `input_quantizer` is a sign and
    the MLP's activation is never negative, naming the layers of `targets` (the
    `(path, layer)` pairs about to be wrapped) that come after that activation."""
    if not _is_sign(input_quantizer):
        return
    wrapped = {id(layer): path for path, layer in targets}

    def is_mlp(node: Any) -> bool:
        # Exactly `eqx.nn.MLP`: a subclass may call its layers otherwise.
        return type(node) is eqx.nn.MLP

    for path, mlp in jtu.tree_flatten_with_path(model, is_leaf=is_mlp)[0]:
        if not is_mlp(mlp):
            continue
        activation = _non_negative_name(mlp.activation)
        # Every layer but the first takes the activation's output.
        after = [wrapped[id(layer)] for layer in mlp.layers[1:] if id(layer) in wrapped]
        if activation is None or not after:
            continue
        where = f"the `eqx.nn.MLP` at `model{jtu.keystr(path)}`" if path else "`model`"
        layers = ", ".join(f"`model{jtu.keystr(p)}`" for p in after)
        warnings.warn(
            f"`quantize`: the input quantiser {input_quantizer!r} of {layers} sees "
            f"the output of the activation `{activation}` of {where}, which is never "
            "negative, so its sign is +1 everywhere and these layers see a constant "
            "input: the network cannot learn. Put an activation with both signs "
            "before the sign (`jax.nn.hard_tanh`, or the identity, scaled into the "
            "quantiser's clip window), or leave these layers' inputs unquantised "
            "with `where=`.",
            NonNegativeSignInputWarning,
            stacklevel=3,
        )


def quantize(
    model: _M,
    *,
    kernel_quantizer: Quantizer | None = None,
    input_quantizer: Quantizer | None = None,
    recipe: Recipe | None = None,
    where: Callable[[Any], bool] = _has_weight_layer,
) -> _M:
    """Wrap every matching layer of `model` in [`Quantized`][], by tree surgery
    (`eqx.tree_at`): a whole `eqx.nn.MLP` or CNN becomes binarised in one call.

    Layers already inside a `Quantized` are left alone, so quantising twice does not
    wrap twice.

    **Arguments:**

    - `model`: any pytree of layers, e.g. an `eqx.nn.MLP` or `eqx.nn.Sequential`.
    - `kernel_quantizer`, `input_quantizer`: as for [`Quantized`][]. A learned
        kernel quantiser (one with an `initialised_from` method, as [`LSQ`][] and
        [`PACT`][] have) is fitted to each layer's own weight, so every layer gets
        its own learnable step (per output channel, the weight's axis 0 in
        `Linear` and `Conv1d/2d/3d`, if the quantiser has `axis=0`). A learned input
        quantiser is fitted with [`calibrate`][].
    - `recipe`: instead of the quantisers, an [`eqxrules.recipes.Recipe`][]: each
        matching `eqx.nn.Linear` (by default every one) computes its product with
        [`quantized_dot`][], forward and backward quantised: it becomes a
        [`QuantizedLinear`][]. Wrap the model in [`Keyed`][] to give each layer a
        key at every call, as a recipe that draws random numbers needs.
    - `where`: a predicate choosing the layers to wrap. Default: every
        `eqx.nn.Linear` and `eqx.nn.Conv` (so `Conv1d`, `Conv2d`, `Conv3d`); with
        `recipe`, every `eqx.nn.Linear`.

    **Returns:**

    A copy of `model` with each matching layer `layer` replaced by
    `Quantized(layer, kernel_quantizer=..., input_quantizer=...)`, or with `recipe`
    by `QuantizedLinear(layer, recipe)`.

    **Raises:**

    `ValueError` if no layer matches `where`.

    **Warns:**

    [`NonNegativeSignInputWarning`][] (a `UserWarning`) when `input_quantizer` is a
    sign whose value is +1 on every non-negative input (a rule that declares
    `constant_on_non_negative = True`: [`SteSign`][], [`ApproxSign`][],
    [`SwishSign`][], [`QuadraticSign`][], or their functional forms) and a layer it is put on provably sees only non-negative inputs (so the
    sign is constant and the network trains at chance): a layer after the first of an
    `eqx.nn.MLP` (exactly that class, anywhere in `model`) whose `activation` is
    `jax.nn.relu` (the default), `relu6`, `sigmoid`, `hard_sigmoid`, `softplus`,
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
    if recipe is not None:
        default = where is _has_weight_layer
        quantizers = (kernel_quantizer, input_quantizer)
        return quantize_with_recipe(
            model, recipe, None if default else where, quantizers
        )

    def is_leaf(node: Any) -> bool:
        return isinstance(node, Quantized) or where(node)

    nodes = jtu.tree_flatten_with_path(model, is_leaf=is_leaf)[0]
    if not any(where(node) or isinstance(node, Quantized) for _, node in nodes):
        raise ValueError(
            f"`quantize`: no layer of `model` (a {type(model).__name__}) matches "
            "`where`."
        )
    # `where` is asked about the model's own nodes (so a predicate may test
    # identity); `eqx.tree_at` then replaces them by their paths.
    targets = [
        (p, node)
        for p, node in nodes
        if not isinstance(node, Quantized) and where(node)
    ]
    if not targets:
        return model
    _warn_constant_sign(model, input_quantizer, targets)

    def wrap(path: tuple[Any, ...], layer: Any) -> Quantized:
        # Checked here first, so that an error names the layer by its path.
        name = f"the layer at `model{jtu.keystr(path)}`" if path else "`model`"
        _along_reduction(layer, kernel_quantizer, "weight", name)
        _along_reduction(layer, input_quantizer, "input", name)
        return Quantized(
            layer,
            kernel_quantizer=_initialised(kernel_quantizer, layer.weight),
            input_quantizer=input_quantizer,
        )

    return eqx.tree_at(
        lambda m: [_get(m, path) for path, _ in targets],
        model,
        [wrap(path, layer) for path, layer in targets],
    )


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
