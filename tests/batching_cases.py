"""The quantised functions and layers as `test_batching.py` maps them: each a
function of a shared operand `w` (a weight, a kernel, a layer) and one example
`x`, with the call on a whole batch that a `vmap` named by its `axis_name` must
equal, and the bound within which two float32 computations of the same
quantised terms agree.

The bound. A batched product and an example's own sum the same quantised terms,
perhaps in another order: by Higham (4.2) they differ by at most
$2\\gamma_n \\sum_k |Q(a)_k Q(b)_k|$, $\\gamma_n = nu/(1 - nu)$, $u = 2^{-24}$,
for $n$ terms. Every quantiser of the recipes keeps each element within twice
its tensor's largest magnitude ($|Q(v)| \\le 2 \\max |v|$: rounding to a format
moves an element by at most half its exponent's step, saturates below the
largest magnitude, and stochastic rounding moves it to a neighbour at most one
step up), so the sum is at most $n \\cdot 2A \\cdot 2B$ with $A$, $B$ the operands'
largest magnitudes. Coarse, and still far below what the batch's scales or
blocks change (a per-example gradient that is the batch's is off by the other
examples' whole contributions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqxrules
from eqxrules import recipes

KEY = jax.random.key(0)
U = 2.0**-24
RECIPES = {
    "identity": recipes.identity(),
    "fp8": recipes.fp8(),
    "mxfp8": recipes.mxfp8(),
    "nvfp4": recipes.nvfp4(),
}
# A convolution takes no Hadamard transform.
CONV_RECIPES = {**RECIPES, "nvfp4": dataclasses.replace(recipes.nvfp4(), hadamard=None)}
DOT = (((0,), (0,)), ((), ()))


class Case(NamedTuple):
    """`call(recipe, key, axis_name)` is `f(w, x)` on one example; `whole(recipe,
    key)` is `g(w, xs)`, one call on the batch; `w()` and `x(seed)` build the
    shared operand and one example; `terms` the length of the longest sum of one
    output element."""

    call: Callable[..., Callable[[Any, Any], Any]]
    whole: Callable[..., Callable[[Any, Any], Any]]
    w: Callable[[], Any]
    x: Callable[[int], Any]
    terms: int
    recipes: dict[str, Any] = RECIPES


def _normal(seed: int, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape)


def _dot(recipe, key, axis_name):
    return lambda w, x: eqxrules.quantized_dot(
        x, w, recipe=recipe, key=key, axis_name=axis_name
    )


def _dot_general(recipe, key, axis_name):
    return lambda w, x: eqxrules.quantized_dot_general(
        x, w, (((1,), (0,)), ((), ())), recipe=recipe, key=key, axis_name=axis_name
    )


def _dot_general_whole(recipe, key):
    return lambda w, xs: eqxrules.quantized_dot_general(
        xs, w, (((2,), (0,)), ((), ())), recipe=recipe, key=key
    )


def _einsum(recipe, key, axis_name):
    return lambda w, x: eqxrules.quantized_einsum(
        "td,dn->nt", x, w, recipe=recipe, key=key, axis_name=axis_name
    )


def _einsum_whole(recipe, key):
    return lambda w, xs: eqxrules.quantized_einsum(
        "btd,dn->bnt", xs, w, recipe=recipe, key=key
    )


def _conv(recipe, key, axis_name):
    return lambda w, x: eqxrules.quantized_conv(
        x[None], w, (1,), "SAME", recipe=recipe, key=key, axis_name=axis_name
    )[0]


def _conv_whole(recipe, key):
    return lambda w, xs: eqxrules.quantized_conv(
        xs, w, (1,), "SAME", recipe=recipe, key=key
    )


def _ragged(recipe, key, axis_name):
    def f(w, x):
        lhs, sizes = x
        return eqxrules.quantized_ragged_dot(
            lhs, w, sizes, recipe=recipe, key=key, axis_name=axis_name
        )

    return f


def ragged_order(rows: int, sizes: jax.Array) -> jax.Array:
    """The rows of a batch of ragged products (`sizes` `[B, g]`), flattened, in the
    order of one ragged product on all of them: group by group, example by
    example within a group, rows past every group last (the statement of
    `quantized_ragged_dot`'s `axis_name`, written out here)."""
    batch = sizes.shape[0]
    r = jnp.arange(rows)
    group = jnp.stack(
        [
            jnp.sum(r[:, None] >= jnp.cumsum(sizes[e])[None, :], axis=1)
            for e in range(batch)
        ]
    )
    rank = (group * batch + jnp.arange(batch)[:, None]) * rows + r[None, :]
    return jnp.argsort(rank.reshape(-1))


def _ragged_whole(recipe, key):
    def g(w, xs):
        lhs, sizes = xs
        order = ragged_order(lhs.shape[1], sizes)
        flat = lhs.reshape(-1, lhs.shape[-1])[order]
        y = eqxrules.quantized_ragged_dot(flat, w, sizes.sum(0), recipe=recipe, key=key)
        out = jnp.zeros_like(y).at[order].set(y)
        return out.reshape(*lhs.shape[:2], -1)

    return g


def _sizes(seed: int) -> jax.Array:
    """Group sizes of 32 rows over 4 groups, one of them empty."""
    cuts = np.sort(np.random.default_rng(seed).integers(0, 33, 2))
    return jnp.asarray([cuts[0], 0, cuts[1] - cuts[0], 32 - cuts[1]], jnp.int32)


def _linear(recipe, key, axis_name):
    def f(w, x):
        layer = eqxrules.QuantizedLinear(w, recipe, axis_name=axis_name)
        return layer(x, key=key)

    return f


def _conv_layer(recipe, key, axis_name):
    def f(w, x):
        return eqxrules.QuantizedConv(w, recipe, axis_name=axis_name)(x, key=key)

    return f


CASES = {
    "quantized_dot": Case(
        _dot,
        lambda r, k: _dot(r, k, None),
        lambda: _normal(1, (64, 32)) / 8,
        lambda s: _normal(s, (64,)),
        64,
    ),
    "quantized_dot_general": Case(
        _dot_general,
        _dot_general_whole,
        lambda: _normal(1, (64, 32)) / 8,
        lambda s: _normal(s, (8, 64)),
        64,
    ),
    "quantized_einsum": Case(
        _einsum,
        _einsum_whole,
        lambda: _normal(1, (64, 32)) / 8,
        lambda s: _normal(s, (8, 64)),
        64,
    ),
    "quantized_conv": Case(
        _conv,
        _conv_whole,
        lambda: _normal(1, (32, 32, 3)) / 16,
        lambda s: _normal(s, (32, 8)),
        32 * 3,
        CONV_RECIPES,
    ),
    "quantized_ragged_dot": Case(
        _ragged,
        _ragged_whole,
        lambda: _normal(1, (4, 32, 16)) / 8,
        lambda s: (_normal(s, (32, 32)), _sizes(s)),
        32,
    ),
    "QuantizedLinear": Case(
        _linear,
        lambda r, k: _linear(r, k, None),
        lambda: eqx.nn.Linear(64, 32, key=jax.random.key(1)),
        lambda s: _normal(s, (64,)),
        64,
    ),
    "QuantizedConv": Case(
        _conv_layer,
        lambda r, k: _conv_layer(r, k, None),
        lambda: eqx.nn.Conv1d(32, 32, 3, padding=1, key=jax.random.key(1)),
        lambda s: _normal(s, (32, 8)),
        32 * 3,
        CONV_RECIPES,
    ),
}


def batch(case: Case, size: int, first: int = 10) -> Any:
    """`size` examples, stacked."""
    return jax.tree.map(
        lambda *v: jnp.stack(v), *[case.x(first + i) for i in range(size)]
    )


def cotangent(seed: int, like: Any) -> jax.Array:
    return _normal(seed, jnp.shape(like))


def bound(case: Case, w: Any, x: Any, dy: Any) -> float:
    """The module docstring's bound for one example's value and cotangents: its
    largest value over the three products (each pair of operands' magnitudes)."""
    floats = [
        np.max(np.abs(np.asarray(v)))
        for v in jax.tree.leaves(eqx.filter((w, x, dy), eqx.is_inexact_array))
    ]
    big = max(floats)
    n = case.terms * max(1, len(floats))
    gamma = n * U / (1 - n * U)
    return float(2 * gamma * n * (2 * big) * (2 * big))


def value_and_grads(f: Callable[[Any, Any], Any]):
    """`(w, x, dy) -> (f(w, x), (grad of <f(w, x), dy> with respect to w's arrays
    and x's floating-point ones))`."""

    def run(w, x, dy):
        def loss(w, x):
            return jnp.vdot(f(w, x), dy)

        return f(w, x), _grads(loss, w, x)

    return run


def _grads(loss, w, x):
    diff_w, static_w = eqx.partition(w, eqx.is_inexact_array)
    diff_x, static_x = eqx.partition(x, eqx.is_inexact_array)

    def of(dw, dx):
        return loss(eqx.combine(dw, static_w), eqx.combine(dx, static_x))

    return jax.grad(of, argnums=(0, 1))(diff_w, diff_x)
