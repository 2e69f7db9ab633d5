"""The warning `quantize` gives where a sign input quantiser provably sees only
non-negative inputs (after an `eqx.nn.MLP`'s ReLU, say): its output is then +1
everywhere. Nothing here names a quantiser: the sign rules are those that declare
`constant_on_non_negative: ClassVar[bool] = True` (their value is +1 on every
non-negative input)."""

from __future__ import annotations

import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from ._catalogue import Rule
from ._registry import catalogue


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


def warn_constant_sign(
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
