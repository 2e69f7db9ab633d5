"""Domain-adversarial training (DANN) with `eqxrules.GradientReversal`.

A digit classifier is trained on labelled images from a *source* domain, scikit-learn's
8×8 digits, and must work on a *target* domain where no label is known: the same
digits photographed under uneven light, each image with a left-to-right brightness
ramp of its own strength (between 1 and 2 times the full pixel range) added. A
network trained on the source alone reads the ramp as strokes and gets most target
images wrong.

Domain-adversarial training (Ganin & Lempitsky, 2015) uses the *unlabelled* target
images. A feature extractor feeds two heads: a label classifier, trained on the
source labels, and a domain classifier, trained to tell source features from target
features. Between the features and the domain classifier sits a `GradientReversal`
layer: the domain classifier still learns to separate the domains, but the feature
extractor receives the *reversed* gradient, so it learns features from which the
domains cannot be told apart (here: features blind to the ramp) while still solving
the task on the source.

For each seed the script trains the same network twice, from the same weights on the
same batches: with the reversal layer, and without it (the domain head then trains
as before, but the features help it instead of fighting it). Target labels are used
only to score the held-out target images. Training is Adam with a cosine-decayed
learning rate, which lets the min-max game between the features and the domain
classifier settle.

Run it with `python examples/domain_adaptation.py` (or `--quick`: 3 seeds, fewer
steps). Needs the `examples` extra (`optax`, `scikit-learn`).
"""

from __future__ import annotations

import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, PRNGKeyArray
from sklearn.datasets import load_digits

import eqxrules

FEATURES = 32
REVERSAL_SCALE = 0.5
LEARNING_RATE = 1e-3
BATCH = 128


def make_data(seed: int) -> dict[str, Array]:
    """The digits shuffled by `seed` and split in two: half the source (labelled),
    half the target, lit unevenly; the target half is split again into the
    unlabelled images training sees and held-out test images (with their labels, for
    scoring only)."""
    images, labels = load_digits(return_X_y=True)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(labels))
    x = (np.asarray(images)[order] / 16.0).astype(np.float32)
    y = np.asarray(labels)[order].astype(np.int32)
    half = len(y) // 2
    target = x[half:]
    ramp = np.tile(np.linspace(0.0, 1.0, 8, dtype=np.float32), 8)  # dark left
    strength = rng.uniform(1.0, 2.0, (len(target), 1)).astype(np.float32)
    target = target + strength * ramp
    quarter = len(target) // 2
    return dict(
        source=jnp.asarray(x[:half]),
        source_labels=jnp.asarray(y[:half]),
        target=jnp.asarray(target[:quarter]),
        target_test=jnp.asarray(target[quarter:]),
        target_test_labels=jnp.asarray(y[half + quarter :]),
    )


class DomainAdversarialNet(eqx.Module):
    extractor: eqx.nn.MLP
    label_head: eqx.nn.Linear
    domain_head: eqx.nn.MLP
    reversal: eqxrules.GradientReversal | None

    def __init__(self, reversal: bool, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        relu = jax.nn.relu
        self.extractor = eqx.nn.MLP(
            64, FEATURES, 64, 1, activation=relu, final_activation=relu, key=k1
        )
        self.label_head = eqx.nn.Linear(FEATURES, 10, key=k2)
        self.domain_head = eqx.nn.MLP(
            FEATURES, "scalar", 64, 2, activation=relu, key=k3
        )
        self.reversal = eqxrules.GradientReversal(REVERSAL_SCALE) if reversal else None

    def __call__(self, x: Array) -> tuple[Array, Array]:
        """Label logits and the domain logit (positive: target)."""
        features = self.extractor(x)
        domain_input = features if self.reversal is None else self.reversal(features)
        return self.label_head(features), self.domain_head(domain_input)


def loss_fn(net: DomainAdversarialNet, source, labels, target) -> Array:
    """Cross-entropy on the source labels plus the domain classifier's logistic
    loss on both domains."""
    label_logits, source_domain = jax.vmap(net)(source)
    _, target_domain = jax.vmap(net)(target)
    task = optax.softmax_cross_entropy_with_integer_labels(label_logits, labels)
    domain = jnp.mean(jax.nn.softplus(source_domain)) + jnp.mean(
        jax.nn.softplus(-target_domain)
    )
    return jnp.mean(task) + domain


@eqx.filter_jit
def train(net: DomainAdversarialNet, data: dict[str, Array], steps: int, key):
    """`steps` Adam steps, each on `BATCH` source and `BATCH` target images."""
    optim = optax.adam(optax.cosine_decay_schedule(LEARNING_RATE, steps))
    params, static = eqx.partition(net, eqx.is_inexact_array)

    def step(carry, key):
        params, state = carry
        k_source, k_target = jax.random.split(key)
        i = jax.random.randint(k_source, (BATCH,), 0, len(data["source"]))
        j = jax.random.randint(k_target, (BATCH,), 0, len(data["target"]))
        batch = data["source"][i], data["source_labels"][i], data["target"][j]
        grads = eqx.filter_grad(loss_fn)(eqx.combine(params, static), *batch)
        updates, state = optim.update(grads, state, params)
        return (eqx.apply_updates(params, updates), state), None

    carry = params, optim.init(params)
    (params, _), _ = jax.lax.scan(step, carry, jax.random.split(key, steps))
    return eqx.combine(params, static)


@eqx.filter_jit
def accuracies(net: DomainAdversarialNet, data: dict[str, Array]) -> dict[str, Array]:
    """Task accuracy on the source and on the held-out target images; the domain
    classifier's accuracy on the images training saw."""
    source_logits, source_domain = jax.vmap(net)(data["source"])
    _, target_domain = jax.vmap(net)(data["target"])
    test_logits, _ = jax.vmap(net)(data["target_test"])
    labels = data["source_labels"], data["target_test_labels"]
    return dict(
        source=jnp.mean(jnp.argmax(source_logits, -1) == labels[0]),
        target=jnp.mean(jnp.argmax(test_logits, -1) == labels[1]),
        domain=jnp.mean(jnp.concatenate([source_domain < 0, target_domain > 0])),
    )


def main(quick: bool = False) -> dict:
    """Train with and without reversal for each seed; print and return the
    accuracies."""
    seeds, steps = (3, 1000) if quick else (5, 2500)
    runs: dict[str, list[dict[str, float]]] = {"reversal": [], "no_reversal": []}
    for seed in range(seeds):
        data = make_data(seed)
        k_net, k_train = jax.random.split(jax.random.key(seed))
        for name in runs:
            net = DomainAdversarialNet(name == "reversal", k_net)
            net = train(net, data, steps, k_train)
            acc = {k: float(v) for k, v in accuracies(net, data).items()}
            runs[name].append(acc)
        print(
            f"seed {seed}: target accuracy {runs['reversal'][-1]['target']:.3f} with "
            f"reversal, {runs['no_reversal'][-1]['target']:.3f} without; source "
            f"{runs['reversal'][-1]['source']:.3f} / "
            f"{runs['no_reversal'][-1]['source']:.3f}; domain classifier "
            f"{runs['reversal'][-1]['domain']:.2f} / "
            f"{runs['no_reversal'][-1]['domain']:.2f} (chance 0.50)"
        )
    mean = {
        name: {k: float(np.mean([r[k] for r in rs])) for k in rs[0]}
        for name, rs in runs.items()
    }
    print(
        f"Target accuracy over {seeds} seeds ({steps} steps): "
        f"{mean['reversal']['target']:.3f} with reversal, "
        f"{mean['no_reversal']['target']:.3f} without (chance 0.10)"
    )
    return dict(seeds=seeds, steps=steps, runs=runs, mean=mean)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
