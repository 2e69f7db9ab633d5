"""Learned quantisers (issue 11): LSQ, LSQ+ and PACT by hand-computed values, their
step derivatives, dtypes, errors, and in layers (`quantize`, `calibrate`, training
the steps with a plain SGD step). The catalogue-wide suites check them against their
references; here are the figures a reader can verify on paper, and planted defects
that `check_rule` must catch."""

from __future__ import annotations

import inspect
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxrules
from eqxrules.testing import RuleCheckError, check_rule


def _grads(rule, x, ct=None):
    ct = jnp.ones_like(x) if ct is None else ct
    return eqx.filter_grad(lambda rx: jnp.sum(rx[0](rx[1]) * ct))((rule, x))


def test_lsq_value_and_derivatives_by_hand():
    """bits=2 signed: Q_n = 2, Q_p = 1, s = 0.5; u = x/s = [-3, -1.5, -0.4, 0.6,
    1, 4]. Levels round(clip(u))·s, half to even; x-derivative 1 strictly inside
    (-2, 1); step derivative g·(-2, round(u)-u, ..., 1) with g = 1/sqrt(6·1)."""
    x = jnp.array([-1.5, -0.75, -0.2, 0.3, 0.5, 2.0])
    rule = eqxrules.LSQ(jnp.array(0.5), bits=2)
    np.testing.assert_array_equal(rule(x), [-1.0, -1.0, 0.0, 0.5, 0.5, 0.5])
    g_rule, g_x = _grads(rule, x)
    np.testing.assert_array_equal(g_x, [0, 1, 1, 1, 0, 0])
    ds = np.array([-2.0, -2 + 1.5, 0 + 0.4, 1 - 0.6, 1.0, 1.0])
    np.testing.assert_allclose(g_rule.step, ds.sum() / math.sqrt(6), rtol=1e-6)
    raw = eqxrules.LSQ(jnp.array(0.5), bits=2, grad_scale=1.0)
    np.testing.assert_allclose(_grads(raw, x)[0].step, ds.sum(), rtol=1e-6)


@pytest.mark.slow
def test_lsq_per_channel_steps_and_grad_scale():
    """One step per row (axis 0): each row quantised with its own step, and g uses
    N = the row's 3 elements, not the 6 of the tensor."""
    x = jnp.array([[0.3, 0.9, -2.0], [0.3, 0.9, -2.0]])
    rule = eqxrules.LSQ(jnp.array([0.25, 1.0]), bits=3, axis=0, grad_scale=None)
    expected = [[0.25, 0.75, -1.0], [0.0, 1.0, -2.0]]  # 0.9/0.25 >= Q_p = 3
    np.testing.assert_array_equal(rule(x), expected)
    g = _grads(rule, x)[0].step
    u = np.asarray(x) / np.array([[0.25], [1.0]])
    ds = np.where(u <= -4, -4, np.where(u >= 3, 3, np.round(u) - u)).sum(axis=1)
    np.testing.assert_allclose(g, ds / math.sqrt(3 * 3), rtol=1e-6)


@pytest.mark.slow
def test_lsq_plus_offset_derivative():
    """Offset derivative 1 outside the clip range, 0 inside; the step's eq. 3 on
    x - offset."""
    x = jnp.array([-3.0, 0.2, 0.7, 3.0])
    rule = eqxrules.LSQ(jnp.array(0.5), bits=2, offset=jnp.array(0.5), grad_scale=1.0)
    np.testing.assert_array_equal(rule(x), [-0.5, 0.0, 0.5, 1.0])
    g_rule, g_x = _grads(rule, x)
    np.testing.assert_array_equal(g_x, [0, 1, 1, 0])
    np.testing.assert_array_equal(g_rule.offset, 2.0)
    u = (np.asarray(x) - 0.5) / 0.5  # [-7, -0.6, 0.4, 5]
    np.testing.assert_allclose(g_rule.step, -2 + (-1 + 0.6) + (0 - 0.4) + 1, rtol=1e-6)
    assert u[0] <= -2 and u[-1] >= 1


def test_pact_value_and_derivatives_by_hand():
    x = jnp.array([-1.0, 0.0, 0.4, 1.4, 1.5, 2.0])
    rule = eqxrules.PACT(jnp.array(1.5), bits=2)
    np.testing.assert_array_equal(rule(x), [0.0, 0.0, 0.5, 1.5, 1.5, 1.5])
    g_rule, g_x = _grads(rule, x)
    np.testing.assert_array_equal(g_x, [0, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(g_rule.alpha, 2.0)
    np.testing.assert_array_equal(
        eqxrules.pact_quantize(x, jnp.array(1.5), bits=2), rule(x)
    )


@pytest.mark.slow
@pytest.mark.first_case_quick
@pytest.mark.parametrize(
    "rule",
    [
        eqxrules.LSQ(jnp.array(0.5, jnp.float32), bits=4),
        eqxrules.LSQ(jnp.array([0.5, 0.25], jnp.float32), bits=4, axis=0),
        eqxrules.PACT(jnp.array(1.5, jnp.float32), bits=2),
    ],
    ids=["lsq", "lsq-per-channel", "pact"],
)
def test_bf16_input_with_f32_step(rule):
    """A bfloat16 input with a float32 step: bf16 value and input cotangent, f32
    step cotangent (each its own primal's dtype)."""
    x = jnp.linspace(-2, 2, 8, dtype=jnp.bfloat16).reshape(2, 4)
    assert rule(x).dtype == jnp.bfloat16
    g_rule, g_x = _grads(rule, x)
    assert g_x.dtype == jnp.bfloat16
    for leaf in jax.tree_util.tree_leaves(eqx.filter(g_rule, eqx.is_array)):
        assert leaf.dtype == jnp.float32


def test_nan_propagates_and_integer_input_is_rejected():
    x = jnp.array([jnp.nan, 1.0])
    for rule in (eqxrules.LSQ(jnp.array(0.5), bits=3), eqxrules.PACT(1.0, bits=2)):
        assert np.isnan(rule(x)[0]) and not np.isnan(rule(x)[1])
        with pytest.raises(TypeError, match="floating-point"):
            rule(jnp.array([1, 2]))


@pytest.mark.parametrize(
    "make, error, shown",
    [
        (lambda: eqxrules.LSQ(0.5, bits=1), ValueError, "`bits` (=1) must be >= 2"),
        (
            lambda: eqxrules.LSQ(0.5, bits=0, signed=False),
            ValueError,
            "`bits` (=0) must be >= 1",
        ),
        (lambda: eqxrules.LSQ(0.5, bits=2.0), TypeError, "`bits` (=2.0)"),
        (lambda: eqxrules.LSQ(0.0, bits=2), ValueError, "`step` (=0.0) must be"),
        (
            lambda: eqxrules.LSQ(jnp.array([0.5, -1.0]), bits=2, axis=0),
            ValueError,
            "`step` (=Array([ 0.5, -1. ]",
        ),
        (lambda: eqxrules.PACT(-1.0, bits=2), ValueError, "`alpha` (=-1.0) must be"),
        (lambda: eqxrules.PACT(1.0, bits=0), ValueError, "`bits` (=0)"),
        (
            lambda: eqxrules.lsq_quantize(
                jnp.ones((2, 3)), jnp.ones(3), bits=2, axis=2
            ),
            ValueError,
            "`axis` (=2) is out of range for `x` of shape (2, 3)",
        ),
        (
            lambda: eqxrules.lsq_quantize(
                jnp.ones((2, 3)), jnp.ones(2), bits=2, axis=1
            ),
            ValueError,
            "`step` of shape (2,) must have one element per channel",
        ),
        (
            lambda: eqxrules.lsq_quantize(jnp.ones(3), jnp.ones(2), bits=2),
            ValueError,
            "`step` of shape (2,) must broadcast to `x` of shape (3,)",
        ),
    ],
)
def test_errors_name_the_rule_argument_and_value(make, error, shown):
    with pytest.raises(error) as info:
        make()
    message = str(info.value)
    assert "`lsq_quantize`" in message or "`pact_quantize`" in message, message
    assert shown in message, message


@pytest.mark.parametrize("bits", [17, 32])
@pytest.mark.parametrize(
    "make",
    [
        lambda b: eqxrules.LSQ(0.5, bits=b),
        lambda b: eqxrules.LSQ(0.5, bits=b, signed=False),
        lambda b: eqxrules.PACT(1.0, bits=b),
        lambda b: eqxrules.lsq_quantize(jnp.ones(3), 0.5, bits=b),
        lambda b: eqxrules.pact_quantize(jnp.ones(3), 1.0, bits=b),
    ],
    ids=["lsq", "lsq-unsigned", "pact", "lsq_quantize", "pact_quantize"],
)
def test_more_than_16_bits_are_rejected_when_built(make, bits):
    """As `ste_quantize`: a `ValueError` when the Module is built, saying why (0.2.0
    accepted 17, and 32 failed at the call with JAX's bare `OverflowError`)."""
    with pytest.raises(ValueError) as info:
        make(bits)
    message = str(info.value)
    assert "`lsq_quantize`" in message or "`pact_quantize`" in message, message
    assert f"`bits` (={bits}) must be <= 16 (as for `ste_quantize`" in message


def test_16_bits_compute_every_level_signed_and_unsigned():
    """The largest `bits` accepted works at the call, exactly, on steps that are
    powers of two: the ends of the range, beyond them, and ties to even.
    Signed: levels -32768..32767; unsigned: 0..65535. PACT: alpha = 65535/1024,
    so that its levels are k/1024."""
    s = 0.5
    signed = eqxrules.LSQ(jnp.array(s), bits=16)
    x = jnp.array([-32768 * s, -40000.0, 32767 * s, 1e9, 0.25, 0.75, 2.5 * s])
    want = [-32768 * s, -32768 * s, 32767 * s, 32767 * s, 0.0, 1.0, 2 * s]
    np.testing.assert_array_equal(signed(x), want)
    unsigned = eqxrules.LSQ(jnp.array(s), bits=16, signed=False)
    x = jnp.array([-1.0, 65535 * s, 1e9, 65534.5 * s, 65533.5 * s, 0.75])
    want = [0.0, 65535 * s, 65535 * s, 65534 * s, 65534 * s, 1.0]
    np.testing.assert_array_equal(unsigned(x), want)
    _, g_x = _grads(unsigned, jnp.array([-1.0, 1.0, 65534 * s, 65535 * s]))
    np.testing.assert_array_equal(g_x, [0, 1, 1, 0])
    pact = eqxrules.PACT(jnp.array(65535 / 1024, jnp.float32), bits=16)
    x = jnp.array([-1.0, 1 / 1024, 2.5 / 1024, 70.0, 65535 / 1024])
    want = np.array([0.0, 1.0, 2.0, 65535.0, 65535.0]) / 1024
    np.testing.assert_array_equal(pact(x), want)


def test_from_data_is_the_papers_initialisation():
    w = jax.random.normal(jax.random.key(0), (4, 6))
    q = eqxrules.LSQ.from_data(w, bits=4)
    np.testing.assert_allclose(q.step, 2 * np.abs(w).mean() / math.sqrt(7), rtol=1e-6)
    q = eqxrules.LSQ.from_data(w, bits=3, signed=False, axis=0)
    expected = 2 * np.abs(w).mean(axis=1) / math.sqrt(7)
    np.testing.assert_allclose(q.step, expected, rtol=1e-6)
    assert eqxrules.LSQ.from_data(jnp.zeros(3), bits=2).step > 0


def test_step_is_traced_under_jit():
    """The step is an array leaf: one compiled program serves every step."""
    calls = []

    @jax.jit
    def f(step, x):
        calls.append(1)
        return eqxrules.lsq_quantize(x, step, bits=2)

    x = jnp.array([0.3, 0.9])
    np.testing.assert_array_equal(f(jnp.array(0.5), x), [0.5, 0.5])
    np.testing.assert_array_equal(f(jnp.array(0.25), x), [0.25, 0.25])
    assert len(calls) == 1


def _model():
    k1, k2 = jax.random.split(jax.random.key(3))
    return eqx.nn.Sequential(
        [
            eqx.nn.Conv2d(2, 4, 3, key=k1),
            eqx.nn.Lambda(lambda h: jax.nn.relu(h).reshape(-1)),
            eqx.nn.Linear(4 * 3 * 3, 5, key=k2),
        ]
    )


@pytest.mark.slow
def test_quantize_fits_each_layers_step_and_calibrate_its_input():
    """Per output channel (axis 0 of Conv2d's and Linear's weight), each layer's
    step from its own weights; `calibrate` sets each input step from what that
    layer sees; the steps are leaves that a gradient step changes."""
    model = eqxrules.quantize(
        _model(),
        kernel_quantizer=eqxrules.LSQ(1.0, bits=4, axis=0),
        input_quantizer=eqxrules.LSQ(1.0, bits=4, signed=False),
    )
    conv, _, linear = model.layers
    for layer in (conv, linear):
        w = np.asarray(layer.layer.weight)
        axes = tuple(range(1, w.ndim))
        expected = 2 * np.abs(w).mean(axis=axes) / math.sqrt(7)
        np.testing.assert_allclose(layer.kernel_quantizer.step, expected, rtol=1e-6)
    x = jax.random.uniform(jax.random.key(4), (16, 2, 5, 5))
    calibrated = eqxrules.calibrate(model, x)
    np.testing.assert_allclose(
        calibrated.layers[0].input_quantizer.step,
        2 * np.abs(np.asarray(x)).mean() / math.sqrt(15),
        rtol=1e-6,
    )
    # The recorder passes each input on unquantised.
    first = calibrated.layers[0].quantized_layer
    hidden = jax.jit(jax.vmap(lambda x: jax.nn.relu(first(x)).reshape(-1)))(x)
    np.testing.assert_allclose(
        calibrated.layers[2].input_quantizer.step,
        2 * np.abs(np.asarray(hidden)).mean() / math.sqrt(15),
        rtol=1e-5,
    )

    def loss(m):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    grads = eqx.filter_jit(eqx.filter_grad(loss))(calibrated)
    updated = eqx.apply_updates(calibrated, jax.tree_util.tree_map(lambda g: -g, grads))
    for old, new in zip(calibrated.layers[::2], updated.layers[::2]):
        assert not np.array_equal(old.input_quantizer.step, new.input_quantizer.step)
        assert not np.array_equal(old.kernel_quantizer.step, new.kernel_quantizer.step)


@pytest.mark.slow
def test_calibrate_without_learned_quantizers_is_the_identity():
    model = eqxrules.quantize(_model(), kernel_quantizer=eqxrules.SteSign())
    assert eqxrules.calibrate(model, jnp.ones((2, 2, 5, 5))) is model


def test_calibrate_fits_pact_alpha_to_the_maximum():
    model = eqxrules.quantize(
        eqx.nn.Linear(3, 2, key=jax.random.key(0)),
        input_quantizer=eqxrules.PACT(1.0, bits=2),
    )
    x = jnp.array([[0.5, 2.5, -1.0], [0.25, 1.0, 3.0]])
    assert float(eqxrules.calibrate(model, x).input_quantizer.alpha) == 3.0


# Planted defects beside the checks: `check_rule`, given the rule's references, must
# catch a step derivative of the wrong sign at the upper clip, and a missing g.


class _WrongSignAtTop(eqxrules.LSQ):
    def tangent(self, args, t_args, t_self, out, **kwargs):
        t = super().tangent(args, t_args, t_self, out, **kwargs)
        if t_self.step is None:
            return t
        (x,) = args
        top = x / self.step >= self._levels()[1]
        return t - 2 * jnp.where(top, self._g(x) * self._levels()[1] * t_self.step, 0)


class _NoGradScale(eqxrules.LSQ):
    def _g(self, x):
        return 1.0


@pytest.mark.first_case_quick
@pytest.mark.parametrize("defect", [_WrongSignAtTop, _NoGradScale])
def test_check_rule_catches_planted_step_defects(defect):
    x = jnp.array([-1.5, -0.75, -0.2, 0.3, 0.5, 2.0])
    good = eqxrules.LSQ(jnp.array(0.5), bits=2)
    bad = defect(jnp.array(0.5), bits=2)
    for rule, fails in ((good, False), (bad, True)):
        entry = next(e for e in eqxrules.catalogue() if e.name == "lsq_quantize")
        fn, args, refs = entry.check_arguments(rule, x, jax.random.key(0))
        if fails:
            with pytest.raises(RuleCheckError):
                check_rule(fn, *args, **refs, finite_differences=False)
        else:
            check_rule(fn, *args, **refs, finite_differences=False)


class _Batched(eqx.Module):
    layer: eqxrules.Quantized

    def __call__(self, x):
        return jax.vmap(self.layer)(x)


def test_calibrate_a_model_that_takes_the_batch():
    """`vmap=False` calls the model on the whole batch: the same fit as mapping a
    per-example model over it."""
    layer = eqxrules.quantize(
        eqx.nn.Linear(3, 2, key=jax.random.key(0)),
        input_quantizer=eqxrules.LSQ(1.0, bits=3),
    )
    x = jax.random.normal(jax.random.key(1), (8, 3))
    batched = eqxrules.calibrate(_Batched(layer), x, vmap=False)
    mapped = eqxrules.calibrate(layer, x)
    np.testing.assert_allclose(
        batched.layer.input_quantizer.step, mapped.input_quantizer.step, rtol=1e-6
    )
    assert mapped.input_quantizer.step != layer.input_quantizer.step


def test_derived_functional_forms_take_the_step_by_position():
    """A learnable `parameter(...)` without a default is positional after the
    inputs; with a default (`offset`) it is keyword-only, like a hyperparameter."""
    lsq = inspect.signature(eqxrules.lsq_quantize).parameters
    assert list(lsq)[:2] == ["x", "step"]
    assert lsq["step"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    for name in ("bits", "signed", "grad_scale", "axis", "offset"):
        assert lsq[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    pact = inspect.signature(eqxrules.pact_quantize).parameters
    assert list(pact) == ["x", "alpha", "bits"]
    x = jnp.array([0.3, 2.0])
    np.testing.assert_array_equal(
        eqxrules.lsq_quantize(x, step=jnp.array(0.5), bits=2),
        eqxrules.lsq_quantize(x, jnp.array(0.5), bits=2),
    )
    with pytest.raises(TypeError, match="`lsq_quantize`.*by keyword"):
        eqxrules.lsq_quantize(x, jnp.array(0.5), 2)  # type: ignore[misc]


@pytest.mark.slow
def test_calibrate_gives_the_same_bits_every_time():
    """The recorders' callbacks arrive in no fixed order; the fit must not depend on
    it. (Before the examples were put in order, 5 calls on this batch gave 3
    different first-layer steps in the last bits.)"""
    mlp = eqx.nn.MLP(64, 10, 64, 2, key=jax.random.key(0))
    q = eqxrules.quantize(
        mlp,
        kernel_quantizer=eqxrules.LSQ(1.0, bits=4, axis=0),
        input_quantizer=eqxrules.LSQ(1.0, bits=4),
    )
    x = jax.random.normal(jax.random.key(1), (64, 64))
    runs = [eqxrules.calibrate(q, x) for _ in range(5)]
    for i in range(len(mlp.layers)):
        bits = {np.asarray(r.layers[i].input_quantizer.step).tobytes() for r in runs}
        assert len(bits) == 1, (i, len(bits))
