"""Linear regression by hand, with a NaN-safe loss via `eqxrules.zero_nonfinite_gradient`.

The model is `w * x + b` with parameters in a plain dict, the loss is the Euclidean
norm of the residuals, `sqrt(sum((w * xs + b - ys) ** 2))`, and training is 15 steps
of SGD written as a `jax.tree_util.tree_map`. The update is written out on purpose:
this is a seed teaching loop, and the reader should see exactly what the gradient
does to `w` and `b`. Real training uses optax, as the other examples do.

The norm has a trap: at an exact fit the residuals are zero, `sqrt` has an infinite
derivative at 0, and the chain rule gives `inf * 0 = NaN` for every parameter. Wrapping
the sum of squares in `zero_nonfinite_gradient` turns that infinite cotangent into 0,
so the gradient at an exact fit is 0, as it should be, and nothing else changes.

Run it with `python examples/linear_regression.py`.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array

import eqxrules

XS = jnp.array([42.0])
YS = jnp.array([500.0])
LEARNING_RATE = 0.002
STEPS = 15


def predict(params: dict[str, Array], x: Array) -> Array:
    return params["w"] * x + params["b"]


def loss_fn(params: dict[str, Array], *, nan_safe: bool = True) -> Array:
    squares = jnp.sum((predict(params, XS) - YS) ** 2)
    if nan_safe:
        squares = eqxrules.zero_nonfinite_gradient(squares)
    return jnp.sqrt(squares)


@jax.jit
def sgd_step(params: dict[str, Array]) -> tuple[dict[str, Array], Array]:
    loss, grads = jax.value_and_grad(loss_fn)(params)
    params = jtu.tree_map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return params, loss


def main(quick: bool = False) -> dict:
    """Train and print. `quick` changes nothing: the full run takes a second."""
    del quick
    params = {"w": jnp.array(13.0), "b": jnp.array(0.0)}
    losses = []
    for step in range(STEPS):
        params, loss = sgd_step(params)
        losses.append(float(loss))
        print(f"Step {step:2d}: loss {losses[-1]:.2f}")
    # The loss falls linearly until the fit overshoots (the norm's gradient has
    # constant size), then bounces around the minimum.
    lowest = losses.index(min(losses))
    decrease = (losses[0] - losses[lowest]) / lowest
    prediction = float(predict(params, jnp.array(42.0)))
    print(f"The loss falls by {decrease:.2f} per step for {lowest} steps")
    print(f"Prediction at x = 42: {prediction:.2f}")

    exact_fit = {"w": jnp.array(0.0), "b": jnp.array(500.0)}
    plain = jax.grad(lambda p: loss_fn(p, nan_safe=False))(exact_fit)
    safe = jax.grad(loss_fn)(exact_fit)
    print(
        "Gradient at an exact fit: "
        f"plain w={float(plain['w'])}, b={float(plain['b'])}; "
        f"with zero_nonfinite_gradient w={float(safe['w'])}, b={float(safe['b'])}"
    )
    return dict(
        losses=losses,
        decrease_per_step=decrease,
        prediction=prediction,
        params={k: float(v) for k, v in params.items()},
        exact_fit_gradient={
            "plain": {k: float(v) for k, v in plain.items()},
            "nan_safe": {k: float(v) for k, v in safe.items()},
        },
    )


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
