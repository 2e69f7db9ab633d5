"""Stochastic rounding of the float quantisers in use (issue 19, section 1): keys
(the same key gives the same draw eagerly, under `jit` and under `vmap`; other keys,
other draws; none, a clear error naming the rule; rounding to nearest accepts and
ignores one), saturation beyond the range and NaN, the derivative (that of rounding
to nearest), the layers (`Quantized`, `quantize`), and the situations of
`tests/test_matrix.py` on the stochastic examples. The proof of unbiasedness is in
`test_stochastic_rounding.py` and `test_stochastic_rounding_rules.py`. Planted
defects beside the checks make them fail.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ENTRIES, examples as catalogue_examples
from matrix import inputs, modes, transforms  # noqa: F401  (register the situations)
from matrix.harness import BF16, F16, SITUATIONS, Case
from test_stochastic_rounding_rules import _fields, _FixedKey

import eqxrules
from eqxrules._rules._formats import FORMATS

F32 = np.float32


# -- saturation, NaN, exact values -------------------------------------------------


@pytest.mark.first_case_quick
@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_beyond_max_saturates_nan_stays_and_values_of_the_format_stay(fmt_name):
    fmt = FORMATS[fmt_name]
    m = np.asarray(fmt.magnitudes(), F32)
    values = np.concatenate([m, -m])
    outside = np.array([np.inf, -np.inf, 2 * fmt.max, -1e30, np.nan], F32)
    x = jnp.asarray(np.concatenate([values, outside]) * F32(4))
    want = np.concatenate([values, [fmt.max, -fmt.max, fmt.max, -fmt.max, np.nan]])
    want = (want * F32(4)).astype(F32)
    rule = eqxrules.FloatQuantize(format=fmt_name, scale=4.0, rounding="stochastic")
    draws = jax.jit(jax.vmap(lambda k: rule(x, key=k)))(
        jax.random.split(jax.random.key(0), 64)
    )
    for q in np.asarray(draws):
        np.testing.assert_array_equal(q, want)


@pytest.mark.slow
def test_block_rules_keep_nan_blocks_and_zeros():
    x = np.asarray(np.random.default_rng(0).standard_normal((2, 32)), F32)
    x[0, 3] = np.nan
    x[1, 16:] = 0.0
    for rule in (
        eqxrules.MXQuantize(block_size=16, rounding="stochastic"),
        eqxrules.NVFP4Quantize(rounding="stochastic"),
    ):
        for k in range(4):
            q = np.asarray(rule(jnp.asarray(x), key=jax.random.key(k)))
            nvfp4 = isinstance(rule, eqxrules.NVFP4Quantize)
            assert np.all(np.isnan(q[0] if nvfp4 else q[0, :16])), rule
            if not nvfp4:
                assert not np.any(np.isnan(q[1])) and np.all(q[1, 16:] == 0)


# -- keys -------------------------------------------------------------------------

SR_RULES = [
    eqxrules.FloatQuantize(format="e2m1", rounding="stochastic"),
    eqxrules.MXQuantize(block_size=8, rounding="stochastic"),
    eqxrules.NVFP4Quantize(rounding="stochastic"),
]
X = jnp.asarray(np.random.default_rng(1).standard_normal((3, 2, 32)), jnp.float32)


@pytest.mark.parametrize("rule", SR_RULES, ids=lambda r: r.rule_name())
def test_a_stochastic_rule_without_a_key_is_a_clear_error(rule):
    name = rule.rule_name()
    for call in (lambda: rule(X), lambda: rule(X, key=None)):
        with pytest.raises(TypeError, match=f"`{name}` needs a PRNG key"):
            call()
    with pytest.raises(TypeError, match=f"`{name}` needs a PRNG key"):
        type(rule).function(X, **_fields(rule))
    assert rule.needs_key() and "key" in rule.call_kwargs(jax.random.key(0))


@pytest.mark.first_case_quick
@pytest.mark.parametrize("rule", SR_RULES, ids=lambda r: r.rule_name())
def test_nearest_accepts_and_ignores_a_key(rule):
    nearest = dataclasses.replace(rule, rounding="nearest")
    assert not nearest.needs_key() and nearest.call_kwargs(jax.random.key(0)) == {}
    plain = nearest(X)
    np.testing.assert_array_equal(nearest(X, key=jax.random.key(1)), plain)
    by_function = type(nearest).function(X, **_fields(nearest), key=jax.random.key(1))
    np.testing.assert_array_equal(by_function, plain)


def check_draws(rule, x):
    """The same key gives the same draw eagerly, under `jit` and under `vmap` with
    split keys; other keys give other draws."""
    k1, k2 = jax.random.key(1), jax.random.key(2)
    eager = rule(x, key=k1)
    np.testing.assert_array_equal(eqx.filter_jit(rule)(x, key=k1), eager)
    assert not np.array_equal(rule(x, key=k2), eager), "the draw ignores the key"
    keys = jax.random.split(k1, x.shape[0])
    mapped = jax.vmap(lambda x, k: rule(x, key=k))(x, keys)
    for i in range(x.shape[0]):
        np.testing.assert_array_equal(mapped[i], rule(x[i], key=keys[i]))
    assert not np.array_equal(mapped[0], mapped[1]), "split keys, same draw"


@pytest.mark.slow
@pytest.mark.first_case_quick
@pytest.mark.parametrize("rule", SR_RULES, ids=lambda r: r.rule_name())
def test_same_key_same_draw_other_key_other_draw(rule):
    check_draws(rule, X)


def test_planted_fixed_key_fails_the_draw_check():
    with pytest.raises(AssertionError, match="ignores the key"):
        check_draws(_FixedKey(format="e2m1", rounding="stochastic"), X)


@pytest.mark.first_case_quick
@pytest.mark.parametrize("rule", SR_RULES, ids=lambda r: r.rule_name())
def test_the_derivative_is_the_straight_through_one_of_nearest(rule):
    nearest = dataclasses.replace(rule, rounding="nearest")
    ct = jnp.cos(jnp.arange(X.size, dtype=jnp.float32)).reshape(X.shape)
    x = X * 5  # some beyond the range, where FloatQuantize's derivative is 0
    _, pull = jax.vjp(lambda x: rule(x, key=jax.random.key(0)), x)
    _, pull_nearest = jax.vjp(nearest, x)
    np.testing.assert_array_equal(pull(ct)[0], pull_nearest(ct)[0])
    _, t = jax.jvp(lambda x: rule(x, key=jax.random.key(0)), (x,), (ct,))
    np.testing.assert_array_equal(t, jax.jvp(nearest, (x,), (ct,))[1])


# -- layers --------------------------------------------------------------------------


def _sr_kernel_and_input():
    return dict(
        kernel_quantizer=eqxrules.FloatQuantize(format="e4m3", rounding="stochastic"),
        input_quantizer=eqxrules.MXQuantize(
            format="e2m1", block_size=4, rounding="stochastic"
        ),
    )


@pytest.mark.slow
def test_quantized_splits_the_key_between_its_stochastic_quantisers():
    linear = eqx.nn.Linear(8, 3, key=jax.random.key(0))
    layer = eqxrules.Quantized(linear, **_sr_kernel_and_input())
    x = jnp.linspace(-1.0, 1.0, 8)
    key = jax.random.key(4)
    k_in, k_kernel, _ = jax.random.split(key, 3)
    xq = layer.input_quantizer(x, key=k_in)
    wq = layer.kernel_quantizer(linear.weight, key=k_kernel)
    np.testing.assert_array_equal(layer(x, key=key), wq @ xq + linear.bias)
    assert not np.array_equal(layer(x, key=jax.random.key(5)), layer(x, key=key))
    with pytest.raises(TypeError, match="needs a PRNG key"):
        layer(x)


@pytest.mark.slow
def test_quantize_with_stochastic_quantisers_needs_a_key():
    k1, k2 = jax.random.split(jax.random.key(0))
    model = eqx.nn.Sequential(
        [
            eqx.nn.Linear(8, 8, key=k1),
            eqx.nn.Lambda(jnp.tanh),
            eqx.nn.Linear(8, 4, key=k2),
        ]
    )
    q = eqxrules.quantize(model, **_sr_kernel_and_input())
    x = jnp.linspace(-1.0, 1.0, 8)
    out, grads = eqx.filter_value_and_grad(
        lambda m: jnp.sum(m(x, key=jax.random.key(1)) ** 2)
    )(q)
    assert np.isfinite(out) and np.any(grads.layers[0].layer.weight != 0)
    with pytest.raises(TypeError, match="needs a PRNG key"):
        q(x)
    # `eqx.nn.MLP` passes no key to its layers: a clear error, never nearest.
    mlp = eqxrules.quantize(eqx.nn.MLP(8, 4, 8, 1, key=k1), **_sr_kernel_and_input())
    with pytest.raises(TypeError, match="needs a PRNG key"):
        mlp(x, key=jax.random.key(1))


# -- the transformation matrix, on the stochastic examples --------------------------
# `tests/test_matrix.py` runs most situations on each entry's first example only
# (rounding to nearest, here): these cells run them on the stochastic examples.


def _stochastic_cells():
    cells = []
    for entry in ENTRIES:
        for index, rule in enumerate(catalogue_examples(entry)):
            if getattr(rule, "rounding", None) != "stochastic":
                continue
            for s in SITUATIONS.values():
                chosen = s.examples(entry)
                if not chosen or index in chosen:  # not applicable, or run already
                    continue
                cells += [
                    pytest.param(
                        entry,
                        index,
                        s.name,
                        dtype,
                        id=f"{entry.name}-{index}-{s.name}-{dtype}",
                        marks=[pytest.mark.slow] if dtype in (BF16, F16) else [],
                    )
                    for dtype in s.dtypes
                ]
    return cells


@pytest.mark.parametrize("entry,index,situation,dtype", _stochastic_cells())
def test_stochastic_examples_through_the_matrix(entry, index, situation, dtype):
    SITUATIONS[situation].run(Case(entry, index), dtype)
