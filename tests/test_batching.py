"""vmap means vmap (issue 38 §1, §2): for every quantised function and layer, with
the identity, `fp8()`, `mxfp8()` and `nvfp4()` recipes,

- `jax.vmap(f)(xs)[i]` is `f(xs[i])`, value and gradients (each example's own, its
  own per-tensor scales and weight-gradient blocks), within the float32 bound of
  `batching_cases.py` (the same quantised terms, summed in another order);
- a key mapped with the examples draws for each as its own call with its key does;
- nested `vmap`, and `vmap` of `jit`, likewise;
- with `axis_name` naming the `vmap`, the value and the gradient of the unmapped
  operand are those of one call on the whole batch, bit for bit; a key mapped with
  the examples, a mapped `rhs` of a convolution or ragged product, and an axis
  name bound nowhere are clear errors.

Planted beside them: the behaviour of 0.2 (every `vmap` joined to the rows,
`axis_name` or not), which the first check catches on every function.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from batching_cases import (
    CASES,
    KEY,
    batch,
    bound,
    cotangent,
    value_and_grads,
)

import eqxrules
from eqxrules._lowp import core, dot

B = 3
# (case, recipe): every recipe of every case; the first of each check in the quick
# tier.
RUNS = [(c, r) for c in CASES for r in CASES[c].recipes]


def _reads_key(recipe) -> bool:
    from eqxrules._lowp.recipes import reads_key

    return bool(reads_key(recipe.products()))


def _setup(case_name, recipe_name, axis_name=None):
    case = CASES[case_name]
    recipe = case.recipes[recipe_name]
    key = KEY if _reads_key(recipe) else None
    f = case.call(recipe, key, axis_name)
    w, xs = case.w(), batch(case, B)
    plain = case.call(recipe, key, None)  # its shapes: an axis name needs a vmap
    dys = jax.vmap(lambda i: cotangent(100, jax.eval_shape(plain, w, case.x(0))))(
        jnp.arange(B)
    )
    dys = dys + jnp.arange(B).reshape(B, *(1,) * (dys.ndim - 1))  # each its own
    return case, recipe, key, f, w, xs, dys


def _off(got, want, limit: float) -> list[str]:
    """The leaves of `got` farther from `want` than `limit` (NaN matched by NaN)."""
    out = []
    for i, (g, v) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        g, v = np.asarray(g, np.float64), np.asarray(v, np.float64)
        if g.shape != v.shape:
            out.append(f"leaf {i}: shape {g.shape} against {v.shape}")
            continue
        far = np.abs(g - v) > limit
        far |= np.isnan(g) != np.isnan(v)
        if far.any():
            out.append(
                f"leaf {i}: {int(far.sum())} off by up to {np.nanmax(np.abs(g - v))}"
            )
    return out


def _per_example_failures(case_name, recipe_name) -> list[str]:
    """`vmap` of value-and-gradients against each example's own call."""
    case, _, _, f, w, xs, dys = _setup(case_name, recipe_name)
    run = value_and_grads(f)
    mapped = eqx.filter_jit(jax.vmap(run, in_axes=(None, 0, 0)))(w, xs, dys)
    one = eqx.filter_jit(run)
    failures = []
    for i in range(B):
        x, dy = jax.tree.map(lambda v: v[i], xs), dys[i]
        got = jax.tree.map(lambda v: v[i], mapped)
        failures += [
            f"example {i}: {m}" for m in _off(got, one(w, x, dy), bound(case, w, x, dy))
        ]
    return failures


@pytest.mark.first_case_quick
@pytest.mark.parametrize("case, recipe", RUNS)
def test_vmap_is_each_examples_own_call(case, recipe):
    assert _per_example_failures(case, recipe) == []


@pytest.fixture
def joins_every_vmap(fresh_products):
    """Planted: 0.2's batching, every `vmap` joined to the rows, named or not
    (each call given a name, and every mapped axis taken for it)."""
    patch = fresh_products.setattr
    patch(dot._axis_names, "split", lambda axis_name: (("planted",), ()))
    patch(dot._axis_names, "tags", lambda names: (jnp.zeros((), jnp.int32),))
    patch(core, "_named", lambda names, tags: list(names))
    return fresh_products


@pytest.mark.first_case_quick
@pytest.mark.parametrize("case", list(CASES))
def test_planted_joining_every_vmap_is_caught(joins_every_vmap, case):
    failures = _per_example_failures(case, "identity")
    assert failures != [], case


# Keys mapped with the examples; nested `vmap`, `vmap` of `jit`.


@pytest.mark.first_case_quick
@pytest.mark.parametrize("case", list(CASES))
def test_a_mapped_key_draws_for_each_example_as_its_own_call(case):
    """`nvfp4()` rounds gradients stochastically and rotates the weight-gradient
    product: example i with key i draws as its own call with key i."""
    c, recipe, _, _, w, xs, dys = _setup(case, "nvfp4")
    keys = jax.random.split(KEY, B)

    def run(w, x, dy, key):
        return value_and_grads(c.call(recipe, key, None))(w, x, dy)

    mapped = eqx.filter_jit(jax.vmap(run, in_axes=(None, 0, 0, 0)))(w, xs, dys, keys)
    one = eqx.filter_jit(run)
    for i in range(B):
        x, dy = jax.tree.map(lambda v: v[i], xs), dys[i]
        got = jax.tree.map(lambda v: v[i], mapped)
        assert _off(got, one(w, x, dy, keys[i]), bound(c, w, x, dy)) == [], i
    # And another key draws otherwise: the draws are the key's.
    other = one(w, jax.tree.map(lambda v: v[0], xs), dys[0], keys[1])
    assert _off(jax.tree.map(lambda v: v[0], mapped), other, 0.0) != []


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_nested_vmap_and_vmap_of_jit_are_each_examples_own_call(case):
    c, _, _, f, w, _, _ = _setup(case, "mxfp8")
    xs = jax.tree.map(lambda v: v.reshape(2, 2, *v.shape[1:]), batch(c, 4))
    nested = jax.vmap(jax.vmap(f, in_axes=(None, 0)), in_axes=(None, 0))(w, xs)
    of_jit = jax.vmap(jax.vmap(eqx.filter_jit(f), in_axes=(None, 0)), in_axes=(None, 0))
    for i in range(2):
        for j in range(2):
            x = jax.tree.map(lambda v: v[i, j], xs)
            want = f(w, x)
            limit = bound(c, w, x, want)
            assert _off(nested[i, j], want, limit) == [], (i, j)
            assert _off(of_jit(w, xs)[i, j], want, limit) == [], (i, j)


# Batch-wide by name.


def _named_failures(case_name, recipe_name) -> list[str]:
    """A `vmap` named by `axis_name`: the value and the shared operand's gradient
    against one call on the whole batch, bit for bit."""
    case, recipe, key, f, w, xs, dys = _setup(case_name, recipe_name, "batch")
    whole = case.whole(recipe, key)

    def named(w, xs):
        return jax.vmap(f, in_axes=(None, 0), axis_name="batch")(w, xs)

    got = eqx.filter_jit(value_and_grads(named))(w, xs, dys)
    want = eqx.filter_jit(value_and_grads(whole))(w, xs, dys)
    # The value and the shared operand's gradient (the examples' own cotangents
    # are compared too: the same products' rows).
    return _off(got, want, 0.0)


@pytest.mark.first_case_quick
@pytest.mark.parametrize("case, recipe", RUNS)
def test_a_named_vmap_is_one_call_on_the_batch(case, recipe):
    assert _named_failures(case, recipe) == []


@pytest.mark.slow
def test_a_named_vmap_of_both_operands_is_one_batched_product():
    """Attention's `q` and `k`, both per example, under a named `vmap`: the mapped
    axis is one more batch dimension (never blocked across; a per-tensor scale
    spans it), as one call with a batch dimension."""
    q, k = (jax.random.normal(jax.random.key(s), (3, 16, 2, 32)) for s in (1, 2))
    dy = jax.random.normal(jax.random.key(3), (3, 2, 16, 16))
    for recipe in ("fp8", "mxfp8"):
        r = CASES["quantized_einsum"].recipes[recipe]

        def one(a, b, r=r):
            return eqxrules.quantized_einsum(
                "qhd,khd->hqk", a, b, recipe=r, axis_name="batch"
            )

        named = jax.vjp(jax.vmap(one, axis_name="batch"), q, k)
        whole = jax.vjp(
            lambda a, b, r=r: eqxrules.quantized_einsum(
                "bqhd,bkhd->bhqk", a, b, recipe=r
            ),
            q,
            k,
        )
        got = (named[0], *named[1](dy))
        want = (whole[0], *whole[1](dy))
        assert _off(got, want, 0.0) == [], recipe


# Errors.


@pytest.mark.slow  # the quick tier's 4 minutes
def test_an_unbound_axis_name_is_an_error_naming_it():
    for name, case in CASES.items():
        f = case.call(case.recipes["mxfp8"], None, "nowhere")
        with pytest.raises(ValueError, match=r"`axis_name` names the axis 'nowhere'"):
            f(case.w(), case.x(0))
    with pytest.raises(ValueError, match=r"`quantized_dot`: `axis_name` names"):
        jax.vmap(
            CASES["quantized_dot"].call(
                CASES["quantized_dot"].recipes["fp8"], None, "b"
            ),
            in_axes=(None, 0),
            axis_name="c",
        )(CASES["quantized_dot"].w(), batch(CASES["quantized_dot"], 2))


@pytest.mark.parametrize("case", ["quantized_dot", "quantized_conv"])
def test_a_mapped_key_under_a_named_vmap_is_an_error(case):
    c, recipe, _, _, w, xs, _ = _setup(case, "nvfp4")
    keys = jax.random.split(KEY, B)

    def f(x, key):
        return c.call(recipe, key, "batch")(w, x)

    with pytest.raises(ValueError, match=r"`key` must not be mapped"):
        jax.vmap(f, axis_name="batch")(xs, keys)


@pytest.mark.parametrize("case", ["quantized_conv", "quantized_ragged_dot"])
def test_a_mapped_rhs_under_a_named_vmap_is_an_error(case):
    c, _, _, f, w, xs, _ = _setup(case, "mxfp8", "batch")
    ws = jnp.stack([w] * B)
    with pytest.raises(ValueError, match=r"`rhs` must not be\s+mapped"):
        jax.vmap(f, axis_name="batch")(ws, xs)


# A model with `eqx.nn.BatchNorm` and quantised layers, one name for both.


class _CNN(eqx.Module):
    conv: eqx.Module
    norm: eqx.nn.BatchNorm
    head: eqx.Module

    def __call__(self, x, state, key=None):
        h, state = self.norm(self.conv(x, key=key), state)
        return self.head(jnp.mean(jax.nn.relu(h), axis=(1, 2)), key=key), state


def _bn_cnn(recipe):
    k1, k2 = jax.random.split(jax.random.key(4))
    plain = _CNN(
        eqx.nn.Conv2d(32, 32, 3, padding=1, key=k1),
        eqx.nn.BatchNorm(32, axis_name="batch", mode="batch"),
        eqx.nn.Linear(32, 32, key=k2),
    )
    model = eqxrules.quantize(plain, recipe=recipe, axis_name="batch")
    return eqx.nn.make_with_state(lambda: model)()


def _train(learning_rate: float) -> tuple[list[float], jax.Array]:
    """20 Adam steps of the CNN under one `jax.vmap(..., axis_name="batch")`: the
    losses and the final running mean of the batch norm."""
    import optax

    model, state = _bn_cnn(CASES["quantized_conv"].recipes["mxfp8"])
    index = model.norm.batch_state_index
    xs = jax.random.normal(jax.random.key(5), (32, 32, 4, 4))
    targets = jax.random.normal(jax.random.key(6), (32, 32))

    def loss(model, state):
        out, state = jax.vmap(
            model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(xs, state)
        return jnp.mean((out - targets) ** 2), state

    optim = optax.adam(learning_rate)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state, opt_state):
        grad = eqx.filter_value_and_grad(loss, has_aux=True)
        (value, state), grads = grad(model, state)
        updates, opt_state = optim.update(grads, opt_state)
        return eqx.apply_updates(model, updates), state, opt_state, value

    losses = []
    for _ in range(20):
        model, state, opt_state, value = step(model, state, opt_state)
        losses.append(float(value))
    return losses, state.get(index)[0]


@pytest.mark.slow
def test_batch_norm_and_quantised_layers_train_under_one_named_vmap():
    """`eqx.nn.BatchNorm(axis_name="batch")` and layers quantised with
    `axis_name="batch"` (an `mxfp8()` convolution and linear layer) under one
    `jax.vmap(..., axis_name="batch")`: the loss halves in 20 steps and the
    running statistics move (the layers' own batch-wide products are checked
    above, `test_a_named_vmap_is_one_call_on_the_batch`). Planted beside it: a
    learning rate of 0, which must not pass."""
    losses, mean = _train(1e-2)
    assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0], losses
    assert not np.allclose(mean, 0.0)
    frozen, _ = _train(0.0)
    assert not frozen[-1] < 0.5 * frozen[0], frozen
