"""Misuse and bad input (issue 5), calls over the catalogue: too many inputs,
inputs that do not broadcast, a missing keyword, NaN and inf inputs, an input that
is not an array, a list to a pytree rule, empty and scalar inputs, each derived
from the catalogue's data (`elementwise`, `pytree_input`, `call_kwargs`, the
references), so adding a rule needs no edit here. Rows of the README's "Misuse and
bad input" table (the rest: `tests/test_misuse.py`,
`tests/test_misuse_hyperparameters.py`).
"""

from __future__ import annotations

import functools as ft
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from conftest import CALL_KEY, ENTRIES, call, examples as _examples, sum_loss
from misuse_helpers import assert_names, assert_same, positional, rule_names, sample

import eqxrules

NAN, INF = float("nan"), float("inf")
_loss = sum_loss


# --------------------------------------------------------------------------------
# Calls, over the catalogue.


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_two_positional_arguments(entry):
    """A rule takes its inputs (one, or those `eqxrules.Inputs` names): one more
    positional argument is a `TypeError` naming the rule and saying how many it
    got."""
    rule = _examples(entry)[0]
    x = jtu.tree_map(jnp.asarray, sample(entry))
    args = (*x, x[-1]) if isinstance(x, eqxrules.Args) else (x, x)
    with pytest.raises(TypeError) as info:
        rule(*args, **rule.call_kwargs(CALL_KEY))
    assert_names(str(info.value), rule_names(entry.module), str(len(args)))


@pytest.mark.parametrize(
    "entry",
    [e for e in ENTRIES if isinstance(e.domain, eqxrules.Inputs)],
    ids=lambda e: e.name,
)
def test_inputs_that_do_not_broadcast(entry):
    """A rule of several inputs whose shapes do not broadcast together raises a
    `ValueError` naming the rule, each input and its shape."""
    rule = _examples(entry)[0]
    x = list(jtu.tree_map(jnp.asarray, sample(entry)))
    j = next(i for i, a in enumerate(x) if a.ndim)  # an input with an axis
    x[j] = jnp.concatenate([x[j], x[j]], axis=-1)  # its last axis doubled
    with pytest.raises(ValueError) as info:
        rule(*x, **rule.call_kwargs(CALL_KEY))
    shapes = [str(tuple(a.shape)) for a in x]
    assert_names(
        str(info.value), rule_names(entry.module), *entry.domain.names, *shapes
    )


def _needs_call_kwargs(entry: eqxrules.Entry) -> bool:
    return bool(_examples(entry)[0].call_kwargs(CALL_KEY))


@pytest.mark.parametrize(
    "entry", [e for e in ENTRIES if _needs_call_kwargs(e)], ids=lambda e: e.name
)
def test_missing_call_keyword(entry):
    """A rule called without the keyword arguments it needs (a PRNG `key`) raises a
    `TypeError` naming the rule and the keyword."""
    rule = _examples(entry)[0]
    with pytest.raises(TypeError) as info:
        call(rule, jtu.tree_map(jnp.asarray, sample(entry)))
    message = str(info.value)
    assert_names(message, rule_names(entry.module))
    for k in rule.call_kwargs(CALL_KEY):
        # Named as in `m(x, key=key)`, or as Python names a missing argument.
        assert f"{k}=" in message or f"'{k}'" in message, (k, message)


def _nonfinite(entry: eqxrules.Entry) -> Any:
    """An input whose first elements are NaN, +inf and -inf (in each
    floating-point input of a rule of several)."""

    def spoil(a: np.ndarray) -> jax.Array:
        if np.issubdtype(a.dtype, np.floating):
            flat = a.reshape(-1)
            n = min(3, flat.size)
            flat[:n] = (NAN, INF, -INF)[:n]
        return jnp.asarray(a)

    return jtu.tree_map(spoil, sample(entry))


def _value_and_grads(entry: eqxrules.Entry, x: jax.Array):
    """The rule's value and gradient, and the references' (`_loss` of the output),
    under one `jit`."""
    return _jitted(entry)(_examples(entry)[0], x)


@ft.cache
def _jitted(entry: eqxrules.Entry):
    rule = _examples(entry)[0]
    kwargs = rule.call_kwargs(CALL_KEY)

    @eqx.filter_jit
    def run(rule, x):
        def grads(f):
            return eqx.filter_grad(lambda rx: _loss(f(*rx)))((rule, x))[1]

        out = call(rule, x, **kwargs)
        ref_out = call(rule.reference_forward, x, **kwargs)
        g = grads(lambda r, x: call(r, x, **kwargs))
        if entry.reference_vjp:
            ct = jtu.tree_map(jnp.ones_like, eqx.filter(out, eqx.is_inexact_array))
            ref_g = call(ft.partial(rule.reference_vjp, ct), x, **kwargs)[1]
        else:
            ref_g = grads(lambda r, x: call(r.reference_derivative, x, **kwargs))
        return out, ref_out, g, ref_g

    return run


@pytest.mark.first_entry_quick
@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_nan_and_inf_inputs(entry):
    """NaN, +inf and -inf inputs: the value is the reference's (NaN where it is NaN),
    and so is the gradient, NaN included: never a silent finite number where the
    reference has NaN, nor the reverse."""
    out, ref_out, g, ref_g = _value_and_grads(entry, _nonfinite(entry))
    assert_same(out, ref_out, "value")
    assert_same(g, ref_g, "gradient")


@pytest.mark.parametrize(
    "entry", [e for e in ENTRIES if e.elementwise], ids=lambda e: e.name
)
def test_nan_and_inf_stay_local(entry):
    """For an elementwise rule, non-finite elements do not change the value or the
    gradient of the others."""
    x = _nonfinite(entry)
    out, _, g, _ = _value_and_grads(entry, x)
    clean = jnp.where(jnp.isfinite(x), x, 0.0)
    out_clean, _, g_clean, _ = _value_and_grads(entry, clean)
    finite = np.isfinite(np.asarray(x))
    for a, b in zip(jtu.tree_leaves((out, g)), jtu.tree_leaves((out_clean, g_clean))):
        np.testing.assert_array_equal(np.asarray(a)[finite], np.asarray(b)[finite])


def _takes_one_float_array(entry: eqxrules.Entry) -> bool:
    """Whether the rule rejects an integer array as not floating-point: the rules
    on one floating-point array (elementwise, blocked, learned, categorical), not
    the pytree rules nor those that pass `x` to a model they wrap.

    Called at collection, so the rule is traced (`filter_eval_shape`), not run: the
    check of its input's dtype is made when it is traced, and an abstract int32
    input of the domain's shape stands for `jnp.zeros(shape, jnp.int32)` without an
    eager compilation per rule."""
    rule = _examples(entry)[0]
    x = jax.ShapeDtypeStruct(tuple(entry.domain.shape), jnp.int32)
    kwargs = rule.call_kwargs(CALL_KEY)
    try:
        eqx.filter_eval_shape(lambda r, x: r(x, **kwargs), rule, x)
    except TypeError as e:
        return "expects a floating-point array" in str(e)
    return False


ARRAY_ENTRIES = [e for e in ENTRIES if _takes_one_float_array(e)]


def test_the_array_rules_are_found():
    """The selection above finds every elementwise rule and each kind of rule on
    one array (so the test below cannot pass by selecting nothing)."""
    found = {e.name for e in ARRAY_ENTRIES}
    assert {e.name for e in ENTRIES if e.elementwise} <= found
    kinds = {"lsq_quantize", "pact_quantize", "mx_quantize", "nvfp4_quantize"}
    assert kinds | {"straight_through_onehot", "magnitude_aware_sign"} <= found
    assert not any(e.module.pytree_input for e in ARRAY_ENTRIES)


@pytest.mark.parametrize(
    "value", [[0.5, -1.0], (0.5,), "0.5", None], ids=["list", "tuple", "str", "None"]
)
@pytest.mark.parametrize("entry", ARRAY_ENTRIES, ids=lambda e: e.name)
def test_input_that_is_not_an_array(entry, value):
    """A list (or a tuple, a string, `None`) where the rule takes an array: a
    `TypeError` naming the rule, its input, what was given and what to do, as
    `jnp`'s own functions reject lists (0.2.0 said `Cannot determine dtype of
    [0.5, -1.0]`, naming neither)."""
    rule = _examples(entry)[0]
    argument = positional(entry.function)[0]
    given = "None" if value is None else f"a {type(value).__name__} ({value!r})"
    with pytest.raises(TypeError) as info:
        rule(value, **rule.call_kwargs(CALL_KEY))
    assert_names(
        str(info.value),
        rule_names(entry.module),
        f"floating-point array for `{argument}`, got {given}",
        f"`jnp.asarray({argument})`",
    )


def test_scaled_model_names_a_list_input():
    """`ScaledModel` divides `x` before its sub-model sees it: a list is a
    `TypeError` naming the rule and `x` (0.2.0 gave Python's "unsupported operand
    type(s) for /"), while an integer array is divided as `jnp` divides it."""
    entry = next(e for e in ENTRIES if e.module is eqxrules.ScaledModel)
    rule = _examples(entry)[0]
    with pytest.raises(
        TypeError, match="`scaled_call` expects an array for `x`, got a list"
    ):
        rule([0.5, -1.0, 2.0])


@pytest.mark.parametrize(
    "entry", [e for e in ENTRIES if e.module.pytree_input], ids=lambda e: e.name
)
def test_pytree_rules_take_a_list(entry):
    """A rule on any pytree still takes a list of arrays, and gives a list: its
    reference's value."""
    rule = _examples(entry)[0]
    kwargs = rule.call_kwargs(CALL_KEY)
    x = [jnp.asarray(sample(entry)), jnp.asarray(sample(entry, seed=2))]
    out = rule(x, **kwargs)
    assert isinstance(out, list) and len(out) == 2
    assert_same(out, rule.reference_forward(x, **kwargs), "value")


def _shaped_entries() -> list[Any]:
    """Entries that take any shape: elementwise rules and pytree rules."""
    return [e for e in ENTRIES if e.elementwise or e.module.pytree_input]


def _reference_rejects(entry: eqxrules.Entry, x: jax.Array) -> bool:
    rule = _examples(entry)[0]
    kwargs = rule.call_kwargs(CALL_KEY)
    try:
        jax.eval_shape(lambda x: rule.reference_forward(x, **kwargs), x)
    except Exception:
        return True
    return False


@pytest.mark.first_entry_quick
@pytest.mark.parametrize("shape", [(0,), ()], ids=["empty", "scalar"])
@pytest.mark.parametrize("entry", _shaped_entries(), ids=lambda e: e.name)
def test_empty_and_scalar_inputs(entry, shape):
    """An empty array and a scalar give a value and a gradient of that shape and
    dtype, equal to the references'. Where the reference has no value (a scalar has
    no axis to standardise along), the rule raises a `ValueError` naming itself and
    the input's shape, when called."""
    x = jnp.asarray(sample(entry).reshape(-1)[: int(np.prod(shape))].reshape(shape))
    if _reference_rejects(entry, x):
        rule = _examples(entry)[0]
        with pytest.raises(ValueError) as info:
            rule(x, **rule.call_kwargs(CALL_KEY))
        assert_names(str(info.value), rule_names(entry.module), f"shape {shape}")
        return
    out, ref_out, g, ref_g = _value_and_grads(entry, x)
    for o in jtu.tree_leaves(out):
        assert o.shape == shape and o.dtype == x.dtype
    assert g.shape == shape and g.dtype == x.dtype
    assert_same(out, ref_out, "value")
    assert_same(g, ref_g, "gradient")
