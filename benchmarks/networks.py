"""The data and the networks the rules are measured inside."""

from __future__ import annotations

import functools as ft
import math
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .config import Sizes


@ft.cache
def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits (integer pixels 0..16), or random integer
    images of the same shape if scikit-learn is not installed."""
    try:
        from sklearn.datasets import load_digits

        d = load_digits()
        return d.data.astype(np.float32), d.target.astype(np.int32)
    except ImportError:
        rng = np.random.default_rng(0)
        return (
            rng.integers(0, 17, (1797, 64)).astype(np.float32),
            rng.integers(0, 10, 1797).astype(np.int32),
        )


def digits_batch(batch: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    x, y = digits()
    idx = np.random.default_rng(seed).integers(0, len(x), batch)
    return jnp.asarray(x[idx]), jnp.asarray(y[idx])


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def uniform_weights(dims: Sequence[int], seed: int) -> list:
    # Drawn with NumPy: eager `jax.random` would compile a program per shape.
    rng = np.random.default_rng(seed)
    return [
        jnp.asarray(rng.uniform(-1.0, 1.0, (a, b)).astype(np.float32) / math.sqrt(a))
        for a, b in zip(dims[:-1], dims[1:])
    ]


def mlp_dims(sizes: Sizes, width: int | None = None) -> list[int]:
    """Layer widths of the binarised MLP: 64 pixels in, 10 classes out."""
    return [64] + [width or sizes.width] * sizes.depth + [10]


def mlp_weights(sizes: Sizes, seed: int = 0, width: int | None = None) -> list:
    return uniform_weights(mlp_dims(sizes, width), seed)


def binarised_mlp_loss(act: Callable[[jax.Array], jax.Array]) -> Callable:
    """A fully quantised MLP: `act` (the rule) on every weight and every hidden
    pre-activation, no biases; softmax cross-entropy."""

    def loss(ws, data):
        x, y = data
        h = x
        for w in ws[:-1]:
            h = act(h @ act(w))
        logits = h @ act(ws[-1]) / math.sqrt(ws[-1].shape[0])
        return cross_entropy(logits, y)

    return loss


def twohead_params(sizes: Sizes, seed: int = 0) -> dict[str, Any]:
    w = sizes.width
    dims = dict(trunk1=(64, w), trunk2=(w, w), task=(w, 10), dom1=(w, w), dom2=(w, 2))
    rng = np.random.default_rng(seed)
    return {
        name: jnp.asarray(
            rng.standard_normal(shape).astype(np.float32) / math.sqrt(shape[0])
        )
        for name, shape in dims.items()
    }


def twohead_loss(shape: Callable[[jax.Array], jax.Array]) -> Callable:
    """A domain-adversarial net: a trunk, a task head, and a domain head behind
    `shape` (the rule: gradient reversal, scaling, clipping...)."""

    def loss(p, data):
        x, y, dom = data
        h = jnp.tanh(jnp.tanh((x / 16) @ p["trunk1"]) @ p["trunk2"])
        z = jnp.tanh(shape(h) @ p["dom1"]) @ p["dom2"]
        return cross_entropy(h @ p["task"], y) + cross_entropy(z, dom)

    return loss


def small_cnn(seed: int = 0) -> eqx.nn.Sequential:
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return eqx.nn.Sequential(
        [
            eqx.nn.Conv2d(1, 16, 3, padding=1, key=k1),
            eqx.nn.Conv2d(16, 32, 3, padding=1, key=k2),
            eqx.nn.Lambda(jnp.ravel),
            eqx.nn.Linear(32 * 8 * 8, 10, key=k3),
        ]
    )


def plain_cnn_forward(cnn: Any, q: Callable, images: jax.Array) -> jax.Array:
    """The same CNN written with `lax.conv_general_dilated` on the whole batch and
    the quantiser `q` applied by hand: the hand-written counterpart of
    `quantize(cnn, kernel_quantizer=q, input_quantizer=q)`."""
    conv1, conv2, _, lin = cnn.layers
    # The input quantiser sees one example at a time, as under `jax.vmap(model)`:
    # for a rule that reduces over axes (or draws noise) that is the same maths.
    h = images[:, None]
    for conv in (conv1, conv2):
        h = (
            jax.lax.conv_general_dilated(
                jax.vmap(q)(h), q(conv.weight), (1, 1), ((1, 1), (1, 1))
            )
            + conv.bias[None]
        )
    h = h.reshape(h.shape[0], -1)
    return jax.vmap(q)(h) @ q(lin.weight).T + lin.bias
