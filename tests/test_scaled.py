"""ScaledModel: every mode against its definition, on hypothesis-drawn MLPs, scales
and inputs; the textbook failure cases; transformations; validation."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import eqxrules
from eqxrules import ScaledModel, scaled_call
from eqxrules.testing import check_rule, strategies

sg = jax.lax.stop_gradient

# The definitions from the issue, written here independently of the rule:
# exact = plain autodiff; skip_scale = J_sub(x/scale)·t plus true parameter
# derivatives; stop_input = only the parameter derivatives.
DEFINITIONS = {
    "exact": lambda m, x: m.sub_model(x / m.scale),
    "skip_scale": lambda m, x: m.sub_model(sg(x / m.scale) + x - sg(x)),
    "stop_input": lambda m, x: m.sub_model(sg(x / m.scale)),
}


@st.composite
def _scales(draw, size):
    if draw(st.booleans()):
        return draw(st.sampled_from([0.25, 2.0, -3.0, 7.5]))
    values = draw(
        st.lists(
            st.floats(0.25, 5.0, width=32) | st.floats(-5.0, -0.25, width=32),
            min_size=size,
            max_size=size,
        )
    )
    return jnp.asarray(values, jnp.float32)


@pytest.mark.slow
@pytest.mark.first_case_quick
@pytest.mark.parametrize("mode", list(DEFINITIONS))
@settings(max_examples=3)
@given(data=st.data())
def test_mode_matches_definition(mode, data):
    mlp = data.draw(strategies.mlps(max_width=6, max_depth=2))
    scale = data.draw(_scales(mlp.in_size))
    domain = eqxrules.Domain(low=-2.0, high=2.0, shape=(mlp.in_size,))
    x = data.draw(strategies.arrays(domain))
    model = ScaledModel(mlp, scale, mode=mode)
    report = check_rule(
        lambda m, x: m(x),
        model,
        x,
        forward=DEFINITIONS["exact"],
        derivative=DEFINITIONS[mode],
        finite_differences=mode == "exact",
    )
    assert report.passed


def _linear():
    lin = eqx.nn.Linear(3, 1, key=jax.random.key(0))
    return eqx.tree_at(
        lambda lin: (lin.weight, lin.bias), lin, (jnp.ones((1, 3)), jnp.zeros(1))
    )


X = jnp.array([0.0, 1.0, 2.0])


@pytest.mark.parametrize("mode", list(DEFINITIONS))
def test_parameter_gradient_flows_alone_and_with_x(mode):
    model = ScaledModel(_linear(), 2.0, mode=mode)
    alone = eqx.filter_grad(lambda m: m(X).sum())(model)
    both, gx = eqx.filter_grad(lambda mx: mx[0](mx[1]).sum())((model, X))
    np.testing.assert_allclose(alone.sub_model.weight, [[0.0, 0.5, 1.0]])
    np.testing.assert_allclose(both.sub_model.weight, [[0.0, 0.5, 1.0]])
    expected_gx = {"exact": 0.5, "skip_scale": 1.0, "stop_input": 0.0}[mode]
    np.testing.assert_allclose(gx, expected_gx * np.ones(3))


def test_array_scale_gradient_exact_and_zero_otherwise():
    scale = jnp.array([0.5, 2.0, -1.5])
    for mode, expected in [("exact", -X / scale**2), ("skip_scale", 0 * X)]:
        model = ScaledModel(_linear(), scale, mode=mode)
        g = eqx.filter_grad(lambda m: m(X).sum())(model)
        np.testing.assert_allclose(g.scale, expected, rtol=1e-6)


@pytest.mark.slow
def test_forward_mode_and_second_order_in_exact_mode():
    mlp = eqx.nn.MLP(3, 2, 4, 2, activation=jnp.tanh, key=jax.random.key(1))
    model = ScaledModel(mlp, 2.0)
    plain = lambda x: mlp(x / 2.0)  # noqa: E731
    np.testing.assert_allclose(jax.jacfwd(model)(X), jax.jacfwd(plain)(X), rtol=1e-5)
    np.testing.assert_allclose(jax.jacrev(model)(X), jax.jacrev(plain)(X), rtol=1e-5)
    h = jax.hessian(lambda x: model(x).sum())(X)
    np.testing.assert_allclose(h, jax.hessian(lambda x: plain(x).sum())(X), atol=1e-6)


@pytest.mark.slow
@pytest.mark.first_case_quick
@pytest.mark.parametrize("mode", list(DEFINITIONS))
def test_jit_vmap_and_functional_form(mode):
    mlp = eqx.nn.MLP(3, 2, 4, 1, activation=jnp.tanh, key=jax.random.key(2))
    xs = jax.random.normal(jax.random.key(3), (5, 3))
    model = ScaledModel(mlp, 4.0, mode=mode)
    out = eqx.filter_jit(eqx.filter_vmap(lambda m, x: m(x), in_axes=(None, 0)))(
        model, xs
    )
    np.testing.assert_allclose(out, jax.vmap(lambda x: mlp(x / 4.0))(xs), rtol=1e-6)
    f = lambda x: scaled_call(mlp, x, 4.0, mode=mode).sum()  # noqa: E731
    g = jax.vmap(jax.grad(f))(xs)
    ref = jax.vmap(jax.grad(lambda x: DEFINITIONS[mode](model, x).sum()))(xs)
    np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_pytree_output_and_plain_function_sub_model():
    def sub(u):
        return {"sin": jnp.sin(u), "pair": (u**2, jnp.cos(u))}

    for mode in DEFINITIONS:
        model = ScaledModel(sub, 3.0, mode=mode)
        report = check_rule(
            lambda m, x: m(x),
            model,
            X,
            forward=DEFINITIONS["exact"],
            derivative=DEFINITIONS[mode],
        )
        assert report.passed


@pytest.mark.parametrize(
    "scale", [0.0, float("nan"), float("inf"), -float("inf"), jnp.array([1.0, 0.0])]
)
def test_bad_scale_is_rejected_at_construction(scale):
    with pytest.raises(ValueError, match=r"`scaled_call`: `scale` \(=.*\) must be"):
        ScaledModel(_linear(), scale)
    with pytest.raises(ValueError, match="`scale`"):
        scaled_call(_linear(), X, scale)


def test_bad_mode_and_types_are_rejected():
    with pytest.raises(ValueError, match=r"`mode` \(='chain'\) must be one of"):
        ScaledModel(_linear(), 2.0, mode="chain")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="`scale`"):
        ScaledModel(_linear(), "2")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="`sub_model`"):
        ScaledModel(3, 2.0)  # pyright: ignore[reportArgumentType]


def test_scale_must_broadcast_to_x():
    model = ScaledModel(_linear(), jnp.ones(4))
    with pytest.raises(ValueError, match=r"`scale` of shape \(4,\) must broadcast"):
        model(X)


def test_traced_scale_is_accepted_under_jit():
    @jax.jit
    def f(s):
        return ScaledModel(_linear(), s)(X).sum()

    np.testing.assert_allclose(f(2.0), 1.5)
