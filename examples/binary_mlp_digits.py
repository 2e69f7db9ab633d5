"""A fully binarised MLP on scikit-learn's 8×8 digits.

Every matrix product in the network is between ±1 weights and ±1 inputs: each
linear layer is an `eqxrules.Quantized` with `SteSign` on its weight and its input.
The float ("latent") weights are what Adam trains; `SteSign` passes their gradient
where `|w| <= 1`, inclusive. As in BinaryConnect, latent weights are clipped to
[-1, 1] after each step.

The same network is also trained with the usual hand-rolled `stop_gradient` trick,
`c + stop_gradient(sign(x) - c)` with `c = jnp.clip(x, -1, 1)`, side by side. The
two differ only where a sign's input is exactly ±1: there `jnp.clip` splits the
gradient and the trick passes half of it. Clipped latent weights and normalised
activations can land there, so the example reports how many do at the end. On this
small task, with Adam and a decaying learning rate, few or none do and the two runs
agree closely: what `SteSign` buys here is the specified boundary behaviour (and a
value that never computes the clip) without hand-rolling it.

Run: `python examples/binary_mlp_digits.py [--quick]`. Needs the `examples` extra
(`optax`, `scikit-learn`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, PRNGKeyArray
from sklearn.datasets import load_digits

import eqxrules


def trick_sign(x: Array) -> Array:
    """The hand-rolled straight-through sign that eqxrules replaces."""
    c = jnp.clip(x, -1.0, 1.0)
    return c + jax.lax.stop_gradient(jnp.where(x >= 0, 1.0, -1.0) - c)


class BinaryMLP(eqx.Module):
    """Binary linear layers; between them a LayerNorm (float, as batch norm is in
    binarised networks) sets the scale that the sign's clip window sees."""

    layers: tuple[eqxrules.Quantized, ...]
    norms: tuple[eqx.nn.LayerNorm, ...]
    logit_scale: Array

    def __init__(self, sizes: list[int], sign: Callable[[Array], Array], key):
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = tuple(
            eqxrules.Quantized(
                eqx.nn.Linear(n_in, n_out, use_bias=False, key=k),
                kernel_quantizer=sign,
                input_quantizer=sign,
            )
            for n_in, n_out, k in zip(sizes[:-1], sizes[1:], keys)
        )
        self.norms = tuple(eqx.nn.LayerNorm(n) for n in sizes[1:-1])
        self.logit_scale = jnp.array(1.0 / np.sqrt(sizes[-2]))

    def activations(self, x: Array) -> list[Array]:
        """The hidden activations, before the next layer binarises them."""
        x = 2 * x - 1  # pixels in [0, 1] -> [-1, 1]; the first layer binarises them
        out = []
        for layer, norm in zip(self.layers[:-1], self.norms):
            x = norm(layer(x))
            out.append(x)
        return out

    def __call__(self, x: Array) -> Array:
        return self.logit_scale * self.layers[-1](self.activations(x)[-1])


def clip_latent_weights(model: BinaryMLP) -> BinaryMLP:
    return eqx.tree_at(
        lambda m: [layer.layer.weight for layer in m.layers],
        model,
        replace_fn=lambda w: jnp.clip(w, -1.0, 1.0),
    )


@eqx.filter_jit
def on_boundary(model: BinaryMLP, x: Array) -> dict[str, Any]:
    """The fractions of latent weights and of hidden activations (on `x`) that are
    exactly ±1: where the trick's gradient is halved."""

    def fraction(arrays):
        arrays = list(arrays)
        hits = sum(jnp.sum(jnp.abs(a) == 1) for a in arrays)
        return hits / sum(a.size for a in arrays)

    return dict(
        weights=fraction(layer.layer.weight for layer in model.layers),
        activations=fraction(jax.vmap(model.activations)(x)),
    )


def load(key: PRNGKeyArray):
    data, target = load_digits(return_X_y=True)
    order = jax.random.permutation(key, len(data))
    x = jnp.asarray(data, jnp.float32)[order] / 16.0
    y = jnp.asarray(target, jnp.int32)[order]
    n_train = int(0.75 * len(x))
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def loss_fn(model: BinaryMLP, x: Array, y: Array) -> Array:
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@eqx.filter_jit
def accuracy(model: BinaryMLP, x: Array, y: Array) -> Array:
    return jnp.mean(jnp.argmax(jax.vmap(model)(x), axis=-1) == y)


def make_step(optim: optax.GradientTransformation):
    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optim.update(
            grads, opt_state, eqx.filter(model, eqx.is_array)
        )
        model = clip_latent_weights(eqx.apply_updates(model, updates))
        return model, opt_state, loss

    return step


def main(quick: bool = False) -> dict:
    """Train the eqxrules net and the stop_gradient-trick net side by side.

    **Returns:** a dict with `accuracy` and `trick_accuracy` (test, final),
    `losses` and `trick_losses` (mean training loss per epoch), `on_boundary` (per
    net, the fractions of latent weights and of hidden activations exactly at ±1 at
    the end) and `seconds`.
    """
    start = time.perf_counter()
    epochs, width, batch = (4, 128, 64) if quick else (25, 256, 32)
    key_data, key_model, key_shuffle = jax.random.split(jax.random.key(0), 3)
    (x_train, y_train), (x_test, y_test) = load(key_data)
    sizes = [64, width, width, 10]
    n_batches = len(x_train) // batch
    optim = optax.adam(optax.cosine_decay_schedule(3e-3, epochs * n_batches))
    step = make_step(optim)
    runs = {
        "eqxrules": BinaryMLP(sizes, eqxrules.SteSign(), key_model),
        "trick": BinaryMLP(sizes, trick_sign, key_model),
    }
    states = {k: optim.init(eqx.filter(m, eqx.is_array)) for k, m in runs.items()}
    losses: dict[str, list[float]] = {k: [] for k in runs}
    accs: dict[str, float] = {}
    rng = np.random.default_rng(int(jax.random.randint(key_shuffle, (), 0, 2**16)))
    print(f"binarised MLP {sizes} on digits: {len(x_train)} train, {len(x_test)} test")
    for epoch in range(1, epochs + 1):
        order = rng.permutation(len(x_train))
        totals = dict.fromkeys(runs, 0.0)
        for i in range(n_batches):
            idx = order[i * batch : (i + 1) * batch]
            for k in runs:
                runs[k], states[k], loss = step(
                    runs[k], states[k], x_train[idx], y_train[idx]
                )
                totals[k] += float(loss)
        line = [f"epoch {epoch:2d}/{epochs}"]
        for k in runs:
            losses[k].append(totals[k] / n_batches)
            accs[k] = float(accuracy(runs[k], x_test, y_test))
            line.append(f"{k}: loss {losses[k][-1]:.3f}, test {accs[k]:6.1%}")
        print("  |  ".join(line), flush=True)
    seconds = time.perf_counter() - start
    boundary = {
        k: {what: float(f) for what, f in on_boundary(m, x_test).items()}
        for k, m in runs.items()
    }
    print(
        f"test accuracy: eqxrules SteSign {accs['eqxrules']:.1%}, "
        f"stop_gradient trick {accs['trick']:.1%}"
    )
    for k, b in boundary.items():
        print(
            f"{k}: exactly at ±1, where the trick halves the gradient: "
            f"{b['weights']:.2%} of latent weights, {b['activations']:.2%} of hidden "
            "activations (test set)"
        )
    print(f"wall time {seconds:.1f} s")
    return dict(
        accuracy=accs["eqxrules"],
        trick_accuracy=accs["trick"],
        losses=losses["eqxrules"],
        trick_losses=losses["trick"],
        on_boundary=boundary,
        seconds=seconds,
    )


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
