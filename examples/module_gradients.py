"""Gradients of a model written as `eqx.Module`s: no manual pytree registration.

A Linear -> sigmoid model, a squared-error loss, `jax.grad` with respect to the
whole model, then jitted SGD steps with optax: the optimiser state and the updates
are pytrees of the same `Module`, filtered to its floating-point arrays.

Run: python examples/module_gradients.py
"""

from __future__ import annotations

import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import optax


class Linear(eqx.Module):
    weight: jax.Array
    bias: jax.Array

    def __call__(self, x):
        return self.weight @ x + self.bias


class Model(eqx.Module):
    linear: Linear

    def __call__(self, x):
        return jax.nn.sigmoid(self.linear(x))


def loss(model: Model, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.sum((model(x) - y) ** 2)


OPTIM = optax.sgd(0.5)


@eqx.filter_jit
def sgd_step(model: Model, state: optax.OptState, x: jax.Array, y: jax.Array):
    grads = eqx.filter_grad(loss)(model, x, y)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, state = OPTIM.update(grads, state, params)
    return eqx.apply_updates(model, updates), state


def main(quick: bool = False) -> dict:
    steps = 5 if quick else 50
    model = Model(Linear(jnp.array([[0.1, -0.2, 0.3]]), jnp.array([0.0])))
    x, y = jnp.array([1.0, 2.0, 3.0]), jnp.array([1.0])
    grads = jax.grad(loss)(model, x, y)
    print("grads.linear.weight =", grads.linear.weight)
    print("grads.linear.bias   =", grads.linear.bias)
    losses = [float(loss(model, x, y))]
    state = OPTIM.init(eqx.filter(model, eqx.is_inexact_array))
    for _ in range(steps):
        model, state = sgd_step(model, state, x, y)
        losses.append(float(loss(model, x, y)))
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {steps} jitted SGD steps")
    return {
        "weight_grad": grads.linear.weight,
        "bias_grad": grads.linear.bias,
        "losses": losses,
    }


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
