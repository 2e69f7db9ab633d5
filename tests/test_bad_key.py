"""A bad `key` (issue 25 §4, issue 40 §3): `key=0`, a float array, a `uint32`
array of the wrong length or any other non-key, given to anything public that
takes `key=`, is a `TypeError` naming the function or rule, `key`, what must hold
and what was given, and a batch of keys (`jax.random.split(key, 4)`) where one is
expected is a `ValueError` saying so, instead of JAX's "invalid PRNG key data" or
"split accepts a single key" from deep inside `jax.random`, which name neither.
Every rule of the catalogue whose `primal` takes a key, every quantised product
and every layer that takes one is tried with each.

(`eqxrules.testing.check_unbiased` checks its own `key`: `testing` imports nothing
of the rest of eqxrules; `tests/test_unbiased.py` covers it.)"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CALL_KEY, ENTRIES, KEY, call, examples

import eqxrules
from eqxrules import _catalogue, recipes
from eqxrules._lowp import dot
from eqxrules._registry import key_parameter

BAD_KEYS = {
    "int": (0, "int (=0)"),
    "float": (1.5, "float (=1.5)"),
    "float array": (jnp.zeros(2), "an array of dtype float32 and shape (2,)"),
    "int32 array": (np.zeros(2, np.int32), "an array of dtype int32 and shape (2,)"),
    "uint32 scalar": (jnp.uint32(7), "an array of dtype uint32 and shape ()"),
    "uint32 of length 3": (
        jnp.zeros(3, jnp.uint32),
        "an array of dtype uint32 and shape (3,)",
    ),
    "string": ("seed", "str (='seed')"),
}


# A batch of keys where one is expected: a `ValueError`.
BATCHES = {
    "typed batch": (
        jax.random.split(CALL_KEY, 4),
        "a typed key array of shape (4,)",
    ),
    "legacy batch": (
        jax.random.split(jax.random.PRNGKey(0), 4),
        "a legacy uint32 key array of shape (4, 2)",
    ),
}
MALFORMED = {**BAD_KEYS, **BATCHES}


def assert_names_the_batch(message: str, name: str, given: str) -> None:
    """What a batch of keys' message must say: who, `key`, that one key is
    expected, what came, and the way out."""
    for part in (
        f"`{name}`",
        "`key` must be one PRNG key, not a batch of keys",
        f"({given},",
        "`jax.vmap`",
    ):
        assert part in message, (part, message)


def assert_malformed_key_error(call: Callable[[Any], Any], name: str, bad: str):
    """`call(key)` with the malformed key `bad` raises the error and message
    `MALFORMED`'s kind of it asks for."""
    key, given = MALFORMED[bad]
    error = ValueError if bad in BATCHES else TypeError
    with pytest.raises(error) as info:
        call(key)
    if bad in BATCHES:
        assert_names_the_batch(str(info.value), name, given)
    else:
        assert_names_the_key(str(info.value), name, given)


def assert_names_the_key(message: str, name: str, given: str) -> None:
    """What a bad key's message must say: who, `key`, what must hold, what came."""
    for part in (
        f"`{name}`",
        "`key` must be a PRNG key",
        "`jax.random.key(seed)`",
        "`jax.random.PRNGKey(seed)`",
        f"not {given}",
    ):
        assert part in message, (part, message)


def _stochastic_examples() -> list[Any]:
    """For each catalogue entry, its first example that draws random numbers."""
    cases = []
    for entry in ENTRIES:
        drawing = [m for m in examples(entry) if m.needs_key()]
        if drawing:
            cases.append(pytest.param(entry, drawing[0], id=entry.name))
    return cases


STOCHASTIC = _stochastic_examples()


def test_the_catalogue_has_stochastic_rules():
    names = {p.id for p in STOCHASTIC}
    assert {"stochastic_round", "gumbel_softmax", "float_quantize"} <= names


def _keyed_examples() -> list[Any]:
    """For each catalogue entry whose rule's `primal` takes a key (the stochastic
    rules and the wrappers that pass one on), its first example."""
    cases = []
    for entry in ENTRIES:
        keyed = [m for m in examples(entry) if key_parameter(type(m)) is not None]
        if keyed:
            cases.append(pytest.param(entry, keyed[0], id=entry.name))
    return cases


KEYED = _keyed_examples()


def test_the_catalogue_has_rules_that_take_keys():
    names = {p.id for p in KEYED}
    assert {p.id for p in STOCHASTIC} <= names
    assert {"scaled_call", "frozen_call", "stop_gradient_call"} <= names


@pytest.mark.parametrize("bad", MALFORMED, ids=str)
@pytest.mark.parametrize("entry, rule", KEYED)
def test_a_rule_names_a_bad_key(entry, rule, bad):
    x = entry.domain.sample(KEY, off_kinks=True)
    assert_malformed_key_error(
        lambda key: call(rule, x, key=key), rule.rule_name(), bad
    )


@pytest.mark.first_case_quick
@pytest.mark.parametrize("entry, rule", STOCHASTIC)
def test_a_rule_takes_typed_and_legacy_keys(entry, rule):
    x = jnp.asarray(entry.domain.sample(KEY, off_kinks=True))
    typed = rule(x, key=CALL_KEY)
    legacy = rule(x, key=jax.random.key_data(CALL_KEY))
    assert typed.shape == legacy.shape == x.shape or entry.name == "gumbel_softmax"


def _linear() -> eqx.nn.Linear:
    return eqx.nn.Linear(32, 32, key=KEY)


def _conv() -> eqx.nn.Conv2d:
    return eqx.nn.Conv2d(32, 32, 3, padding=1, key=KEY)


X = jnp.ones((16, 32))
IMAGES = jnp.ones((2, 32, 4, 4))
# NVFP4 draws (stochastic rounding of gradients); a convolution's products take
# no Hadamard transform.
NO_RHT = dataclasses.replace(recipes.nvfp4(), hadamard=None)
CALLERS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "stochastic_round": (
        "stochastic_round",
        lambda key: eqxrules.stochastic_round(X, key=key),
    ),
    "FloatQuantize": (
        "float_quantize",
        lambda key: eqxrules.FloatQuantize(format="e2m1", rounding="stochastic")(
            X, key=key
        ),
    ),
    "quantized_dot nvfp4": (
        "quantized_dot",
        lambda key: eqxrules.quantized_dot(
            X, _linear().weight.T, recipe=recipes.nvfp4(), key=key
        ),
    ),
    # A recipe that reads no key: the bad key is still a bug, not dropped.
    "quantized_dot mxfp8": (
        "quantized_dot",
        lambda key: eqxrules.quantized_dot(
            X, _linear().weight.T, recipe=recipes.mxfp8(), key=key
        ),
    ),
    "QuantizedLinear": (
        "QuantizedLinear",
        lambda key: eqxrules.QuantizedLinear(_linear(), recipes.nvfp4())(X[0], key=key),
    ),
    "Keyed": (
        "Keyed",
        lambda key: eqxrules.Keyed(
            eqxrules.quantize(_linear(), recipe=recipes.nvfp4())
        )(X[0], key=key),
    ),
    "Quantized": (
        "Quantized",
        lambda key: eqxrules.Quantized(
            _linear(), kernel_quantizer=eqxrules.StochasticRound()
        )(X[0], key=key),
    ),
    "quantized_dot_general": (
        "quantized_dot_general",
        lambda key: eqxrules.quantized_dot_general(
            X, _linear().weight, (((1,), (1,)), ((), ())), recipe=NO_RHT, key=key
        ),
    ),
    "quantized_einsum": (
        "quantized_einsum",
        lambda key: eqxrules.quantized_einsum(
            "qd,kd->qk", X, X, recipe=recipes.mxfp8(), key=key
        ),
    ),
    "quantized_conv": (
        "quantized_conv",
        lambda key: eqxrules.quantized_conv(
            IMAGES, _conv().weight, (1, 1), "SAME", recipe=NO_RHT, key=key
        ),
    ),
    "QuantizedConv": (
        "QuantizedConv",
        lambda key: eqxrules.QuantizedConv(_conv(), NO_RHT)(IMAGES[0], key=key),
    ),
    "quantized_ragged_dot": (
        "quantized_ragged_dot",
        lambda key: eqxrules.quantized_ragged_dot(
            X,
            jnp.stack([_linear().weight.T] * 2),
            jnp.asarray([3, X.shape[0] - 3]),
            recipe=NO_RHT,
            key=key,
        ),
    ),
}


@pytest.mark.first_case_quick
@pytest.mark.parametrize("caller", CALLERS)
def test_a_public_call_names_a_bad_key(caller):
    name, call = CALLERS[caller]
    with pytest.raises(TypeError) as info:
        call(0)
    assert_names_the_key(str(info.value), name, "int (=0)")
    call(CALL_KEY)  # a typed key is accepted
    call(jax.random.PRNGKey(0))  # and a legacy one


@pytest.mark.parametrize("bad", MALFORMED, ids=str)
@pytest.mark.parametrize("caller", CALLERS)
def test_a_public_call_names_a_malformed_key(caller, bad):
    name, call = CALLERS[caller]
    assert_malformed_key_error(call, name, bad)


def test_jax_own_error_is_not_accepted():
    """Planted: without the check, JAX's own error on `key=0` (what main raised) is
    a `TypeError` too; the assertion above rejects it, as it names neither the
    function nor `key`. So are its errors on a wrong length and on a batch."""
    with pytest.raises(TypeError) as info:
        jax.random.uniform(0, (3,))  # type: ignore[arg-type]
    assert "invalid PRNG key data" in str(info.value)
    with pytest.raises(AssertionError):
        assert_names_the_key(str(info.value), "stochastic_round", "int (=0)")
    with pytest.raises(ValueError) as info:
        jax.random.split(BATCHES["typed batch"][0])
    assert "split accepts a single key" in str(info.value)
    with pytest.raises(AssertionError):
        assert_names_the_batch(str(info.value), "split", BATCHES["typed batch"][1])


def _main_check_key(name: str, key: Any, argument: str = "key") -> None:
    """Main's check (1042e05): any typed key, any `uint32` array of at least one
    axis."""
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    if dtype is not None and shape is not None:
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            return
        if dtype == jnp.uint32 and len(shape) >= 1:
            return
    raise TypeError(f"`{name}`: `{argument}` must be a PRNG key")


@pytest.mark.parametrize("bad", ["uint32 of length 3", *BATCHES])
@pytest.mark.parametrize("caller", ["stochastic_round", "quantized_dot nvfp4"])
def test_planted_main_check_is_caught(monkeypatch, caller, bad):
    """Planted: main's check in the rules and the products lets a wrong length and
    a batch through to JAX's own errors, which the assertions reject."""
    monkeypatch.setattr(_catalogue, "check_key", _main_check_key)
    monkeypatch.setattr(dot, "check_key", _main_check_key)
    name, call = CALLERS[caller]
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        assert_malformed_key_error(call, name, bad)


@pytest.mark.slow
def test_a_key_under_vmap_and_jit_is_accepted():
    """The check reads dtype and shape only: a traced key (mapped or not) passes."""
    keys = jax.random.split(CALL_KEY, 3)
    out = jax.jit(jax.vmap(lambda k: eqxrules.stochastic_round(X[0], key=k)))(keys)
    assert out.shape == (3, 32)
    legacy = jax.vmap(jax.random.key_data)(keys)
    out = jax.vmap(lambda k: eqxrules.stochastic_round(X[0], key=k))(legacy)
    assert out.shape == (3, 32)
