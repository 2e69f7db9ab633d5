"""Situations of transformation: `jit` and `grad` in every order, `vmap`, control flow
(`cond`, `scan`, `while_loop`), `checkpoint`, tracing (no leaks, no retracing) and
serialisation."""

from __future__ import annotations

import io

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from eqxrules.testing._tree import (
    stack as _stack,
    sum_trees as _sum,
    zeros_like as _zeros_like,
)

from .harness import (
    BATCH,
    Case,
    _assert_close,
    _at,
    _baseline,
    _batch_axes,
    _checking_leaks,
    _dot,
    _every,
    _grads,
    _Holder,
    _inexact_leaves,
    _jit,
    _loss,
    _moveaxis,
    _np_loss,
    _out_cotangent,
    _perturbed,
    _pullback,
    _tangent_like,
    situation,
)


@situation("jit_grad")
def _jit_grad(case: Case, dtype: str) -> None:
    """Eager; `jit`; `jit∘grad`; `grad∘jit`; `eqx.filter_jit`, `eqx.filter_grad` and
    `eqx.filter_vmap` on a Module holding the rule."""
    rule, x, xs = case.rule, case.x(), case.xs()
    out, g = _baseline(case)(rule, x)
    _assert_close(eqx.filter(case.f(rule, x), eqx.is_array), out, "eager vs jit")

    jitted_loss = eqx.filter_jit(lambda rx: _loss(case.f(*rx)))
    _assert_close(eqx.filter_grad(jitted_loss)((rule, x)), g, "grad∘jit vs jit∘grad")

    @eqx.filter_jit
    def held(holder, xs):
        values = eqx.filter_vmap(lambda h, x: h(x)["out"], in_axes=(None, 0))(
            holder, xs
        )
        grads = eqx.filter_grad(lambda h: _loss(h(_at(xs, 0))["out"]))(holder)
        return eqx.filter(values, eqx.is_array), grads

    values, grads = held(_Holder(rule, case.kwargs), xs)
    for i in range(BATCH):
        v_i = jtu.tree_map(lambda a, i=i: np.asarray(a)[i], values)
        _assert_close(v_i, _baseline(case)(rule, _at(xs, i))[0], f"filter_vmap[{i}]")
    g_rule = _baseline(case)(rule, _at(xs, 0))[1][0]
    _assert_close(grads.rule, g_rule, "filter_grad of a Module holding the rule")
    assert grads.label is None and grads.count is None


@situation("vmap")
def _vmap(case: Case, dtype: str) -> None:
    """`vmap` with mixed `in_axes` (a batch of rules on axis 0, `x` on its last
    axis, cotangents on axis 0), `vmap∘grad`, `grad∘vmap` and the batched VJP all
    equal the per-example value and VJP, stacked."""
    rule, f = case.rule, case.f
    rules = [_perturbed(rule, i) for i in range(BATCH)]
    xs = [case.x(20 + i) for i in range(BATCH)]
    cts = [_out_cotangent(case, rule, xs[0], 30 + i) for i in range(BATCH)]
    R = _stack(rules, where=eqx.is_inexact_array)
    X, CT = jtu.tree_map(jnp.asarray, _moveaxis(_stack(xs))), _stack(cts)
    axes = _batch_axes(rule)
    in_axes = (axes, -1, 0)

    def value_and_vjp(r, x, ct):
        out, pull = eqx.filter_vjp(lambda rx: f(*rx), (r, x))
        return eqx.filter(out, eqx.is_array), pull(ct)[0]

    def vjp_by_grad(r, x, ct):
        return _grads(f, r, x, loss=lambda o: _dot(ct, o))

    @_jit
    def batched(R, X, CT):
        def dots(R, X):
            return eqx.filter_vmap(lambda r, x, ct: _dot(ct, f(r, x)), in_axes=in_axes)(
                R, X, CT
            )

        return dict(
            vmap=eqx.filter_vmap(
                value_and_vjp, in_axes=in_axes, out_axes=(0, (axes, -1))
            )(R, X, CT),
            vmap_grad=eqx.filter_vmap(
                vjp_by_grad, in_axes=in_axes, out_axes=(axes, -1)
            )(R, X, CT),
            grad_vmap=_grads(dots, R, X, loss=jnp.sum),
        )

    b = batched(R, X, CT)
    values, (g_rule, g_x) = _stack(
        [_pullback(case)(r, x, ct) for r, x, ct in zip(rules, xs, cts)]
    )
    stacked = (g_rule, _moveaxis(g_x))
    _assert_close(b["vmap"], (values, stacked), "vmap(value, vjp)")
    _assert_close(b["vmap_grad"], stacked, "vmap∘grad")
    _assert_close(b["grad_vmap"], stacked, "grad∘vmap")


@situation("control_flow")
def _control_flow(case: Case, dtype: str) -> None:
    """Inside `lax.scan`, `lax.fori_loop` and `lax.cond` (a traced predicate, both
    branches taken): value and gradient equal the unrolled computation, and so
    does, with forward mode, the JVP through `scan`."""
    rule, xs, f = case.rule, case.xs(), case.f
    t = _tangent_like(6, xs)

    def scanned(rule, xs):
        def body(c, x):
            return c + _loss(f(rule, x)), None

        return jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)[0]

    def fori(rule, xs):
        def body(i, c):
            return c + _loss(f(rule, _at(xs, i)))

        return jax.lax.fori_loop(0, BATCH, body, jnp.zeros((), jnp.float32))

    @_jit
    def program(rule, xs, p):
        def cond(rule, xs):
            return jax.lax.cond(
                p,
                lambda: _loss(f(rule, _at(xs, 0))),
                lambda: _loss(f(rule, _at(xs, 1))),
            )

        def value_and_grad(fn):
            return eqx.filter_value_and_grad(lambda rx: fn(*rx))((rule, xs))

        results = dict(
            scan=value_and_grad(scanned),
            fori_loop=value_and_grad(fori),
            cond=value_and_grad(cond),
        )
        if case.entry.forward_mode:
            results["jvp"] = jax.jvp(lambda xs: scanned(rule, xs), (xs,), (t,))[1]
        return results

    # The unrolled computation, from the plainly jitted rule.
    base = [_baseline(case)(rule, _at(xs, i)) for i in range(BATCH)]
    losses = [_np_loss(out) for out, _ in base]
    g_rules = [g[0] for _, g in base]
    g_xs = [jtu.tree_map(np.asarray, g[1]) for _, g in base]

    def only(i):
        return _stack([g if j == i else _zeros_like(g) for j, g in enumerate(g_xs)])

    unrolled = (np.float32(sum(losses)), (_sum(g_rules), _stack(g_xs)))
    for p in (True, False):
        r = program(rule, xs, jnp.asarray(p))
        _assert_close(r["scan"], unrolled, "scan")
        _assert_close(r["fori_loop"], unrolled, "fori_loop")
        i = 0 if p else 1
        branch = (np.float32(losses[i]), (g_rules[i], only(i)))
        _assert_close(r["cond"], branch, f"cond({p})")
        if case.entry.forward_mode:
            t_i = [
                jtu.tree_map(lambda a, i=i: np.asarray(a)[i], t) for i in range(BATCH)
            ]
            jvp = sum(
                float(np.vdot(g, t))
                for g_x, t_x in zip(g_xs, t_i)
                for g, t in zip(*(_inexact_leaves(v) for v in (g_x, t_x)))
            )
            _assert_close(r["jvp"], np.float32(jvp), "jvp through scan")


@situation("checkpoint")
def _checkpoint(case: Case, dtype: str) -> None:
    """`jax.checkpoint` (saving nothing) and `eqx.filter_checkpoint` around the
    rule give the gradient of the plain rule. (`grad∘checkpoint∘grad` is in
    `second_order`.)"""
    rule, x = case.rule, case.x()
    _, static = eqx.partition((rule, x), eqx.is_inexact_array)

    def loss(d):
        return _loss(case.f(*eqx.combine(d, static)))

    @_jit
    def grads(rule, x):
        d, _ = eqx.partition((rule, x), eqx.is_inexact_array)
        remat = jax.checkpoint(loss, policy=jax.checkpoint_policies.nothing_saveable)
        return jax.grad(remat)(d), _grads(eqx.filter_checkpoint(case.f), rule, x)

    g_remat, g_filter = grads(rule, x)
    g = _baseline(case)(rule, x)[1]
    _assert_close(g_remat, g, "grad∘checkpoint")
    _assert_close(g_filter, g, "grad∘filter_checkpoint")


@situation("tracing")
def _tracing(case: Case, dtype: str) -> None:
    """`jax.eval_shape` and `jax.make_jaxpr`: the rule is one custom-derivative call,
    and tracing it again gives the same jaxpr; no tracer leaks
    (`jax.checking_leaks`) while tracing the rule twice under `jit`, `grad`, `vmap`
    and, with forward mode, `jvp`. (Only traced: the values are the other
    situations' business.)"""
    rule, x, xs = case.rule, case.x(), case.xs()
    out, _ = _baseline(case)(rule, x)
    d, static = eqx.partition((rule, x), eqx.is_inexact_array)

    def F(d):
        return eqx.filter(case.f(*eqx.combine(d, static)), eqx.is_array)

    shapes = jax.eval_shape(F, d)
    _assert_close(
        jtu.tree_map(lambda a: (a.shape, a.dtype), shapes),
        jtu.tree_map(lambda a: (a.shape, a.dtype), out),
        "eval_shape",
    )
    jaxpr = jax.make_jaxpr(F)(d)
    # Equinox before 0.13.5 builds `filter_custom_vjp` on a `custom_jvp` wrapper, so
    # a reverse-only rule may trace as either; a forward-mode rule never as a VJP.
    # JAX before 0.7 names a traced custom VJP `custom_vjp_call_jaxpr`.
    calls_ok = (
        ("custom_jvp_call",)
        if case.entry.forward_mode
        else ("custom_vjp_call", "custom_vjp_call_jaxpr", "custom_jvp_call")
    )
    # Equinox 0.13.8 also marks a custom VJP's non-differentiable inputs (here
    # none) with a `custom_jvp` of its own: a call of nothing, not a rule call.
    calls = [
        e
        for e in jaxpr.jaxpr.eqns
        if e.primitive.name in calls_ok and (e.invars or e.outvars)
    ]
    assert len(calls) == 1, jaxpr
    assert str(jax.make_jaxpr(F)(d)) == str(jaxpr), "tracing twice differs"

    def twice(d, xs):
        results = dict(
            a=F(d),
            b=F(d),
            grad=jax.grad(lambda d: _loss(F(d)))(d),
            vmap=eqx.filter_vmap(lambda x: case.f(rule, x))(xs),
        )
        if case.entry.forward_mode:
            results["jvp"] = jax.jvp(F, (d,), (d,))[1]
        return results

    with _checking_leaks():
        traced = jax.make_jaxpr(jax.jit(twice))(d, xs)
    assert len(traced.jaxpr.eqns) == 1  # the jit


@situation("serialisation", examples=_every)
def _serialisation(case: Case, dtype: str) -> None:
    """`eqx.tree_serialise_leaves` / `tree_deserialise_leaves` round-trip every
    example Module: the restored leaves and value are bit-identical."""
    rule, x = case.rule, case.x()
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, rule)
    buffer.seek(0)
    restored = eqx.tree_deserialise_leaves(buffer, _zeros_like(rule))
    _assert_close(
        eqx.filter(restored, eqx.is_array),
        eqx.filter(rule, eqx.is_array),
        "leaves",
        exact=True,
    )
    value = _jit(lambda rule, x: eqx.filter(case.f(rule, x), eqx.is_array))
    _assert_close(value(restored, x), value(rule, x), "value", exact=True)
