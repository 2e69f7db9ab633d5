"""Learned quantisers (LSQ, LSQ+, PACT) in quantisation-aware training: the step is a
parameter, so it is differentiated with the weights.

Besides the generic baselines, each is measured against the `stop_gradient`
formulation users write today, as in the LSQ paper's code: the detach trick with a
gradient-scaled step,

```python
s_grad = s * g + stop_gradient(s - s * g)
round_pass = lambda u: u + stop_gradient(round(u) - u)
q = round_pass(clip(x / s_grad, -Q_n, Q_p)) * s_grad
```

and for PACT `y = clip(x, 0, alpha)`, `y + stop_gradient(quantised(y) - y)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import eqxrules
from eqxrules._hyper import parameters

from . import networks as nets
from .config import Sizes

sg = jax.lax.stop_gradient


def is_learned(rule: Any) -> bool:
    """Whether `rule` has learnable parameters (a step) that training updates."""
    return bool(parameters(type(rule)))


def _round_pass(u: jax.Array) -> jax.Array:
    return u + sg(jnp.round(u) - u)


def _grad_scale(s: jax.Array, g: float) -> jax.Array:
    return s * g + sg(s - s * g)


def lsq_trick(rule: Any) -> Callable:
    """`fn(dyn, x)`: LSQ (LSQ+ with an offset) as the paper's code writes it."""
    qn, qp = rule._levels()
    _, static = eqx.partition(rule, eqx.is_inexact_array)

    def fn(dyn: Any, x: jax.Array) -> jax.Array:
        r = eqx.combine(dyn, static)
        n = max(x.size // max(jnp.size(r.step), 1), 1)
        g = r.grad_scale if r.grad_scale is not None else 1 / math.sqrt(n * qp)
        s = _grad_scale(r.step, g)
        b = 0.0 if r.offset is None else r.offset
        return _round_pass(jnp.clip((x - b) / s, -qn, qp)) * s + b

    return fn


def pact_trick(rule: Any) -> Callable:
    """`fn(dyn, x)`: PACT with `jnp.clip` and the straight-through estimator."""
    n = 2**rule.bits - 1

    def fn(dyn: Any, x: jax.Array) -> jax.Array:
        alpha = dyn.alpha
        y = jnp.clip(x, 0, alpha)
        q = jnp.round(y * (n / alpha)) * (alpha / n)
        return y + sg(q - y)

    return fn


USER_TRICKS: dict[type, Callable[[Any], Callable]] = {
    eqxrules.LSQ: lsq_trick,
    eqxrules.PACT: pact_trick,
}


def qat_mlp_loss(quant: Callable[[Any, jax.Array], jax.Array]) -> Callable:
    """The quantised MLP with every weight and every layer's input quantised, each
    by its own quantiser `quant(dyn_i, ·)` whose parameters `dyn_i` are trained
    with the weights."""

    def loss(params, data):
        ws, w_dyn, a_dyn = params
        x, y = data
        h = x / 16
        for i, w in enumerate(ws):
            h = quant(a_dyn[i], h) @ quant(w_dyn[i], w)
            if i < len(ws) - 1:
                h = jax.nn.relu(h)
        return nets.cross_entropy(h, y)

    return loss


def qat_case_parts(
    rule: Any, variants: dict[str, Callable], sizes: Sizes
) -> tuple[str, dict[str, Callable], Any, Any, int]:
    """Scenario, losses, params, data and activation elements of `rule` in the QAT
    MLP."""
    x, y = nets.digits_batch(sizes.batch)
    dims = nets.mlp_dims(sizes)
    ws = nets.mlp_weights(sizes)

    # Each weight and each layer's input its own quantiser, fitted to it (so a
    # per-channel example gets one step per output column, or per input feature).
    def fitted(a: jax.Array) -> Any:
        return eqx.filter(rule.initialised_from(a), eqx.is_inexact_array)

    w_dyn = [fitted(w) for w in ws]
    a_dyn = [fitted(jnp.full((2, d), 0.5)) for d in dims[:-1]]
    params = (ws, w_dyn, a_dyn)
    n_act = sizes.batch * sum(dims[:-1]) + sum(
        a * b for a, b in zip(dims[:-1], dims[1:])
    )
    scenario = (
        f"QAT MLP {sizes.depth}x{sizes.width}, batch {sizes.batch}: weights, inputs "
        "and their steps trained"
    )
    losses = {v: qat_mlp_loss(fn) for v, fn in variants.items()}
    return scenario, losses, params, (x, y), n_act
