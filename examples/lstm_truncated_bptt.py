"""Truncated back-propagation through time with `eqxrules.detach`.

A one-layer LSTM language model learns to continue the sequence
`[4, 8, 15, 16, 23, 42]`. It is trained in windows of 3 steps: the state `(h, c)` is
carried from one window to the next, so the forward pass sees the whole sequence, but
`detach` cuts the graph between windows, so each window's loss is back-propagated
through that window only (PyTorch's `h.detach()`).

Run it with `python examples/lstm_truncated_bptt.py`.
"""

from __future__ import annotations

import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PRNGKeyArray

import eqxrules

VOCAB = 43
EMBEDDING = 17
HIDDEN = 32
DATA = [4, 8, 15, 16, 23, 42]
WINDOW = 3
LEARNING_RATE = 0.1
EPOCHS = 101
SEED = 0

State = tuple[Array, Array]  # (h, c)


class LanguageModel(eqx.Module):
    embedding: eqx.nn.Embedding
    cell: eqx.nn.LSTMCell
    head: eqx.nn.Linear

    def __init__(self, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embedding = eqx.nn.Embedding(VOCAB, EMBEDDING, key=k1)
        self.cell = eqx.nn.LSTMCell(EMBEDDING, HIDDEN, key=k2)
        self.head = eqx.nn.Linear(HIDDEN, VOCAB, key=k3)

    def initial_state(self) -> State:
        return jnp.zeros(HIDDEN), jnp.zeros(HIDDEN)

    def step(self, token: Array, state: State):
        """One token in: next-token logits and the new state."""
        state = self.cell(self.embedding(token), state)
        return self.head(state[0]), state


def window_loss(model: LanguageModel, state: State, inputs, targets):
    """Mean cross-entropy of next-token prediction over one window, and the state
    at its end."""

    def body(state, token_and_target):
        token, target = token_and_target
        logits, state = model.step(token, state)
        return state, -jax.nn.log_softmax(logits)[target]

    state, losses = jax.lax.scan(body, state, (inputs, targets))
    return jnp.mean(losses), state


def windows() -> list[tuple[Array, Array]]:
    inputs, targets = DATA[:-1], DATA[1:]
    return [
        (jnp.array(inputs[i : i + WINDOW]), jnp.array(targets[i : i + WINDOW]))
        for i in range(0, len(inputs), WINDOW)
    ]


def sgd_update(model: LanguageModel, grads: LanguageModel) -> LanguageModel:
    """Plain SGD, written out on purpose: this is a seed teaching loop, so the
    update is shown and the reader sees exactly what each window's gradient does to
    the weights. Real training uses optax, as the other examples do."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    grads = eqx.filter(grads, eqx.is_inexact_array)
    params = jtu.tree_map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return eqx.combine(params, static)


@eqx.filter_jit
def train_epoch(model: LanguageModel) -> tuple[LanguageModel, Array]:
    """One pass over the sequence, one SGD step per window. The state is carried
    across windows but detached at each window's start, so each window's gradient
    stops there. Returns the new model and the mean loss."""
    state = model.initial_state()
    losses = []
    for inputs, targets in windows():
        state = eqxrules.detach(state)
        (loss, state), grads = eqx.filter_value_and_grad(window_loss, has_aux=True)(
            model, state, inputs, targets
        )
        model = sgd_update(model, grads)
        losses.append(loss)
    return model, jnp.mean(jnp.stack(losses))


@eqx.filter_jit
def greedy_sample(model: LanguageModel, start: int, length: int) -> Array:
    """Feed the model its own most likely next token, starting from `start`."""

    def body(carry, _):
        token, state = carry
        logits, state = model.step(token, state)
        token = jnp.argmax(logits)
        return (token, state), token

    start_token = jnp.asarray(start)
    _, tokens = jax.lax.scan(
        body, (start_token, model.initial_state()), None, length=length - 1
    )
    return jnp.concatenate([start_token[None], tokens])


@eqx.filter_jit
def cross_window_gradients(model: LanguageModel) -> dict[str, Array]:
    """Norm of the gradient of the second window's loss with respect to the
    embeddings of the tokens that only the first window reads, with and without
    `detach` on the state carried between the windows."""
    (in1, tg1), (in2, tg2) = windows()[:2]
    first_only = jnp.array(sorted(set(DATA[:WINDOW]) - set(DATA[WINDOW:-1])))

    def second_window_loss(model, use_detach):
        _, state = window_loss(model, model.initial_state(), in1, tg1)
        if use_detach:
            state = eqxrules.detach(state)
        loss, _ = window_loss(model, state, in2, tg2)
        return loss

    norms = {}
    for name, use_detach in (("detach", True), ("no_detach", False)):
        grads = eqx.filter_grad(second_window_loss)(model, use_detach)
        norms[name] = jnp.linalg.norm(grads.embedding.weight[first_only])
    return norms


def main(quick: bool = False) -> dict:
    """Train and print. `quick` changes nothing: the full run takes a few seconds."""
    del quick
    model = LanguageModel(jax.random.key(SEED))
    before = greedy_sample(model, DATA[0], len(DATA)).tolist()
    print(f"Sample before: {before}")

    losses = {}
    for epoch in range(EPOCHS):
        model, loss = train_epoch(model)
        if epoch in (0, EPOCHS // 2, EPOCHS - 1):
            losses[epoch] = float(loss)
            print(f"Epoch {epoch:3d}: loss {losses[epoch]:.4f}")

    after = greedy_sample(model, DATA[0], len(DATA)).tolist()
    print(f"Sample after: {after}")

    norms = {k: float(v) for k, v in cross_window_gradients(model).items()}
    print(
        "Gradient of window 2's loss reaching window 1's embeddings: "
        f"{norms['detach']:.3g} with detach, {norms['no_detach']:.3g} without"
    )
    return dict(
        sample_before=before,
        losses=losses,
        sample_after=after,
        cross_window_gradient=norms,
    )


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
