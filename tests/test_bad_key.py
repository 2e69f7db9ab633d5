"""A bad `key` (issue 25 §4): `key=0`, a float array or any other non-key, given to
anything public that takes `key=`, is a `TypeError` naming the function or rule,
`key`, what must hold and what was given, instead of JAX's "invalid PRNG key data"
from deep inside `jax.random`, which names neither.

(`eqxrules.testing.check_unbiased` checks its own `key`: `testing` imports nothing
of the rest of eqxrules; `tests/test_unbiased.py` covers it.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CALL_KEY, ENTRIES, KEY, examples

import eqxrules
from eqxrules import recipes

BAD_KEYS = {
    "int": (0, "int (=0)"),
    "float": (1.5, "float (=1.5)"),
    "float array": (jnp.zeros(2), "an array of dtype float32 and shape (2,)"),
    "int32 array": (np.zeros(2, np.int32), "an array of dtype int32 and shape (2,)"),
    "uint32 scalar": (jnp.uint32(7), "an array of dtype uint32 and shape ()"),
    "string": ("seed", "str (='seed')"),
}


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


@pytest.mark.parametrize("bad", BAD_KEYS, ids=str)
@pytest.mark.parametrize("entry, rule", STOCHASTIC)
def test_a_rule_names_a_bad_key(entry, rule, bad):
    key, given = BAD_KEYS[bad]
    x = jnp.asarray(entry.domain.sample(KEY, off_kinks=True))
    with pytest.raises(TypeError) as info:
        rule(x, key=key)
    assert_names_the_key(str(info.value), rule.rule_name(), given)


@pytest.mark.first_case_quick
@pytest.mark.parametrize("entry, rule", STOCHASTIC)
def test_a_rule_takes_typed_and_legacy_keys(entry, rule):
    x = jnp.asarray(entry.domain.sample(KEY, off_kinks=True))
    typed = rule(x, key=CALL_KEY)
    legacy = rule(x, key=jax.random.key_data(CALL_KEY))
    assert typed.shape == legacy.shape == x.shape or entry.name == "gumbel_softmax"


def _linear() -> eqx.nn.Linear:
    return eqx.nn.Linear(32, 32, key=KEY)


X = jnp.ones((16, 32))
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


def test_jax_own_error_is_not_accepted():
    """Planted: without the check, JAX's own error on `key=0` (what main raised) is
    a `TypeError` too; the assertion above rejects it, as it names neither the
    function nor `key`."""
    with pytest.raises(TypeError) as info:
        jax.random.uniform(0, (3,))  # type: ignore[arg-type]
    assert "invalid PRNG key data" in str(info.value)
    with pytest.raises(AssertionError):
        assert_names_the_key(str(info.value), "stochastic_round", "int (=0)")


@pytest.mark.slow
def test_a_key_under_vmap_and_jit_is_accepted():
    """The check reads dtype and shape only: a traced key (mapped or not) passes."""
    keys = jax.random.split(CALL_KEY, 3)
    out = jax.jit(jax.vmap(lambda k: eqxrules.stochastic_round(X[0], key=k)))(keys)
    assert out.shape == (3, 32)
    legacy = jax.vmap(jax.random.key_data)(keys)
    out = jax.vmap(lambda k: eqxrules.stochastic_round(X[0], key=k))(legacy)
    assert out.shape == (3, 32)
