"""ScaledModel's three modes side by side.

`ScaledModel(mlp, scale, mode=...)` computes `mlp(x / scale)`. The modes differ only
in the derivative:

- "exact": plain autodiff, the chain rule through `x / scale`;
- "skip_scale": the gradient in `x` is taken with respect to the scaled input;
- "stop_input": no gradient in `x`.

In every mode the MLP's weights get their true gradients, which this script checks
against plain autodiff of `mlp(x / scale)`.

Run: python examples/scaled_model.py
"""

from __future__ import annotations

import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqxrules


def main(quick: bool = False) -> dict:
    del quick  # already fast
    mlp = eqx.nn.MLP(3, 1, 4, 1, activation=jnp.tanh, key=jax.random.key(0))
    x = jnp.array([0.5, -1.0, 2.0])
    scale = 4.0

    def loss(model, x):
        return jnp.sum(model(x) ** 2)

    def plain_loss(mlp, x):
        return jnp.sum(mlp(x / scale) ** 2)

    plain_w, plain_x = eqx.filter_grad(lambda mx: plain_loss(*mx))((mlp, x))
    print(f"plain autodiff of mlp(x / {scale}):")
    print(f"  d/dx       = {np.round(plain_x, 5)}")
    print(f"  d/dW[0][0] = {np.round(plain_w.layers[0].weight[0], 5)}")
    figures: dict = {"plain_x": np.asarray(plain_x)}
    for mode in ("exact", "skip_scale", "stop_input"):
        model = eqxrules.ScaledModel(mlp, scale, mode=mode)
        g_model, g_x = eqx.filter_grad(lambda mx: loss(*mx))((model, x))
        w = g_model.sub_model.layers[0].weight
        same = bool(np.allclose(w, plain_w.layers[0].weight, rtol=1e-6))
        print(f"mode={mode!r}:")
        print(f"  d/dx       = {np.round(g_x, 5)}")
        print(f"  d/dW[0][0] = {np.round(w[0], 5)}  (equals plain autodiff: {same})")
        figures[mode] = {"x": np.asarray(g_x), "weights_match_plain": same}
    ratio = figures["skip_scale"]["x"] / plain_x
    print(f"skip_scale / exact gradient in x = {np.round(ratio, 5)} (= scale)")
    return figures


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
