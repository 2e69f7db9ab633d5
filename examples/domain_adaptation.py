"""Domain-adversarial training with `eqxrules.GradientReversal`.

Labelled data comes from a *source* domain, unlabelled data from a *target* domain
that is the same problem shifted (a covariate shift). A feature extractor feeds two
heads: a label classifier, trained on the source labels, and a domain classifier,
trained to tell source from target. Between the features and the domain classifier
sits a `GradientReversal` layer (Ganin & Lempitsky, 2015): the domain classifier
still learns to separate the domains, but the feature extractor receives the
*reversed* gradient, so it learns features from which the domains cannot be told
apart, while still solving the task.

Both runs start from the same weights, trained for a while without the reversal
layer, by which time the domain classifier separates the domains almost perfectly.
One run then continues with the reversal layer switched on: the domain classifier's
accuracy falls to chance (0.5) while the task accuracy stays where it was. The
other continues without it, for comparison: there the features keep helping the
domain classifier.

Run it with `python examples/domain_adaptation.py` (or `--quick`).
"""

from __future__ import annotations

import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PRNGKeyArray

import eqxrules

FEATURES = 8
SHIFT = jnp.array([0.0, 3.0])
LEARNING_RATE = 0.2
REVERSAL_SCALE = 1.0
DOMAIN_WEIGHT = 0.5
WEIGHT_DECAY = 0.02
SEED = 0


def make_data(key: PRNGKeyArray, n: int) -> dict[str, Array]:
    """Two classes of 2D points, one blob each, in a source domain and in a target
    domain shifted by `SHIFT` (orthogonal to the direction that separates the
    classes)."""
    k_label, k_noise = jax.random.split(key)
    labels = jax.random.bernoulli(k_label, 0.5, (2, n)).astype(jnp.int32)
    centres = jnp.stack([2.0 * labels - 1.0, jnp.zeros_like(labels, float)], -1)
    points = centres + 0.6 * jax.random.normal(k_noise, (2, n, 2))
    points = points.at[1].add(SHIFT)
    return dict(
        source=points[0],
        source_labels=labels[0],
        target=points[1],
        target_labels=labels[1],
    )


class DomainAdversarialNet(eqx.Module):
    extractor: eqx.nn.MLP
    label_head: eqx.nn.Linear
    domain_head: eqx.nn.MLP
    reversal: eqxrules.GradientReversal | None

    def __init__(self, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.extractor = eqx.nn.MLP(2, FEATURES, 16, 1, activation=jnp.tanh, key=k1)
        self.label_head = eqx.nn.Linear(FEATURES, 2, key=k2)
        self.domain_head = eqx.nn.MLP(
            FEATURES, "scalar", 16, 1, activation=jnp.tanh, key=k3
        )
        self.reversal = None

    def __call__(self, x: Array) -> tuple[Array, Array]:
        """Label logits and the domain logit (positive: target)."""
        features = jnp.tanh(self.extractor(x))
        domain_input = features if self.reversal is None else self.reversal(features)
        return self.label_head(features), self.domain_head(domain_input)


def loss_fn(net: DomainAdversarialNet, data: dict[str, Array]) -> Array:
    label_logits, source_domain = jax.vmap(net)(data["source"])
    _, target_domain = jax.vmap(net)(data["target"])
    log_probs = jax.nn.log_softmax(label_logits)
    task = -jnp.mean(jnp.take_along_axis(log_probs, data["source_labels"][:, None], 1))
    domain = jnp.mean(jax.nn.softplus(source_domain)) + jnp.mean(
        jax.nn.softplus(-target_domain)
    )
    return task + DOMAIN_WEIGHT * domain


@eqx.filter_jit
def train(net: DomainAdversarialNet, data: dict[str, Array], steps: int):
    """`steps` steps of full-batch gradient descent with weight decay, as a
    `tree_map` update.

    Plain simultaneous gradient descent on a min-max game circles around its
    equilibrium (the domain classifier and the features chase each other); weight
    decay damps that, so the domain accuracy settles at chance instead of swinging
    around it.
    """
    params, static = eqx.partition(net, eqx.is_array)

    def update(p, g):
        return p - LEARNING_RATE * (g + WEIGHT_DECAY * p)

    def step(params, _):
        grads = eqx.filter_grad(loss_fn)(eqx.combine(params, static), data)
        grads = eqx.filter(grads, eqx.is_array)
        return jtu.tree_map(update, params, grads), None

    params, _ = jax.lax.scan(step, params, None, length=steps)
    return eqx.combine(params, static)


@eqx.filter_jit
def accuracies(net: DomainAdversarialNet, data: dict[str, Array]) -> dict[str, Array]:
    source_logits, source_domain = jax.vmap(net)(data["source"])
    target_logits, target_domain = jax.vmap(net)(data["target"])
    domain_correct = jnp.concatenate([source_domain < 0, target_domain > 0])
    return dict(
        source_task=jnp.mean(jnp.argmax(source_logits, -1) == data["source_labels"]),
        target_task=jnp.mean(jnp.argmax(target_logits, -1) == data["target_labels"]),
        domain=jnp.mean(domain_correct),
    )


def with_reversal(net: DomainAdversarialNet) -> DomainAdversarialNet:
    """The same net, weights and all, with the reversal layer switched on."""
    return eqx.tree_at(
        lambda n: n.reversal,
        net,
        eqxrules.GradientReversal(REVERSAL_SCALE),
        is_leaf=lambda x: x is None,
    )


def _report(label: str, step: int, acc: dict[str, float]) -> None:
    print(
        f"{label:>11}, step {step:4d}: domain classifier {acc['domain']:.2f}, "
        f"task (source) {acc['source_task']:.2f}, task (target) "
        f"{acc['target_task']:.2f}"
    )


def main(quick: bool = False) -> dict:
    """Warm up without reversal, then train on with and without it, printing the
    accuracies as training goes on."""
    total = 600 if quick else 1500
    chunk, warmup = 50, 100
    shown = {150, 250, 400, 600, 1000, total}
    data = make_data(jax.random.key(SEED), 500)

    # Both runs start from the same weights: the net trained for `warmup` steps
    # without reversal, by which time the domain classifier separates the domains.
    net = DomainAdversarialNet(jax.random.key(SEED + 1))
    for _ in range(warmup // chunk):
        net = train(net, data, chunk)
    start = {k: float(v) for k, v in accuracies(net, data).items()}
    _report("both", warmup, start)

    history = {}
    for name, run in (("reversal", with_reversal(net)), ("no_reversal", net)):
        history[name] = [dict(step=warmup, **start)]
        for done in range(warmup + chunk, total + 1, chunk):
            run = train(run, data, chunk)
            acc = {k: float(v) for k, v in accuracies(run, data).items()}
            history[name].append(dict(step=done, **acc))
            if done in shown:
                _report(name, done, acc)
    final = {name: h[-1] for name, h in history.items()}
    print(
        f"Domain classifier accuracy (chance is 0.50): "
        f"{final['reversal']['domain']:.2f} with reversal, "
        f"{final['no_reversal']['domain']:.2f} without"
    )
    print(
        f"Task accuracy on the source: {final['reversal']['source_task']:.2f} with "
        f"reversal, {final['no_reversal']['source_task']:.2f} without"
    )
    return dict(warmup=start, history=history, final=final)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
