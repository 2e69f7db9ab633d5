"""Situations of inputs and outputs: pytree outputs, pytree inputs, integer inputs
(rejected or passed through) and the dtypes float64, bfloat16 and float16."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from conftest import call as _call

from eqxrules import Args, Inputs, Mask
from eqxrules.testing import DEFAULT_TOLERANCES
from eqxrules.testing._compat import enable_x64
from eqxrules.testing._tree import (
    cast as _cast,
)

from .harness import (
    BF16,
    F16,
    F64,
    Case,
    _assert_close,
    _grads,
    _Holder,
    _is_inexact,
    _jit,
    _loss,
    _richest_output,
    _sample,
    _when,
    situation,
)


def _first_leaf_loss(out: Any) -> jax.Array:
    leaves = [o for o in jtu.tree_leaves(out) if eqx.is_inexact_array(o)]
    return _loss(leaves[0])


@situation("pytrees", examples=_richest_output)
def _pytrees(case: Case, dtype: str) -> None:
    """Pytrees in and out: a Module holding the rule and non-array leaves, a dict
    input, a dict output of which only the first leaf of the rule's output is used
    (so the others receive `None` cotangents). Non-array leaves pass through; the
    gradient equals the reference's for the same partial loss."""

    @_jit
    def run(holder, inputs):
        def loss(args):
            holder, inputs = args
            out = holder(inputs["x"])
            return _first_leaf_loss(out["out"]), out

        (_, out), grads = eqx.filter_value_and_grad(loss, has_aux=True)(
            (holder, inputs)
        )
        ref = case.reference_grads(holder.rule, inputs["x"], _first_leaf_loss)
        return out, grads, ref

    holder = _Holder(case.rule, case.kwargs)
    out, (g_holder, g_inputs), ref = run(holder, {"x": case.x(), "name": "in", "n": 2})
    assert out["label"] == "layer" and out["count"] == 3
    assert g_holder.label is None and g_holder.count is None
    assert g_inputs["name"] is None and g_inputs["n"] is None
    _assert_close((g_holder.rule, g_inputs["x"]), ref, "grads vs reference")


@situation("pytree_input", examples=_when(lambda e: e.module.pytree_input))
def _pytree_input(case: Case, dtype: str) -> None:
    """A rule declared `pytree_input` takes any pytree: floating-point leaves are
    transformed as the references transform them, integer and bool arrays and
    non-array leaves come back unchanged, with no (`float0`) gradient."""
    ints = jnp.asarray(np.arange(4, dtype=np.int32))
    flags = jnp.asarray(np.array([True, False]))
    first = jnp.asarray(_sample(case.domain, 2)[0])
    tree = {"a": case.x(1), "b": (first, "name", 3, ints), "c": [flags, None]}

    def kept(tree):
        return eqx.filter(tree, lambda a: not eqx.is_inexact_array(a))

    @_jit
    def run(rule, tree):
        floats = eqx.filter(tree, eqx.is_inexact_array)

        def loss(floats):
            return _loss(case.f(rule, eqx.combine(floats, kept(tree))))

        with_ints = jax.grad(
            lambda t: loss(eqx.filter(t, eqx.is_inexact_array)), allow_int=True
        )
        return dict(
            out=case.f(rule, tree),
            grad=jax.grad(loss)(floats),
            grad_ints=with_ints(eqx.filter(tree, eqx.is_array)),
            ref_out=rule.reference_forward(floats, **case.kwargs),
            ref_grad=case.reference_grads(rule, floats)[1],
        )

    r = run(case.rule, tree)
    _assert_close(kept(r["out"]), kept(tree), "non-float leaves")
    _assert_close(eqx.filter(r["out"], eqx.is_inexact_array), r["ref_out"], "value")
    _assert_close(r["grad"], r["ref_grad"], "grad")
    assert r["grad_ints"]["b"][3].dtype == jax.dtypes.float0
    assert r["grad_ints"]["c"][0].dtype == jax.dtypes.float0


@situation("integer_input", examples=_when(lambda e: e.elementwise))
def _integer_input_rejected(case: Case, dtype: str) -> None:
    """An elementwise rule rejects integer and bool input with the documented
    `TypeError`, also under `jit`, `vmap` and `grad`. (The eager case is in
    `test_catalogue.py`.)"""
    rule = case.rule
    match = f"`{case.entry.name}`.*floating-point"
    for d in (np.int32, np.bool_):
        x = jnp.asarray(np.zeros(case.domain.shape, d))
        with pytest.raises(TypeError, match=match):
            jax.jit(lambda x: case.f(rule, x))(x)
        with pytest.raises(TypeError, match=match):
            jax.vmap(lambda x: case.f(rule, x))(x[None])
        with pytest.raises(TypeError, match=match):
            jax.grad(lambda x: _loss(case.f(rule, x)), allow_int=True)(x)


@situation("integer_inputs", examples=_when(lambda e: isinstance(e.domain, Inputs)))
def _integer_inputs_rejected(case: Case, dtype: str) -> None:
    """A rule of several inputs rejects an integer array for each floating-point
    input (and a float array for a boolean mask) with a `TypeError` naming that
    input, also under `jit`, `vmap` and `grad`."""
    rule, x = case.rule, case.x()
    for j, (name, d) in enumerate(zip(case.domain.names, case.domain.domains)):
        wrong = np.float32 if isinstance(d, Mask) else np.int32
        bad = Args((*x[:j], jnp.zeros(np.shape(x[j]), wrong), *x[j + 1 :]))
        match = f"`{case.entry.name}`.*`{name}`"
        with pytest.raises(TypeError, match=match):
            jax.jit(lambda x: case.f(rule, x))(bad)
        with pytest.raises(TypeError, match=match):
            jax.vmap(lambda x: case.f(rule, x))(jtu.tree_map(lambda a: a[None], bad))
        with pytest.raises(TypeError, match=match):
            jax.grad(lambda x: _loss(case.f(rule, x)), allow_int=True)(bad)


@situation("integer_passthrough", examples=_when(lambda e: e.module.pytree_input))
def _integer_passthrough(case: Case, dtype: str) -> None:
    """A pytree rule passes integer and bool arrays through unchanged, with a
    `float0` gradient, under `jit`, `vmap` and `grad`."""
    rule = case.rule

    @_jit
    def run(x):
        g = jax.grad(lambda x: _loss(case.f(rule, x)), allow_int=True)(x)
        return case.f(rule, x), jax.vmap(lambda x: case.f(rule, x))(x), g

    for d in (np.int32, np.bool_):
        x = jnp.asarray((_sample(case.domain, 1) > 0).astype(d))
        out, batched, g = run(x)
        _assert_close(out, x, "value", exact=True)
        _assert_close(batched, x, "vmap value", exact=True)
        assert g.dtype == jax.dtypes.float0 and g.shape == x.shape


@situation("dtype", dtypes=(F64, BF16, F16))
def _dtype(case: Case, dtype: str) -> None:
    """Under `jit` (value, gradient, and the JVP with forward mode): outputs,
    gradients and tangents keep the input dtype, and equal the references (run in
    float32 or wider on the same values), within that dtype's tolerance. float64 runs in a scoped
    `enable_x64()` (`jax.enable_x64` or, before it, `jax.experimental.enable_x64`). (float32 is the dtype of every other situation.)"""
    if dtype == F64:
        with enable_x64():
            _dtype_checks(case, np.dtype(np.float64))
    else:
        _dtype_checks(case, jnp.dtype(dtype))


def _dtype_checks(case: Case, dtype: Any) -> None:
    rule, x, f = _cast(case.rule, dtype), case.x(dtype=dtype), case.f
    rtol, atol = DEFAULT_TOLERANCES[dtype.name]
    wide = jnp.promote_types(dtype, jnp.float32)

    def one(rule, x):
        # The references run on the same values in (at least) float32: the truth
        # the low-precision rule is held to.
        rule_w, x_w = jtu.tree_map(
            lambda a: a.astype(wide) if eqx.is_inexact_array(a) else a, (rule, x)
        )
        results = dict(
            out=eqx.filter(f(rule, x), eqx.is_inexact_array),
            ref_out=eqx.filter(
                _call(rule_w.reference_forward, x_w, **case.kwargs),
                eqx.is_inexact_array,
            ),
            grads=_grads(f, rule, x),
            ref_grads=case.reference_grads(rule_w, x_w),
        )
        if case.entry.forward_mode:
            # Along the floating-point inputs themselves (a mask held fixed).
            d, fixed = eqx.partition(x, eqx.is_inexact_array)
            results["jvp"] = jax.jvp(
                lambda d: f(rule, eqx.combine(d, fixed)), (d,), (d,)
            )[1]
        return results

    r = _jit(one)(rule, x)
    typed = (r["out"], r["grads"], r.get("jvp"))
    for path, leaf in jtu.tree_flatten_with_path(typed)[0]:
        if _is_inexact(leaf):
            assert leaf.dtype == dtype, f"{jtu.keystr(path)}: {leaf.dtype} != {dtype}"
    _assert_close(r["out"], _cast(r["ref_out"], dtype), "value", rtol=rtol, atol=atol)
    _assert_close(
        r["grads"], _cast(r["ref_grads"], dtype), "gradient", rtol=rtol, atol=atol
    )
