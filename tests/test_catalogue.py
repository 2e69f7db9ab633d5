"""One parametrised test over every catalogue entry (the lineax pattern).

Capabilities are data on the entry (`forward_mode`, `is_exact()`, `elementwise`,
`domain`): nothing here names a rule, so adding one needs no edit to this file."""

from __future__ import annotations

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from hypothesis import given, strategies as st

import eqxrules
from eqxrules._verify import verify
from eqxrules.testing import strategies

KEY = jax.random.key(0)
ENTRIES = eqxrules.catalogue()
CASES = [
    pytest.param(entry, i, id=f"{entry.name}-{i}")
    for entry in ENTRIES
    for i in range(len(entry.examples(KEY)))
]


def _example(entry, index):
    return entry.examples(KEY)[index]


def _cast(tree, dtype):
    return jtu.tree_map(
        lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, tree
    )


def test_catalogue_is_not_empty_and_names_are_unique():
    names = [e.name for e in ENTRIES]
    assert names and len(names) == len(set(names))
    for e in ENTRIES:
        assert e.summary, e.name
        assert e.module.__doc__, e.name
        assert e.function.__doc__, e.name
        assert getattr(eqxrules, e.name) is e.function
        assert getattr(eqxrules, e.module.__name__) is e.module


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_entry_passes_check_rule(entry):
    """The whole battery of `check_rule` on every example, at a point that includes
    the kinks (so boundary behaviour is compared with the reference), plus finite
    differences off the kinks for exact examples: what `python -m eqxrules` runs."""
    result = verify(entry)
    assert result.passed, "\n".join(result.failures())
    for report in result.reports:
        expected = "passed" if entry.forward_mode else "unsupported"
        assert report["jvp"].status == expected
        assert report["vjp"].status == "passed"
    if any(rule.is_exact() for rule in entry.examples(KEY)):
        assert result.status("finite_differences") == "passed"


@ft.cache
def _jitted_pair(entry, index):
    """Rule and reference (value and VJP) for one example, jitted once so hypothesis
    can draw many inputs cheaply."""
    rule = _example(entry, index)

    def both(x, ct):
        fn, args, refs = entry.check_arguments(rule, x, jax.random.key(2))
        out, pullback = jax.vjp(lambda x: fn(args[0], x), x)
        ref_out = refs["forward"](*args)
        if "derivative" in refs:
            _, ref_pullback = jax.vjp(lambda x: refs["derivative"](args[0], x), x)
            (ref_ct,) = ref_pullback(ct)
        else:
            ref_ct = refs["reference_vjp"](ct, *args)[1]
        return out, pullback(ct)[0], ref_out, ref_ct

    return jax.jit(both), rule


@pytest.mark.parametrize("entry,index", CASES)
@given(data=st.data())
def test_entry_matches_reference_on_random_inputs(entry, index, data):
    """Property: value and VJP equal the references on hypothesis-drawn inputs, with
    the kinks themselves mixed in (boundaries are where STEs go wrong)."""
    x = data.draw(strategies.arrays(entry.domain, off_kinks=False, with_kinks=True))
    both, rule = _jitted_pair(entry, index)
    out_shape = jax.eval_shape(lambda x: rule(x, **rule.call_kwargs(KEY)), x)
    seed = data.draw(st.integers(0, 2**16))
    ct = jtu.tree_map(
        lambda s: jax.random.normal(jax.random.key(seed), s.shape, s.dtype), out_shape
    )
    out, grad, ref_out, ref_grad = both(x, ct)
    for a, b in zip(jtu.tree_leaves((out, grad)), jtu.tree_leaves((ref_out, ref_grad))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("entry,index", CASES)
def test_entry_keeps_dtype(entry, index, dtype):
    """Value and gradient keep the input dtype: bf16 stays bf16."""
    rule = _cast(_example(entry, index), dtype)
    x = entry.domain.sample(jax.random.key(1), dtype, off_kinks=False)
    kwargs = rule.call_kwargs(KEY)

    @eqx.filter_jit
    def value_and_grads(rule, x):
        def loss(rule_and_x):
            out = rule_and_x[0](rule_and_x[1], **kwargs)
            return sum(jnp.sum(o.astype(jnp.float32)) for o in jtu.tree_leaves(out))

        return rule(x, **kwargs), eqx.filter_grad(loss)((rule, x))

    out, (g_rule, g_x) = value_and_grads(rule, x)
    for o in jtu.tree_leaves(out):
        if eqx.is_inexact_array(o):
            assert o.dtype == dtype, entry.name
    assert g_x.dtype == dtype
    for g in jtu.tree_leaves(eqx.filter(g_rule, eqx.is_inexact_array)):
        assert g.dtype == dtype


@pytest.mark.parametrize(
    "entry", [e for e in ENTRIES if e.elementwise], ids=lambda e: e.name
)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_elementwise_entry_rejects_integer_input(entry, dtype):
    rule = _example(entry, 0)
    with pytest.raises(TypeError, match=f"`{entry.name}`.*floating-point"):
        rule(jnp.zeros(entry.domain.shape, dtype), **rule.call_kwargs(KEY))


@pytest.mark.parametrize(
    "entry", [e for e in ENTRIES if not e.forward_mode], ids=lambda e: e.name
)
@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "vmap_jacfwd"])
def test_reverse_only_entry_names_itself_under_forward_mode(entry, transform):
    rule = _example(entry, 0)
    kwargs = rule.call_kwargs(KEY)
    x = entry.domain.sample(jax.random.key(1))

    def f(x):
        return sum(jnp.sum(o) for o in jtu.tree_leaves(rule(x, **kwargs)))

    run = {
        "jvp": lambda: jax.jvp(f, (x,), (x,)),
        "jacfwd": lambda: jax.jacfwd(f)(x),
        "vmap_jacfwd": lambda: jax.vmap(jax.jacfwd(f))(jnp.stack([x, x])),
    }[transform]
    with pytest.raises(TypeError, match=f"`{entry.name}` supports reverse mode only"):
        run()


@pytest.mark.parametrize(
    "entry", [e for e in ENTRIES if not e.forward_mode], ids=lambda e: e.name
)
def test_reverse_only_entry_hessian_is_reverse_over_reverse(entry):
    """`hessian` (forward over reverse) differentiates the rule's backward pass with
    plain autodiff, as `jacrev∘jacrev` does: the two must agree, and neither may
    raise (no tracer inspection, so this holds on every JAX version)."""
    rule = _example(entry, 0)
    kwargs = rule.call_kwargs(KEY)
    x = entry.domain.sample(jax.random.key(1))

    def f(x):
        return sum(jnp.sum(jnp.sin(o) * o) for o in jtu.tree_leaves(rule(x, **kwargs)))

    np.testing.assert_allclose(
        jax.hessian(f)(x), jax.jacrev(jax.jacrev(f))(x), rtol=1e-5, atol=1e-6
    )
