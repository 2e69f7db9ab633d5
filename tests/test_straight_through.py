"""Per-rule tests of the straight-through estimators: the exact formulas of issue 3
on grids that include every boundary (±clip_value exactly, 0, thresholds), with
hand-written expected values; hypothesis properties; validation; dtypes; and the
finiteness of `gumbel_softmax` at logits of ±1e4. That `stochastic_round` and
`gumbel_softmax` sample without bias is in `test_straight_through_unbiased.py`."""

from __future__ import annotations

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import eqxrules

GRID = np.array(
    [-2.0, -1.5, -1.0, -0.5, -0.05, 0.0, 0.05, 0.5, 1.0, 1.5, 2.0], np.float32
)


def value_and_slopes(f, x):
    """`f(x)`, and the derivative of the elementwise `f` at every point by reverse
    mode and by forward mode."""
    x = jnp.asarray(x)
    value = f(x)
    rev = jax.vmap(jax.grad(f))(x)
    _, fwd = jax.jvp(f, (x,), (jnp.ones_like(x),))
    return np.asarray(value), np.asarray(rev), np.asarray(fwd)


def assert_rule(f, x, value, slope):
    v, rev, fwd = value_and_slopes(f, x)
    np.testing.assert_allclose(v, value, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(rev, slope, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(fwd, slope, rtol=1e-6, atol=1e-7)


#              -2 -1.5  -1 -.5 -.05  0  .05  .5   1  1.5   2
SIGN = [-1, -1, -1, -1, -1, 1, 1, 1, 1, 1, 1]
INSIDE_1 = [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0]


@pytest.mark.parametrize(
    "clip_value,slope",
    [
        (1.0, INSIDE_1),
        (0.5, [0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0]),
        (0.0, [0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0]),
        (None, [1] * 11),
    ],
)
def test_ste_sign_on_boundaries(clip_value, slope):
    assert_rule(
        lambda x: eqxrules.ste_sign(x, clip_value=clip_value), GRID, SIGN, slope
    )


def test_sign_of_zero_and_negative_zero_is_plus_one():
    x = jnp.array([0.0, -0.0])
    for f in (eqxrules.ste_sign, eqxrules.approx_sign, eqxrules.swish_sign):
        np.testing.assert_array_equal(f(x), [1.0, 1.0])


def test_approx_sign_on_boundaries():
    a = np.abs(GRID)
    slope = np.where(a <= 1, 2 - 2 * a, 0)
    assert slope[2] == 0 and slope[5] == 2 and slope[4] == pytest.approx(1.9)
    assert_rule(eqxrules.approx_sign, GRID, SIGN, slope)


def _swish_slope(x, beta):
    x = np.asarray(x, np.float64)
    return beta * (2 - beta * x * np.tanh(beta * x / 2)) / (1 + np.cosh(beta * x))


@pytest.mark.parametrize("beta", [5.0, 1.0])
def test_swish_sign_formula(beta):
    v, rev, fwd = value_and_slopes(lambda x: eqxrules.swish_sign(x, beta=beta), GRID)
    np.testing.assert_array_equal(v, SIGN)
    expected = _swish_slope(GRID, beta)
    assert expected[5] == beta  # the peak, at 0
    np.testing.assert_allclose(rev, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fwd, expected, rtol=1e-5, atol=1e-6)


def test_magnitude_aware_sign_scale_is_per_last_axis_and_not_differentiated():
    w = jnp.array([[0.5, -2.0], [-0.5, 1.0], [0.0, -1.0]])
    # Column means of |w|: 1/3 and 4/3.
    expected = np.array([[1, -4], [-1, 4], [1, -4]]) / 3
    np.testing.assert_allclose(eqxrules.magnitude_aware_sign(w), expected, rtol=1e-6)
    grad = jax.grad(lambda w: eqxrules.magnitude_aware_sign(w).sum())(w)
    # scale * [|w| <= 1]: inclusive at |w| = 1; the scale's own derivative is absent.
    np.testing.assert_allclose(grad, np.array([[1, 0], [1, 4], [1, 4]]) / 3, rtol=1e-6)
    grad = jax.grad(lambda w: eqxrules.magnitude_aware_sign(w, clip_value=0.5).sum())(w)
    np.testing.assert_allclose(grad, np.array([[1, 0], [1, 0], [1, 0]]) / 3, rtol=1e-6)


def test_magnitude_aware_sign_of_a_vector_scales_elementwise():
    x = jnp.array([-2.0, -0.5, 0.0, 1.0])
    np.testing.assert_allclose(eqxrules.magnitude_aware_sign(x), [-2, -0.5, 0, 1])


def test_magnitude_aware_sign_forward_mode_matches_reverse():
    w = jnp.array([[0.5, -2.0], [-1.0, 1.0]])
    t = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    _, jvp = jax.jvp(eqxrules.magnitude_aware_sign, (w,), (t,))
    # Column scales 0.75 and 1.5; the mask drops only |w| = 2.
    np.testing.assert_allclose(jvp, [[0.75, 0.0], [2.25, 6.0]], rtol=1e-6)


@pytest.mark.parametrize(
    "threshold,clip_value,value,slope",
    [
        (0.05, 1.0, [-1, -1, -1, -1, -1, 0, 1, 1, 1, 1, 1], INSIDE_1),
        (
            0.5,
            1.5,
            [-1, -1, -1, -1, 0, 0, 0, 1, 1, 1, 1],
            [0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0],
        ),
    ],
)
def test_ste_ternary_on_thresholds(threshold, clip_value, value, slope):
    def f(x):
        return eqxrules.ste_ternary(x, threshold_value=threshold, clip_value=clip_value)

    assert_rule(f, GRID, value, slope)


@pytest.mark.parametrize(
    "clip_value,slope", [(1.0, INSIDE_1), (0.05, [0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0])]
)
def test_ste_heaviside_on_boundaries(clip_value, slope):
    value = [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]  # 0 at 0
    assert_rule(
        lambda x: eqxrules.ste_heaviside(x, clip_value=clip_value), GRID, value, slope
    )


def test_ste_round_ties_go_to_even_and_slope_is_one():
    x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.4999, 0.5001], np.float32)
    value = [-2, -2, 0, 0, 2, 2, 0, 1]
    assert_rule(eqxrules.ste_round, x, value, np.ones_like(x))


def test_ste_quantize_two_bits_on_boundaries_and_ties():
    x = np.array([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, -2 / 3], np.float32)
    # Levels -1, -1/3, 1/3, 1. At 0 the index is 1.5, a tie: to even, 2, so 1/3.
    value = np.array([-3, -3, -1, 1, 1, 3, 3, -3], np.float32) / 3
    slope = [0, 1, 1, 1, 1, 1, 0, 1]
    assert_rule(lambda x: eqxrules.ste_quantize(x, bits=2), x, value, slope)


@pytest.mark.slow
def test_ste_quantize_defaults_have_256_levels_from_lo_to_hi():
    x = jnp.linspace(-1.5, 1.5, 2001)
    q = np.asarray(eqxrules.ste_quantize(x), np.float64)
    levels = np.unique(q)
    assert len(levels) == 256
    assert levels[0] == -1 and levels[-1] == 1
    np.testing.assert_allclose(np.diff(levels), 2 / 255, rtol=1e-4)


def test_ste_quantize_custom_range():
    x = np.array([-1.0, 0.0, 0.4, 1.0, 2.0, 3.0], np.float32)
    value = [0, 0, 0, 0, 2, 2]  # bits=1: levels 0 and 2; 1.0 is a tie, to even: 0
    slope = [0, 1, 1, 1, 1, 0]
    assert_rule(
        lambda x: eqxrules.ste_quantize(x, bits=1, lo=0.0, hi=2.0), x, value, slope
    )


def test_dorefa_on_boundaries():
    x = np.array([-0.5, 0.0, 0.25, 0.5, 0.75, 1.0, 1.5], np.float32)
    value = np.array([0, 0, 1, 2, 2, 3, 3], np.float32) / 3  # n = 3; 1.5 -> 2
    slope = [0, 1, 1, 1, 1, 1, 0]
    assert_rule(eqxrules.dorefa_quantize, x, value, slope)
    value_1bit = [0, 0, 0, 0, 1, 1, 1]  # n = 1; 0.5 is a tie, to even: 0
    assert_rule(lambda x: eqxrules.dorefa_quantize(x, bits=1), x, value_1bit, slope)


@pytest.mark.slow
def test_stochastic_round_slope_is_one():
    def f(x):
        return eqxrules.stochastic_round(x, jax.random.key(3))

    _, rev, fwd = value_and_slopes(f, GRID)
    np.testing.assert_array_equal(rev, np.ones_like(GRID))
    np.testing.assert_array_equal(fwd, np.ones_like(GRID))


def test_straight_through_value_is_forward_and_slope_is_surrogates():
    def f(x):
        return eqxrules.straight_through(x, forward=jnp.floor, surrogate=jnp.tanh)

    expected_slope = 1 - np.tanh(GRID.astype(np.float64)) ** 2
    v, rev, fwd = value_and_slopes(f, GRID)
    np.testing.assert_array_equal(v, np.floor(GRID))
    np.testing.assert_allclose(rev, expected_slope, rtol=1e-6)
    np.testing.assert_allclose(fwd, expected_slope, rtol=1e-6)


class _Sharpness(eqx.Module):
    a: jax.Array

    def __call__(self, x):
        return jnp.tanh(self.a * x)


def test_straight_through_surrogate_parameters_get_gradients():
    rule = eqxrules.StraightThrough(jnp.sign, _Sharpness(jnp.array(2.0)))
    x = jnp.array([0.1, -0.3, 0.7])
    grads = eqx.filter_grad(lambda m: m(x).sum())(rule)
    expected = np.sum(np.asarray(x) / np.cosh(2 * np.asarray(x)) ** 2)
    np.testing.assert_allclose(grads.surrogate.a, expected, rtol=1e-5)


@pytest.mark.parametrize(
    "forward,surrogate,message",
    [
        (lambda x: x[:2], jnp.tanh, r"`forward` gives float32\[2\] but `surrogate` "),
        (lambda x: x > 0, jnp.tanh, r"`forward` gives bool\[3\] but `surrogate` gives"),
        (jnp.floor, lambda x: {"a": x}, r"`surrogate` gives \{'a': float32\[3\]\}"),
    ],
)
def test_straight_through_mismatch_names_both(forward, surrogate, message):
    with pytest.raises(ValueError, match=message):
        eqxrules.straight_through(jnp.ones(3), forward=forward, surrogate=surrogate)


def _softmax(z, axis):
    e = np.exp(z - z.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@pytest.mark.slow
@pytest.mark.first_case_quick
@pytest.mark.parametrize("axis", [-1, 0])
def test_straight_through_onehot_value_and_softmax_derivative(axis):
    logits = jnp.array([[0.1, 2.0, -1.0], [3.0, 3.0, 0.0]])
    out = np.asarray(eqxrules.straight_through_onehot(logits, axis=axis))
    if axis == -1:  # a tie in the second row: the first maximum wins
        np.testing.assert_array_equal(out, [[0, 1, 0], [1, 0, 0]])
    else:
        np.testing.assert_array_equal(out, [[0, 0, 0], [1, 1, 1]])
    ct = np.array([[1.0, -2.0, 0.5], [0.3, 0.0, 2.0]], np.float32)
    _, pullback = jax.vjp(
        lambda z: eqxrules.straight_through_onehot(z, axis=axis), logits
    )
    s = _softmax(np.asarray(logits, np.float64), axis)
    expected = s * (ct - (s * ct).sum(axis=axis, keepdims=True))
    np.testing.assert_allclose(pullback(jnp.asarray(ct))[0], expected, rtol=1e-5)


@pytest.mark.parametrize("hard", [True, False])
def test_gumbel_softmax_derivative_is_the_soft_samples(hard):
    logits = jnp.array([[0.5, -1.0, 2.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    key, tau = jax.random.key(7), 0.7
    g = np.asarray(jax.random.gumbel(key, logits.shape), np.float64)
    y = _softmax((np.asarray(logits, np.float64) + g) / tau, -1)
    ct = np.arange(8, dtype=np.float32).reshape(2, 4)

    @jax.jit
    def value_and_vjp(z, ct):
        out, pullback = jax.vjp(
            lambda z: eqxrules.gumbel_softmax(z, key, tau=tau, hard=hard), z
        )
        return out, pullback(ct)[0]

    out, grad = value_and_vjp(logits, jnp.asarray(ct))
    if hard:
        np.testing.assert_array_equal(out, np.eye(4)[np.argmax(y, axis=-1)])
    else:
        np.testing.assert_allclose(out, y, rtol=1e-5)
    expected = y * (ct - (y * ct).sum(axis=-1, keepdims=True)) / tau
    np.testing.assert_allclose(grad, expected, rtol=1e-5)


@pytest.mark.first_case_quick
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_gumbel_softmax_is_finite_at_huge_logits(dtype):
    """pytorch#22442: torch's gumbel_softmax returns NaN here."""
    logits = jnp.array([[1e4, -1e4, 0.0], [-1e4, -1e4, -1e4], [1e4, 1e4, -1e4]], dtype)
    ct = jnp.array([[1.0, 2.0, 3.0], [-1.0, 0.5, 2.0], [1.0, -1.0, 0.0]], dtype)

    @jax.jit
    def values_and_grads(z, ct):
        results = {}
        for hard in (True, False):
            for tau in (1.0, 0.1):
                out, pullback = jax.vjp(
                    lambda z: eqxrules.gumbel_softmax(
                        z, jax.random.key(0), tau=tau, hard=hard
                    ),
                    z,
                )
                results[hard, tau] = out, pullback(ct)[0]
        return results

    for (hard, tau), (out, grad) in values_and_grads(logits, ct).items():
        assert out.dtype == grad.dtype == dtype
        out, grad = np.asarray(out, np.float32), np.asarray(grad, np.float32)
        assert np.all(np.isfinite(out)) and np.all(np.isfinite(grad)), (hard, tau)
        np.testing.assert_allclose(out.sum(-1), 1, atol=1e-2)
        # The first row is decided by its logit of 1e4: category 0, surely.
        assert out[0, 0] == pytest.approx(1.0, abs=1e-2)


# Properties ------------------------------------------------------------------------

finite = st.floats(-4.0, 4.0, allow_nan=False, width=32)
clips = st.one_of(st.floats(0.0, 3.0, width=32), st.sampled_from([0.0, 0.5, 1.0]))


@pytest.mark.slow
@given(xs=st.lists(finite, min_size=8, max_size=8), c=clips)
def test_ste_sign_property(xs, c):
    x = np.asarray(xs + [c, -c], np.float32)  # a fixed shape: no recompiles
    v, rev, fwd = value_and_slopes(lambda x: eqxrules.ste_sign(x, clip_value=c), x)
    np.testing.assert_array_equal(v, np.where(x >= 0, 1, -1))
    mask = (np.abs(x) <= np.float32(c)).astype(np.float32)
    np.testing.assert_array_equal(rev, mask)
    np.testing.assert_array_equal(fwd, mask)


@given(xs=st.lists(finite, min_size=8, max_size=8))
def test_approx_sign_property(xs):
    x = np.asarray(xs + [1.0, -1.0, 0.0], np.float32)
    _, rev, _ = value_and_slopes(eqxrules.approx_sign, x)
    a = np.abs(x)
    np.testing.assert_allclose(rev, np.where(a <= 1, 2 - 2 * a, 0), atol=1e-6)


@pytest.mark.slow
@given(
    xs=st.lists(finite, min_size=8, max_size=8),
    bits=st.integers(1, 8),
    lo=st.sampled_from([-1.0, -0.5, 0.0]),
    width=st.sampled_from([0.5, 1.0, 2.0]),
)
def test_ste_quantize_property(xs, bits, lo, width):
    hi = lo + width
    x = np.asarray(xs + [lo, hi], np.float32)
    v, rev, _ = value_and_slopes(
        lambda x: eqxrules.ste_quantize(x, bits=bits, lo=lo, hi=hi), x
    )
    n = 2**bits - 1
    step = width / n
    k = (v.astype(np.float64) - lo) / step
    # On one of the 2**bits levels, and the nearest one to clip(x, lo, hi).
    np.testing.assert_allclose(k, np.round(k), atol=1e-3)
    assert np.all((k > -1e-3) & (k < n + 1e-3))
    assert np.all(np.abs(v - np.clip(x, lo, hi)) <= step / 2 + 1e-5)
    np.testing.assert_array_equal(rev, ((x >= lo) & (x <= hi)).astype(np.float32))


@given(xs=st.lists(finite, min_size=8, max_size=8), bits=st.integers(1, 6))
def test_dorefa_property(xs, bits):
    x = np.asarray(xs + [0.0, 1.0], np.float32)
    v, rev, _ = value_and_slopes(lambda x: eqxrules.dorefa_quantize(x, bits=bits), x)
    n = 2**bits - 1
    assert np.all(np.abs(v - np.clip(x, 0, 1)) <= 0.5 / n + 1e-6)
    np.testing.assert_allclose(v * n, np.round(v * n), atol=1e-4)
    np.testing.assert_array_equal(rev, ((x >= 0) & (x <= 1)).astype(np.float32))


# Validation ------------------------------------------------------------------------

X = jnp.array([0.5, -0.5])
KEY = jax.random.key(0)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
@pytest.mark.parametrize(
    "name,call",
    [
        ("magnitude_aware_sign", eqxrules.magnitude_aware_sign),
        ("straight_through_onehot", eqxrules.straight_through_onehot),
        ("gumbel_softmax", lambda x: eqxrules.gumbel_softmax(x, KEY)),
        ("ste_sign", eqxrules.ste_sign),
        ("stochastic_round", lambda x: eqxrules.stochastic_round(x, KEY)),
    ],
)
def test_integer_input_raises_type_error_naming_the_rule(name, call, dtype):
    with pytest.raises(TypeError, match=f"`{name}` expects a floating-point array"):
        call(jnp.ones((2, 3), dtype))


# Dtypes ----------------------------------------------------------------------------

# The straight-through families, by module: a rule added to one is covered here
# through its first example, with no edit.
FAMILIES = ("sign", "quantize", "straight_through", "categorical")


def _first_example_call(entry):
    rule = entry.examples(KEY)[0]
    return lambda x: rule(x, **rule.call_kwargs(KEY))


# Where a call other than the first example's checks more: a soft sample is
# compared value for value, not one-hot; `round` and `tanh` are dense surrogates.
OTHER_CALLS = {
    "stochastic_round": lambda x: eqxrules.stochastic_round(x, KEY),
    "straight_through": lambda x: eqxrules.straight_through(
        x, forward=jnp.round, surrogate=jnp.tanh
    ),
    "gumbel_softmax": lambda x: eqxrules.gumbel_softmax(x, KEY, hard=False),
}
CALLS = {
    **{
        e.name: _first_example_call(e)
        for e in eqxrules.catalogue()
        if e.module.__module__.rpartition(".")[2] in FAMILIES
    },
    **OTHER_CALLS,
}


def test_the_dtype_table_covers_the_straight_through_families():
    names = {e.name for e in eqxrules.catalogue()}
    assert set(OTHER_CALLS) <= set(CALLS) <= names
    assert {"ste_sign", "ste_quantize", "straight_through", "gumbel_softmax"} <= set(
        CALLS
    )


# Exactly representable in every dtype, boundaries included.
_LOW_X = jnp.array([[-2, -1, -0.5], [-0.25, 0, 0.25], [0.5, 1, 1.5]], jnp.float32)


@ft.cache
def _float32_values_and_grads():
    return jax.jit(_values_and_grads)(_LOW_X)


def _values_and_grads(x):
    def grad(f):
        return jax.grad(lambda x: f(x).astype(jnp.float32).sum())(x)

    return {name: (f(x), grad(f)) for name, f in CALLS.items()}


@pytest.mark.slow
@pytest.mark.first_case_quick
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_stays_low_precision(dtype):
    """bf16 and f16 stay as they are in value and gradient, and the value is the
    float32 value to within the dtype's rounding."""
    # One compiled program per dtype for the whole family keeps this cheap.
    low = jax.jit(_values_and_grads)(_LOW_X.astype(dtype))
    ref = _float32_values_and_grads()
    for name, (out, grad) in low.items():
        assert out.dtype == dtype and grad.dtype == dtype, name
        np.testing.assert_allclose(
            np.asarray(out, np.float32),
            np.asarray(ref[name][0]),
            rtol=2e-2,
            atol=2e-2,
            err_msg=name,
        )
        np.testing.assert_allclose(
            np.asarray(grad, np.float32),
            np.asarray(ref[name][1]),
            rtol=2e-2,
            atol=2e-2,
            err_msg=name,
        )
