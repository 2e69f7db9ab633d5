"""A categorical bottleneck that learns: each 8×8 digit is squeezed through one
choice among 16 codes and rebuilt from that choice alone.

The encoder gives 16 logits; the bottleneck turns them into a one-hot vector; the
decoder is a codebook, one learned 8×8 image per code. The one-hot choice has no
derivative, so the bottleneck is a straight-through estimator, trained two ways:

- `straight_through_onehot`: one-hot of the argmax forward, the softmax's derivative
    backward;
- `gumbel_softmax`: one-hot of a Gumbel-perturbed argmax forward (a sample of the
    categorical distribution), the soft sample's derivative backward.

It measurably learns: the reconstruction loss falls, far below the loss of the best
code-free guess (the mean image), and the codes come to mean digits.

Run: `python examples/straight_through_vq.py [--quick]`. Needs the `examples` extra
(`optax`, `scikit-learn`).
"""

from __future__ import annotations

import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, PRNGKeyArray
from sklearn.datasets import load_digits

import eqxrules

CODES = 16


class CategoricalAutoencoder(eqx.Module):
    encoder: eqx.nn.MLP
    codebook: eqx.nn.Linear
    bottleneck: str = eqx.field(static=True)

    def __init__(self, bottleneck: str, images: Array, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.encoder = eqx.nn.MLP(64, CODES, 64, 1, activation=jax.nn.relu, key=k1)
        # As in k-means, start the codebook from random images, so that every code
        # decodes to something plausible and gets chosen.
        start = jax.random.choice(k2, images, (CODES,), replace=False)
        self.codebook = eqx.nn.Linear(CODES, 64, use_bias=False, key=k2)
        self.codebook = eqx.tree_at(lambda c: c.weight, self.codebook, start.T)
        self.bottleneck = bottleneck

    def encode(self, x: Array, key: PRNGKeyArray | None = None) -> Array:
        logits = self.encoder(x)
        if self.bottleneck == "gumbel_softmax" and key is not None:
            return eqxrules.gumbel_softmax(logits, key, tau=1.0, hard=True)
        # At test time (no key) the Gumbel model also takes the most likely code.
        return eqxrules.straight_through_onehot(logits)

    def __call__(self, x: Array, key: PRNGKeyArray | None = None) -> Array:
        return self.codebook(self.encode(x, key))


def load(key: PRNGKeyArray):
    data, target = load_digits(return_X_y=True)
    order = jax.random.permutation(key, len(data))
    x = jnp.asarray(data, jnp.float32)[order] / 16.0
    y = jnp.asarray(target, jnp.int32)[order]
    n_train = int(0.75 * len(x))
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def loss_fn(model: CategoricalAutoencoder, x: Array, key: PRNGKeyArray | None):
    keys = None if key is None else jax.random.split(key, len(x))
    recon = jax.vmap(model)(x, keys)
    return jnp.mean((recon - x) ** 2)


@eqx.filter_jit
def evaluate(model: CategoricalAutoencoder, x: Array) -> tuple[Array, Array]:
    """Test loss (argmax code, no noise) and each input's code."""
    codes = jnp.argmax(jax.vmap(model.encode)(x), axis=-1)
    return loss_fn(model, x, None), codes


def purity(codes: np.ndarray, labels: np.ndarray) -> float:
    """The fraction of inputs whose code's most common digit is their own."""
    hits = 0
    for c in np.unique(codes):
        hits += np.bincount(labels[codes == c]).max()
    return hits / len(labels)


def train(bottleneck: str, data, epochs: int, key: PRNGKeyArray) -> dict:
    (x_train, _), (x_test, y_test) = data
    k_model, k_train = jax.random.split(key)
    model = CategoricalAutoencoder(bottleneck, x_train, k_model)
    batch = 64
    n_batches = len(x_train) // batch
    optim = optax.adam(optax.cosine_decay_schedule(1e-2, epochs * n_batches))
    opt_state = optim.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, opt_state, x, key):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, key)
        updates, opt_state = optim.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, loss

    start_loss, _ = evaluate(model, x_test)
    losses = []
    rng = np.random.default_rng(0)
    for epoch in range(1, epochs + 1):
        order = rng.permutation(len(x_train))
        total = 0.0
        for i in range(n_batches):
            k_train, k_step = jax.random.split(k_train)
            x = x_train[order[i * batch : (i + 1) * batch]]
            model, opt_state, loss = step(model, opt_state, x, k_step)
            total += float(loss)
        losses.append(total / n_batches)
        test_loss, codes = evaluate(model, x_test)
        print(
            f"{bottleneck:>23}  epoch {epoch:2d}/{epochs}  train loss "
            f"{losses[-1]:.4f}  test loss {float(test_loss):.4f}  codes used "
            f"{len(np.unique(np.asarray(codes)))}/{CODES}",
            flush=True,
        )
    test_loss, codes = evaluate(model, x_test)
    codes = np.asarray(codes)
    return dict(
        start_loss=float(start_loss),
        losses=losses,
        test_loss=float(test_loss),
        codes_used=len(np.unique(codes)),
        purity=purity(codes, np.asarray(y_test)),
    )


def main(quick: bool = False) -> dict:
    """Train the bottleneck both ways.

    **Returns:** a dict with `baseline` (test loss of the mean image) and, per
    bottleneck (`"straight_through_onehot"`, `"gumbel_softmax"`), `start_loss` (test
    loss before training), `losses` (mean training loss per epoch), `test_loss`,
    `codes_used` and `purity` (how often a code's majority digit is the input's);
    and `seconds`.
    """
    start = time.perf_counter()
    epochs = 5 if quick else 30
    k_data, k_onehot, k_gumbel = jax.random.split(jax.random.key(0), 3)
    data = load(k_data)
    (x_train, _), (x_test, _) = data
    baseline = float(jnp.mean((x_test - x_train.mean(axis=0)) ** 2))
    print(f"mean-image baseline test loss {baseline:.4f}")
    results: dict = dict(baseline=baseline)
    for name, key in (
        ("straight_through_onehot", k_onehot),
        ("gumbel_softmax", k_gumbel),
    ):
        results[name] = train(name, data, epochs, key)
    for name in ("straight_through_onehot", "gumbel_softmax"):
        r = results[name]
        print(
            f"{name}: test loss {r['start_loss']:.4f} -> {r['test_loss']:.4f} "
            f"(mean image {baseline:.4f}), {r['codes_used']}/{CODES} codes used, "
            f"purity {r['purity']:.1%}"
        )
    results["seconds"] = time.perf_counter() - start
    print(f"wall time {results['seconds']:.1f} s")
    return results


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
