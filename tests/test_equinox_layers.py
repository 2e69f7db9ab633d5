"""Every rule is an Equinox layer: it takes `key=` as `eqx.nn.Sequential` passes it,
sits between `eqx.nn.Linear` layers under `eqx.filter_grad` and `eqx.filter_jit`,
quantises in `Quantized`, and passes a key on to dropout inside a wrapped sub-model.

The catalogue-wide tests name no rule: shapes come from each example's domain,
which rules draw random numbers from `call_kwargs`, and every expected value and
gradient from the rule's own references (`reference_forward`, and
`reference_derivative` or `reference_vjp`). Each check has a planted defect beside it
that makes it fail. Each check compiles one program per case: run eagerly, every
new shape compiles each primitive, which costs more.
"""

from __future__ import annotations

import dataclasses
import functools as ft
import inspect
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import eqxrules

KEY = jax.random.key(0)
K1, K2 = jax.random.key(11), jax.random.key(12)
X = jnp.array([0.6, -0.9, 0.3])  # the input of every model here
ENTRIES = eqxrules.catalogue()


@ft.cache
def _examples(entry):
    return tuple(entry.examples(KEY))


def _example(entry, index):
    return _examples(entry)[index]


CASES = [
    pytest.param(entry, i, id=f"{entry.name}-{i}")
    for entry in ENTRIES
    for i in range(len(_examples(entry)))
]


def _needs_key(rule):
    return "key" in rule.call_kwargs(KEY)


def _reference_kwargs(rule, key):
    # The key a rule receives goes to its references too, where they take one (a
    # wrapper's references pass it on to the wrapped module, as the rule does).
    takes = "key" in inspect.signature(rule.reference_forward).parameters
    return {"key": key} if takes else {}


def _pullback(rule, x, ct, kwargs):
    """Reference cotangents `(rule, x)` of the rule at `x` for output cotangent `ct`."""
    if type(rule).reference_vjp is not eqxrules.Rule.reference_vjp:
        return rule.reference_vjp(ct, x, **kwargs)
    _, vjp = eqx.filter_vjp(lambda m, x: m.reference_derivative(x, **kwargs), rule, x)
    return vjp(ct)


def _linear(n_in, n_out, seed, *, weight_scale=0.8, bias=None):
    """An `eqx.nn.Linear` with numpy-drawn parameters (building it with a key would
    compile a PRNG program per shape)."""
    rng = np.random.default_rng(seed)
    shapes = eqx.filter_eval_shape(eqx.nn.Linear, n_in, n_out, key=KEY)
    weight = weight_scale * rng.uniform(-1, 1, (n_out, n_in))
    bias = rng.uniform(-0.1, 0.1, n_out) if bias is None else bias
    return eqx.tree_at(
        lambda m: (m.weight, m.bias),
        shapes,
        (jnp.asarray(weight, jnp.float32), jnp.asarray(bias, jnp.float32)),
    )


def _flatten(y):
    return jnp.concatenate([jnp.ravel(leaf) for leaf in jtu.tree_leaves(y)])


def _apply(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def _sum_sin(y):
    return jnp.sum(jnp.sin(_flatten(y)))


def _value_and_grad(model, x, key):
    def loss(model):
        out = model(x, key=key)
        return _sum_sin(out), out

    return eqx.filter_value_and_grad(loss, has_aux=True)(model)


def _assert_trees_close(actual, expected, what, rtol=1e-5, atol=1e-6):
    a, a_def = jtu.tree_flatten(eqx.filter(actual, eqx.is_array))
    b, b_def = jtu.tree_flatten(eqx.filter(expected, eqx.is_array))
    assert a_def == b_def, f"{what}: structure {a_def} != {b_def}"
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, rtol=rtol, atol=atol, err_msg=what)


def _assert_trees_equal(a, b, what):
    for u, v in zip(jtu.tree_leaves(a), jtu.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(u, v, err_msg=what)


def _differ(a, b):
    return any(
        not np.array_equal(u, v) for u, v in zip(jtu.tree_leaves(a), jtu.tree_leaves(b))
    )


def _nonzero(tree):
    return any(np.any(np.asarray(a) != 0) for a in jtu.tree_leaves(tree))


def _asks_for_key(call):
    """Whether `call()` raises the rule's own error for a missing key."""
    try:
        call()
    except TypeError as e:
        return "needs a PRNG key: call it as `m(x, key=key)`." in str(e)
    return False


# -- 1. every Module takes `key=`, and ignores it unless it draws random numbers --


def check_takes_key(rule):
    x = rule.input_domain().sample(jax.random.key(1))
    if _needs_key(rule):
        assert _asks_for_key(lambda: rule(x)), "called without a key, no clear error"
        assert _asks_for_key(lambda: rule(x, key=None)), "key=None: no clear error"
        _assert_trees_equal(rule(x, key=K1), rule(x, key=K1), "same key, other value")
        assert _differ(rule(x, key=K1), rule(x, key=K2)), "value ignores the key"
        return
    out, vjp = jax.vjp(rule, x)
    ct = jtu.tree_map(jnp.ones_like, out)
    for key in (None, K1):
        out_key, vjp_key = jax.vjp(lambda x, key=key: rule(x, key=key), x)
        _assert_trees_equal(out_key, out, f"value changed by key={key}")
        _assert_trees_equal(vjp_key(ct), vjp(ct), f"gradient changed by key={key}")


@pytest.mark.parametrize("entry, index", CASES)
def test_every_rule_takes_key_like_a_layer(entry, index):
    check_takes_key(_example(entry, index))


# -- 2. every example between two Linear layers, under filter_grad and filter_jit --


def _sequential(rule, layer=None):
    """`Linear → [reshape] → rule → [flatten] → Linear` (`layer` in the rule's
    place, if given), and the index of the rule.

    A rule declared to take any array (elementwise, or any pytree) sits between the
    Linears on a vector; one that acts along an axis (categories, per-channel
    magnitude) gets its declared domain shape through an `eqx.nn.Lambda` reshape.
    The first Linear's output is a sample of the rule's domain, moved by less than
    0.01: off the rule's kinks (the domain keeps 0.05 from them)."""
    shape = rule.input_domain().shape
    if rule.elementwise or rule.pytree_input:
        shape = (math.prod(shape),)
    h0 = dataclasses.replace(rule.input_domain(), shape=shape).sample(jax.random.key(1))
    out = eqx.filter_eval_shape(lambda r, h: r(h, key=KEY), rule, h0)
    layers = [_linear(3, h0.size, 2, weight_scale=0.005, bias=np.ravel(h0))]
    if len(shape) != 1:
        layers.append(eqx.nn.Lambda(lambda h: h.reshape(shape)))
    index = len(layers)
    layers.append(rule if layer is None else layer)
    leaves = jtu.tree_leaves(out)
    if len(leaves) != 1 or leaves[0].ndim != 1:
        layers.append(eqx.nn.Lambda(_flatten))
    layers.append(_linear(sum(leaf.size for leaf in leaves), 2, 3, weight_scale=0.5))
    return eqx.nn.Sequential(layers), index


def _reference_sequential(seq, index, key):
    """Value, loss and gradients of `seq` by hand: the rule replaced by its
    references, given the key `eqx.nn.Sequential` hands to the rule's position."""
    rule = seq.layers[index]
    kwargs = _reference_kwargs(rule, jax.random.split(key, len(seq.layers))[index])
    h, head_vjp = eqx.filter_vjp(_apply, seq.layers[:index], X)
    y = rule.reference_forward(h, **kwargs)
    tail = seq.layers[index + 1 :]
    out = _apply(tail, y)
    g_tail, ct_y = eqx.filter_grad(lambda t: _sum_sin(_apply(*t)))((tail, y))
    g_rule, ct_h = _pullback(rule, h, ct_y, kwargs)
    (g_head, _) = head_vjp(ct_h)
    return out, _sum_sin(out), (*g_head, g_rule, *g_tail)


def _reference_input_cotangent(rule, h):
    """What the rule's reference sends back to its input `h` for a random output
    cotangent: whether the rule passes gradient there."""
    kwargs = _reference_kwargs(rule, K1)
    out = eqx.filter_eval_shape(lambda h: rule.reference_forward(h, **kwargs), h)
    leaves, treedef = jtu.tree_flatten(out)
    keys = jax.random.split(jax.random.key(5), len(leaves))
    ct = [jax.random.normal(k, s.shape, s.dtype) for k, s in zip(keys, leaves)]
    return _pullback(rule, h, jtu.tree_unflatten(treedef, ct), kwargs)[1]


@eqx.filter_jit
def _sequential_results(seq, as_lambda, index, key, keyless):
    (loss, out), grads = _value_and_grad(seq, X, key)
    expected = _reference_sequential(seq, index, key)
    h = _apply(seq.layers[:index], X)
    ct_h = _reference_input_cotangent(seq.layers[index], h)
    variants = (as_lambda(X, key=key), seq(X)) if keyless else None
    return (out, loss, grads.layers), expected, ct_h, variants


def check_in_sequential(rule):
    seq, index = _sequential(rule)
    as_lambda, _ = _sequential(rule, eqx.nn.Lambda(rule))
    key = jax.random.key(7)
    keyless = not _needs_key(rule)
    if not keyless:  # `eqx.nn.Lambda` drops the key Sequential gives it
        assert _asks_for_key(lambda: as_lambda(X, key=key)), "Lambda(rule): no error"
    actual, expected, ct_h, variants = _sequential_results(
        seq, as_lambda, index, key, keyless
    )
    out, loss, grads = actual
    expected_out, expected_loss, expected_grads = expected
    _assert_trees_close(out, expected_out, "value in Sequential != reference")
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5, err_msg="loss")
    if variants is not None:
        _assert_trees_equal(variants[0], out, "Lambda(rule) != rule")
        _assert_trees_equal(variants[1], out, "Sequential without key != with key")
    g = np.asarray(grads[0].weight)
    assert np.all(np.isfinite(g)), "first Linear's weight gradient is not finite"
    if _nonzero(ct_h):
        assert np.any(g != 0), "the rule passes gradient, but the first Linear got none"
    else:
        assert np.all(g == 0), "the rule blocks gradient, but the first Linear got some"
    for i, (a, b) in enumerate(zip(grads, expected_grads, strict=True)):
        _assert_trees_close(a, b, f"gradient of layer {i} != reference")


@pytest.mark.parametrize("entry, index", CASES)
def test_every_rule_in_sequential_between_linears(entry, index):
    check_in_sequential(_example(entry, index))


# Planted defects: each check above must be able to fail.


class _NoKey(eqxrules.SteSign):
    def __call__(self, x):  # pyright: ignore[reportIncompatibleMethodOverride]
        return super().__call__(x)


class _KeyNoise(eqxrules.SteSign):
    def __call__(self, x, *, key=None):  # pyright: ignore[reportIncompatibleMethodOverride]
        out = super().__call__(x)
        return out if key is None else out + jax.random.normal(key, out.shape)


class _FixedKey(eqxrules.StochasticRound):
    def __call__(self, x, *, key=None):  # pyright: ignore[reportIncompatibleMethodOverride]
        return super().__call__(x, key=None if key is None else KEY)


class _InventsKey(eqxrules.StochasticRound):
    def __call__(self, x, *, key=None):  # pyright: ignore[reportIncompatibleMethodOverride]
        return super().__call__(x, key=KEY if key is None else key)


class _HostNoise(eqxrules.StochasticRound):
    # Host randomness: fixed into a jitted program when traced, new on each eager call.
    def __call__(self, x, *, key=None):  # pyright: ignore[reportIncompatibleMethodOverride]
        return super().__call__(x, key=key) + np.random.default_rng().normal()


class _NoTangent(eqxrules.SteSign):
    def tangent(self, args, t_args, t_self, out, **kwargs):
        return None


class _NaNTangent(eqxrules.SteSign):
    def tangent(self, args, t_args, t_self, out, **kwargs):
        return t_args[0] * jnp.nan


class _DoubleTangent(eqxrules.SteSign):
    def tangent(self, args, t_args, t_self, out, **kwargs):
        t = super().tangent(args, t_args, t_self, out, **kwargs)
        return None if t is None else 2 * t


class _NotTraceable(eqxrules.SteSign):
    def primal(self, x):
        return jnp.asarray(np.sign(np.asarray(x)))


def test_planted_defects_fail_the_key_check():
    with pytest.raises(TypeError, match="unexpected keyword argument 'key'"):
        check_takes_key(_NoKey())
    with pytest.raises(AssertionError, match="value changed by key"):
        check_takes_key(_KeyNoise())
    with pytest.raises(AssertionError, match="value ignores the key"):
        check_takes_key(_FixedKey())
    with pytest.raises(AssertionError, match="called without a key, no clear error"):
        check_takes_key(_InventsKey())
    with pytest.raises(AssertionError, match="same key, other value"):
        check_takes_key(_HostNoise())


@pytest.mark.parametrize(
    "rule, error, match",
    [
        pytest.param(_NoKey(), TypeError, "unexpected keyword", id="no-key"),
        pytest.param(_FixedKey(), AssertionError, "value in Seq", id="fixed-key"),
        pytest.param(_KeyNoise(), AssertionError, "value in Seq", id="key-noise"),
        pytest.param(_InventsKey(), AssertionError, "Lambda", id="invents-key"),
        pytest.param(
            _NotTraceable(),
            jax.errors.TracerArrayConversionError,
            "numpy.ndarray",
            id="not-traceable",
        ),
        pytest.param(_NaNTangent(), AssertionError, "not finite", id="nan"),
        pytest.param(_NoTangent(), AssertionError, "got none", id="no-tangent"),
        pytest.param(_DoubleTangent(), AssertionError, "layer 0", id="twice"),
    ],
)
def test_planted_defects_fail_the_sequential_check(rule, error, match):
    with pytest.raises(error, match=match):
        check_in_sequential(rule)


class _BlockingReference(_DoubleTangent):
    # The rule passes gradient; a reference that blocks it must be caught. (A
    # subclass, not a monkeypatch: a jitted check would reuse the compilation for
    # the patched class.)
    def reference_derivative(self, x):
        return jnp.zeros_like(x)


class _CopyingReference(_KeyNoise):
    # A reference that copies `_KeyNoise` in Sequential (Linear → rule → Linear: the
    # rule is layer 1 of 3), so that only the Lambda comparison sees the defect.
    def reference_forward(self, x):
        return self(x, key=jax.random.split(jax.random.key(7), 3)[1])


def test_planted_reference_defects_fail_the_sequential_check():
    with pytest.raises(AssertionError, match="but the first Linear got some"):
        check_in_sequential(_BlockingReference())
    with pytest.raises(AssertionError, match="Lambda\\(rule\\) != rule"):
        check_in_sequential(_CopyingReference())


# -- 3. a key reaches dropout inside a wrapper rule; inference_mode switches it off --


@eqx.filter_jit
def _run(model, x, k1, k2, plain=None):
    """What the dropout checks read off `model`, in one compilation: the value and
    gradients (of the model and `x`) with `k1`, the value with `k2`, and the
    inference-mode values with `k1`, `k2` and no key. Given `plain` (the rule
    without dropout), also its value and the rule's references with `k1`."""

    def loss(model_and_x):
        model, x = model_and_x
        out = model(x, key=k1)
        return _sum_sin(out), out

    (_, out), (grads, g_x) = eqx.filter_value_and_grad(loss, has_aux=True)((model, x))
    inference = eqx.nn.inference_mode(model)
    results: dict[str, Any] = dict(
        out=out,
        grads=grads,
        g_x=g_x,
        out_k2=model(x, key=k2),
        inference=[inference(x, key=k) for k in (k1, k2, None)],
    )
    if plain is not None:
        kwargs = _reference_kwargs(model, k1)
        reference = model.reference_forward(x, **kwargs)
        ct = jtu.tree_map(jnp.cos, reference)
        results["reference"] = (reference, *_pullback(model, x, ct, kwargs))
        results["plain"] = plain(x)
    return results


def _sub_models(rule):
    """The fields of `rule` holding an `eqx.Module` with parameters."""
    return [
        f.name
        for f in dataclasses.fields(rule)
        if isinstance(getattr(rule, f.name), eqx.Module)
        and jtu.tree_leaves(eqx.filter(getattr(rule, f.name), eqx.is_array))
    ]


WRAPPER_CASES = [
    pytest.param(entry, i, field, id=f"{entry.name}-{i}-{field}")
    for entry in ENTRIES
    for i, rule in enumerate(_examples(entry))
    for field in _sub_models(rule)
]


def _asks_for_dropout_key(call):
    try:
        call()
    except RuntimeError as e:
        return "Dropout requires a key" in str(e)
    return False


def check_key_reaches_dropout(rule, plain):
    """`rule` wraps a sub-model that applies dropout first; `plain` is the same rule
    around the sub-model without it."""
    x = rule.input_domain().sample(jax.random.key(1))
    kwargs = _reference_kwargs(rule, K1)
    assert kwargs, "the rule wraps a module, but its references take no key"
    r = _run(rule, x, K1, K2, plain=plain)
    _assert_trees_close(rule(x, key=K1), r["out"], "same key, other mask (eager)")
    assert _differ(r["out"], r["out_k2"]), "the mask ignores the key"
    reference, expected_rule, expected_x = r["reference"]
    _assert_trees_close(r["out"], reference, "value != reference with the same key")
    for value in r["inference"]:
        _assert_trees_equal(value, r["plain"], "inference_mode: dropout still applied")
    _assert_trees_close(r["grads"], expected_rule, "gradient of the rule's parameters")
    _assert_trees_close(r["g_x"], expected_x, "gradient of x")
    assert _asks_for_dropout_key(lambda: rule(x)), "without a key, dropout still ran"


@pytest.mark.parametrize("entry, index, field", WRAPPER_CASES)
def test_key_reaches_dropout_inside_every_wrapper_rule(entry, index, field):
    plain = _example(entry, index)
    sub = eqx.nn.Sequential([eqx.nn.Dropout(0.5), getattr(plain, field)])
    check_key_reaches_dropout(
        eqx.tree_at(lambda r: getattr(r, field), plain, sub), plain
    )


def _block():
    """A sub-model with dropout between two Linears: 3 → 4 → 3."""
    return eqx.nn.Sequential(
        [_linear(3, 4, 20), eqx.nn.Dropout(0.5), _linear(4, 3, 21)]
    )


class _Plain(eqx.Module):
    """`block(x / scale, key=key)`, differentiated by plain autodiff."""

    block: eqx.nn.Sequential
    scale: float = 1.0

    def __call__(self, x, *, key=None):
        return self.block(x / self.scale, key=key)


def _in_sequential(layer):
    return eqx.nn.Sequential([_linear(3, 3, 22), layer, _linear(3, 2, 23)])


def _check_wrapper_with_dropout(wrapper, scale):
    """`Linear → wrapper(block with dropout) → Linear` against the same Sequential
    with the block called plainly; returns both runs' gradients."""
    model, plain = _in_sequential(wrapper), _in_sequential(_Plain(_block(), scale))
    r, p = _run(model, X, K1, K2), _run(plain, X, K1, K2)
    _assert_trees_close(model(X, key=K1), r["out"], "same key, other mask (eager)")
    assert _differ(r["out"], r["out_k2"]), "the mask ignores the key"
    _assert_trees_close(r["out"], p["out"], "value != the plain block's")
    for value in r["inference"]:
        _assert_trees_equal(value, r["inference"][0], "inference_mode: keyed")
    for i in (0, 2):  # through the block's input the gradient flows as usual
        _assert_trees_close(r["grads"].layers[i], p["grads"].layers[i], f"layer {i}")
    return r["grads"].layers[1], p["grads"].layers[1].block


def check_frozen_with_dropout(frozen_cls):
    got, plain = _check_wrapper_with_dropout(frozen_cls(_block()), 1.0)
    assert _nonzero(plain), "the block has no gradient to block"
    assert not _nonzero(got), "Frozen: the module's parameters got gradient"


def check_scaled_model_with_dropout(scaled_cls):
    got, plain = _check_wrapper_with_dropout(scaled_cls(_block(), 2.0), 2.0)
    assert _nonzero(got.sub_model), "ScaledModel: the sub-model got no gradient"
    _assert_trees_close(got.sub_model, plain, "ScaledModel: sub-model gradient")


def test_frozen_with_dropout_inside_in_sequential():
    check_frozen_with_dropout(eqxrules.Frozen)


def test_scaled_model_with_dropout_inside_in_sequential():
    check_scaled_model_with_dropout(eqxrules.ScaledModel)


def _with_dropouts(rule, dropout: Callable[..., Any] = eqx.nn.Dropout(0.5)):
    """The Sequential of `check_in_sequential` with dropout after the first Linear
    and `dropout` before the last."""
    layers = _sequential(rule)[0].layers
    return eqx.nn.Sequential(
        [layers[0], eqx.nn.Dropout(0.5), *layers[1:-1], dropout, layers[-1]]
    )


@eqx.filter_jit
def _inference_values(model, k1, k2, keyless):
    """In one compilation: `model`'s values with `k1` and `k2`; in inference mode
    with `k1`, `k2` (and no key, if `keyless`); and with every Dropout replaced by
    the identity, with `k1` and `k2` (the layer count, so the split, unchanged)."""
    without_dropout = eqx.tree_at(
        lambda m: [layer for layer in m.layers if isinstance(layer, eqx.nn.Dropout)],
        model,
        replace_fn=lambda _: eqx.nn.Identity(),
    )
    inference = eqx.nn.inference_mode(model)
    keys = (k1, k2, None) if keyless else (k1, k2)
    return (
        [model(X, key=k) for k in (k1, k2)],
        [inference(X, key=k) for k in keys],
        [without_dropout(X, key=k) for k in (k1, k2)],
    )


def check_inference_mode(model):
    keyless = not any(
        isinstance(m, eqxrules.Rule) and _needs_key(m) for m in model.layers
    )
    values, inference, without_dropout = _inference_values(model, K1, K2, keyless)
    _assert_trees_close(model(X, key=K1), values[0], "same key, other output (eager)")
    assert _differ(values[0], values[1]), "the output ignores the key"
    # A rule has no `inference` flag: one that draws random numbers still does.
    _assert_trees_equal(inference[:2], without_dropout, "inference_mode")
    if keyless:
        for value in inference:
            _assert_trees_equal(value, without_dropout[0], "inference_mode: keyed")


def _kind(rule):
    # What `inference_mode` could meet in a rule: randomness of its own, sub-models
    # (with `inference` flags of their own), its kind of derivative and input.
    kind = (rule.forward_mode, rule.pytree_input, rule.elementwise)
    return (_needs_key(rule), bool(_sub_models(rule)), *kind)


def _one_entry_per_kind():
    kinds = {}
    for entry in ENTRIES:
        kinds.setdefault(_kind(_examples(entry)[0]), entry)
    return list(kinds.values())


@pytest.mark.parametrize("entry", _one_entry_per_kind(), ids=lambda e: e.name)
def test_inference_mode_on_sequential_of_rule_and_dropout(entry):
    check_inference_mode(_with_dropouts(_example(entry, 0)))


class _Opaque(eqx.Module):
    """Calls a closure: `inference_mode` cannot reach a Dropout inside it."""

    fn: object = eqx.field(static=True)

    def __call__(self, x, *, key=None):
        return self.fn(x, key=key)  # pyright: ignore[reportCallIssue]


class _DropsKey(eqxrules.Frozen):
    def __call__(self, x, *, key=None):  # pyright: ignore[reportIncompatibleMethodOverride]
        return super().__call__(x)


class _FrozenFixedKey(eqxrules.Frozen):
    def __call__(self, x, *, key=None):  # pyright: ignore[reportIncompatibleMethodOverride]
        return super().__call__(x, key=None if key is None else KEY)


class _FrozenInventsKey(eqxrules.Frozen):
    def __call__(self, x, *, key=None):  # pyright: ignore[reportIncompatibleMethodOverride]
        return super().__call__(x, key=KEY if key is None else key)


class _FrozenHostNoise(eqxrules.Frozen):
    # Host randomness: fixed into a jitted program when traced, new on each eager call.
    def __call__(self, x, *, key=None):  # pyright: ignore[reportIncompatibleMethodOverride]
        return super().__call__(x, key=key) + np.random.default_rng().normal()


class _Leaky(eqxrules.Frozen):
    def __call__(self, x, *, key=None):  # pyright: ignore[reportIncompatibleMethodOverride]
        return self.module(x, key=key)  # pyright: ignore[reportCallIssue]


class _Textbook(eqxrules.ScaledModel):
    # The textbook rule the ScaledModel docstring warns of: reads `x`'s tangent only.
    def tangent(self, args, t_args, t_self, out, *, key=None):
        return eqxrules.partial_jvp(
            lambda x: self.sub_model(x / self.scale, key=key),  # pyright: ignore[reportCallIssue]
            tuple(args),
            tuple(t_args),
        )


def _hidden_dropout():
    # Drops only when given a key, and out of `inference_mode`'s reach.
    dropout = eqx.nn.Dropout(0.5)
    return _Opaque(lambda x, key: x if key is None else dropout(x, key=key))


def test_planted_defects_fail_the_wrapper_dropout_check():
    mlp = eqx.nn.MLP(3, 2, 5, 2, activation=jnp.tanh, key=KEY)
    sub = eqx.nn.Sequential([eqx.nn.Dropout(0.5), mlp])
    plain = eqxrules.Frozen(mlp)
    with pytest.raises(RuntimeError, match="Dropout requires a key"):
        check_key_reaches_dropout(_DropsKey(sub), plain)
    with pytest.raises(AssertionError, match="the mask ignores the key"):
        check_key_reaches_dropout(_FrozenFixedKey(sub), plain)
    with pytest.raises(AssertionError, match="same key, other mask"):
        check_key_reaches_dropout(_FrozenHostNoise(sub), plain)
    with pytest.raises(AssertionError, match="without a key, dropout still ran"):
        check_key_reaches_dropout(_FrozenInventsKey(sub), plain)
    hidden = eqxrules.Frozen(eqx.nn.Sequential([_hidden_dropout(), mlp]))
    with pytest.raises(AssertionError, match="inference_mode: dropout still applied"):
        check_key_reaches_dropout(hidden, plain)
    with pytest.raises(AssertionError, match="gradient of the rule's parameters"):
        check_key_reaches_dropout(_Leaky(sub), plain)


def test_planted_defects_fail_the_frozen_and_scaled_model_checks():
    with pytest.raises(AssertionError, match="Frozen: the module's parameters got"):
        check_frozen_with_dropout(_Leaky)
    with pytest.raises(AssertionError, match="ScaledModel: the sub-model got no"):
        check_scaled_model_with_dropout(_Textbook)
    with pytest.raises(AssertionError, match="the mask ignores the key"):
        check_frozen_with_dropout(_FrozenFixedKey)
    with pytest.raises(AssertionError, match="same key, other mask"):
        check_frozen_with_dropout(_FrozenHostNoise)


def test_planted_defects_fail_the_inference_mode_check():
    with pytest.raises(AssertionError, match="inference_mode: keyed"):
        check_inference_mode(_with_dropouts(eqxrules.SteSign(), _hidden_dropout()))
    with pytest.raises(AssertionError, match="the output ignores the key"):
        check_inference_mode(_sequential(eqxrules.SteSign())[0])
    with pytest.raises(AssertionError, match="same key, other output"):
        check_inference_mode(_with_dropouts(_HostNoise()))


# -- 4. every rule that keeps an array's shape, as a quantiser ---------------------

SHAPES = ((4, 3), (3, 4), (3,), (4,))  # weights and inputs of the model 3 → 4 → 3


def _keeps_shape(rule):
    """Whether `rule` maps every weight and input of the quantised model to an array
    of the same shape and dtype."""
    for shape in SHAPES:
        x = jax.ShapeDtypeStruct(shape, jnp.float32)
        try:
            out = eqx.filter_eval_shape(lambda r, x: r(x, key=KEY), rule, x)
        except (TypeError, ValueError):
            return False
        if out != x:
            return False
    return True


QUANTIZERS = [entry for entry in ENTRIES if _keeps_shape(_examples(entry)[0])]


def test_every_rule_that_takes_any_array_is_a_quantizer():
    for entry in ENTRIES:
        if entry.elementwise or entry.module.pytree_input:
            assert entry in QUANTIZERS, entry.name


def _float_model(rule, *, mlp=False):
    """A Sequential (or an MLP) 3 → 4 → 3 with tanh, its weights drawn from the
    rule's domain (so off its kinks)."""
    shapes = eqx.filter_eval_shape(eqx.nn.MLP, 3, 3, 4, 1, activation=jnp.tanh, key=KEY)
    layers = []
    for i, layer in enumerate(shapes.layers):
        domain = dataclasses.replace(rule.input_domain(), shape=layer.weight.shape)
        bias = np.random.default_rng(i).uniform(-0.1, 0.1, layer.bias.shape)
        params = (domain.sample(jax.random.key(30 + i)), jnp.asarray(bias, jnp.float32))
        layers.append(eqx.tree_at(lambda m: (m.weight, m.bias), layer, params))
    if mlp:
        return eqx.tree_at(lambda m: m.layers, shapes, tuple(layers))
    return eqx.nn.Sequential([layers[0], eqx.nn.Lambda(jnp.tanh), layers[1]])


def _by_hand(model, x, key, quantise):
    """`model` with each Linear's input and weight quantised by `quantise(a, key)`,
    the keys split as documented: by Sequential per layer, then by `Quantized` in
    three (input, kernel, layer)."""
    for layer, k in zip(model.layers, jax.random.split(key, len(model.layers))):
        if isinstance(layer, eqx.nn.Linear):
            k_input, k_kernel, _ = jax.random.split(k, 3)
            x = quantise(x, k_input)
            weight = quantise(layer.weight, k_kernel)
            layer = eqx.tree_at(lambda m: m.weight, layer, weight)
        x = layer(x)
    return x


def _reference_twin(rule, key):
    """The rule's references as one function: `reference_forward` for the value,
    the reference pullback for the gradient."""
    kwargs = _reference_kwargs(rule, key)

    @jax.custom_vjp
    def twin(a):
        return rule.reference_forward(a, **kwargs)

    def bwd(a, ct):
        return (_pullback(rule, a, ct, kwargs)[1],)

    twin.defvjp(lambda a: (twin(a), a), bwd)
    return twin


@eqx.filter_jit
def _quantized_results(model, float_model, mlp, rule, x, keyless):
    (loss, out), grads = _value_and_grad(model, x, K1)

    def by_hand(m):
        out = _by_hand(m, x, K1, lambda a, k: _reference_twin(rule, k)(a))
        return _sum_sin(out), out

    (expected_loss, expected_out), expected = eqx.filter_value_and_grad(
        by_hand, has_aux=True
    )(float_model)
    variants = (model(x), mlp(x, key=K1)) if keyless else None
    return (
        (out, model(x, key=K2), loss, grads),
        (expected_out, expected_loss, expected),
        variants,
    )


def _quantize(model, rule, cls):
    """`eqxrules.quantize(model)` with `rule` for both quantisers, its `Quantized`
    layers rebuilt as `cls`."""
    model = eqxrules.quantize(model, kernel_quantizer=rule, input_quantizer=rule)
    is_quantized = lambda m: isinstance(m, eqxrules.Quantized)  # noqa: E731
    return jtu.tree_map(
        lambda m: (
            cls(m.layer, kernel_quantizer=rule, input_quantizer=rule)
            if is_quantized(m)
            else m
        ),
        model,
        is_leaf=is_quantized,
    )


def check_quantized(rule, cls=eqxrules.Quantized):
    float_model = _float_model(rule)
    model = _quantize(float_model, rule, cls)
    mlp = _quantize(_float_model(rule, mlp=True), rule, cls)
    x = dataclasses.replace(rule.input_domain(), shape=(3,)).sample(jax.random.key(2))
    keyless = not _needs_key(rule)
    if not keyless:
        assert _asks_for_key(lambda: model(x)), "without a key: no clear error"
        # `eqx.nn.MLP` passes no key to its layers: the rule says so clearly.
        assert _asks_for_key(lambda: mlp(x, key=K1)), "MLP: no clear error"
    actual, expected, variants = _quantized_results(
        model, float_model, mlp, rule, x, keyless
    )
    out, out_k2, loss, grads = actual
    expected_out, expected_loss, expected = expected
    _assert_trees_close(out, expected_out, "value")
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5, err_msg="loss")
    if variants is not None:
        _assert_trees_equal(variants[0], out, "the quantised value depends on the key")
        _assert_trees_equal(variants[1], out, "quantised MLP != Sequential")
    else:
        assert _differ(out, out_k2), "the quantised value ignores the key"
    for i in (0, 2):
        latent = grads.layers[i].layer
        assert np.all(np.isfinite(latent.weight)), f"layer {i}: gradient not finite"
        _assert_trees_close(latent, expected.layers[i], f"latent gradient, layer {i}")


@pytest.mark.parametrize("entry", QUANTIZERS, ids=lambda e: e.name)
def test_every_shape_keeping_rule_quantizes_with_key(entry):
    check_quantized(_example(entry, 0))


class _IgnoresKey(eqxrules.Quantized):
    # `Quantized.__call__` before it passed keys on.
    def __call__(self, x, *, key=None):
        if self.input_quantizer is not None:
            x = self.input_quantizer(x)
        return self.quantized_layer(x)


class _OneKeyForAll(eqxrules.Quantized):
    def __call__(self, x, *, key=None):
        kwargs = {} if key is None else {"key": key}
        if self.input_quantizer is not None:
            x = self.input_quantizer(x, **kwargs)
        weight = self.kernel_quantizer(self.layer.weight, **kwargs)  # pyright: ignore[reportOptionalCall]
        return eqx.tree_at(lambda m: m.weight, self.layer, weight)(x)


@pytest.mark.parametrize(
    "cls, rule, error, match",
    [
        (_IgnoresKey, eqxrules.StochasticRound(), TypeError, "needs a PRNG key"),
        (_OneKeyForAll, eqxrules.StochasticRound(), AssertionError, "value"),
        (eqxrules.Quantized, _DoubleTangent(), AssertionError, "latent gradient"),
        (eqxrules.Quantized, _NaNTangent(), AssertionError, "gradient not finite"),
    ],
    ids=["ignores-key", "one-key-for-all", "wrong-gradient", "nan-gradient"],
)
def test_planted_defects_fail_the_quantizer_check(cls, rule, error, match):
    with pytest.raises(error, match=match):
        check_quantized(rule, cls)
