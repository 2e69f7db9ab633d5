"""Gradients of a model written as `eqx.Module`s: no manual pytree registration.

A Linear -> sigmoid model, a squared-error loss, `jax.grad` with respect to the
whole model, then a jitted `jax.tree_util.tree_map` SGD step.

Run: python examples/module_gradients.py
"""

from __future__ import annotations

import sys

import equinox as eqx
import jax
import jax.numpy as jnp


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


@jax.jit
def sgd_step(model: Model, x: jax.Array, y: jax.Array, lr: float = 0.5) -> Model:
    grads = jax.grad(loss)(model, x, y)
    return jax.tree_util.tree_map(lambda p, g: p - lr * g, model, grads)


def main(quick: bool = False) -> dict:
    steps = 5 if quick else 50
    model = Model(Linear(jnp.array([[0.1, -0.2, 0.3]]), jnp.array([0.0])))
    x, y = jnp.array([1.0, 2.0, 3.0]), jnp.array([1.0])
    grads = jax.grad(loss)(model, x, y)
    print("grads.linear.weight =", grads.linear.weight)
    print("grads.linear.bias   =", grads.linear.bias)
    losses = [float(loss(model, x, y))]
    for _ in range(steps):
        model = sgd_step(model, x, y)
        losses.append(float(loss(model, x, y)))
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {steps} jitted SGD steps")
    return {
        "weight_grad": grads.linear.weight,
        "bias_grad": grads.linear.bias,
        "losses": losses,
    }


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
