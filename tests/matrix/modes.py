"""Situations of the modes of differentiation: forward mode, reverse only, second
order, symbolic-zero tangents and zero cotangents."""

from __future__ import annotations

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import eqxrules
from eqxrules.testing._tree import (
    assert_finite as _assert_finite,
    assert_zero as _assert_zero,
    first_slice as _first_slice,
    zeros_like as _zeros_like,
)

from .harness import (
    Case,
    _assert_close,
    _at,
    _baseline,
    _curved_loss,
    _first_higher_order,
    _inexact_leaves,
    _jit,
    _loss,
    _out_cotangent,
    _random_like,
    _reverse_only_match,
    _weights,
    _when,
    situation,
)


@situation("forward_mode", examples=_when(lambda e: e.forward_mode))
def _forward_mode(case: Case, dtype: str) -> None:
    """`jvp`, `jacfwd` and `linearize` agree with each other, with `jacrev`, and
    (`jacfwd`) with the plain derivative of the reference."""
    rule, x = case.rule, case.x()
    d, static = eqx.partition((rule, x), eqx.is_inexact_array)
    t = _random_like(5, d)

    def F(d):
        return eqx.filter(case.f(*eqx.combine(d, static)), eqx.is_inexact_array)

    def G(d):
        return eqx.filter(case.truth(*eqx.combine(d, static)), eqx.is_inexact_array)

    @_jit
    def forward(d, t):
        _, lin = jax.linearize(F, d)
        return dict(
            jvp=jax.jvp(F, (d,), (t,))[1],
            linearize=lin(t),
            jacfwd=jax.jacfwd(F)(d),
            jacrev=jax.jacrev(F)(d),
            reference=jax.jacfwd(G)(d),
        )

    r = forward(d, t)
    _assert_close(r["linearize"], r["jvp"], "linearize vs jvp")
    _assert_close(r["jacfwd"], r["jacrev"], "jacfwd vs jacrev")
    if not case.entry.reference_vjp:
        _assert_close(r["jacfwd"], r["reference"], "jacfwd vs reference")


@situation("reverse_only", examples=_when(lambda e: not e.forward_mode))
def _reverse_only(case: Case, dtype: str) -> None:
    """Forward mode on a reverse-only rule fails with a `TypeError` naming it, also
    under `vmap`. Under `jit`, and for `jax.linearize`'s linear function evaluated
    forward, JAX raises its own `TypeError` outside the rule's code, so it cannot
    name the rule (see the README's misuse table). Reverse mode works, on every
    supported JAX version (before 0.7 `grad` used the same tracer as `jvp`):
    `grad`, `vjp`, `jacrev`, `linearize` + `linear_transpose` and `grad∘checkpoint`
    all give the same gradient."""
    rule, x, xs = case.rule, case.x(), case.xs()

    def F(x):
        return _loss(case.f(rule, x))

    # Under `jit`, JAX raises its own error when lowering, outside the rule's call.
    with pytest.raises(TypeError, match="custom_vjp|supports reverse mode only"):
        jax.jit(lambda x: jax.jvp(F, (x,), (x,)))(x)
    with pytest.raises(TypeError, match=_reverse_only_match(case.entry)):
        jax.vmap(jax.jacfwd(F))(xs)
    with pytest.raises(TypeError, match="custom_vjp|supports reverse mode only"):
        jax.jit(lambda x: jax.linearize(F, x)[1](x))(x)
    assert jax.eval_shape(jax.grad(F), x).shape == x.shape
    g = jax.grad(F)(x)
    _, pullback = jax.vjp(F, x)
    _, linear = jax.linearize(F, x)
    (transposed,) = jax.linear_transpose(linear, x)(jnp.ones((), jnp.float32))
    for name, other in (
        ("vjp", pullback(jnp.ones((), jnp.float32))[0]),
        ("jacrev", jax.jacrev(F)(x)),
        ("linearize+linear_transpose", transposed),
        ("grad∘checkpoint", jax.grad(jax.checkpoint(F))(x)),
    ):
        _assert_close(other, g, name)


@situation("second_order", examples=_first_higher_order)
def _second_order(case: Case, dtype: str) -> None:
    """`grad∘grad` (with respect to the rule's parameters and `x`), `hessian`,
    `jacfwd∘jacrev` and `grad∘checkpoint∘grad` equal the plain composition of the
    reference, for a loss that is not linear in the output."""
    rule, x = case.rule, case.x()
    # With respect to the floating-point inputs (a mask is held as it is).
    x, fixed = eqx.partition(x, eqx.is_inexact_array)
    v = jtu.tree_map(lambda a: _weights(a.shape, a.dtype), x)
    forward = case.entry.forward_mode

    def compose(f):
        def g(rule, x):
            return f(rule, eqx.combine(x, fixed))

        def inner(rule, x):
            return eqx.filter_grad(lambda x: _curved_loss(g(rule, x)))(x)

        def outer(rx, checkpoint=False):
            grad = eqx.filter_checkpoint(inner) if checkpoint else inner
            dots = jtu.tree_map(jnp.vdot, v, grad(*rx))
            return sum(jtu.tree_leaves(dots), jnp.zeros((), jnp.float32))

        results = dict(
            grad_grad=eqx.filter_grad(outer)((rule, x)),
            grad_checkpoint_grad=eqx.filter_grad(ft.partial(outer, checkpoint=True))(
                (rule, x)
            ),
        )
        if forward:

            def scalar(x):
                return _curved_loss(g(rule, x))

            def vector(x):
                return eqx.filter(g(rule, x), eqx.is_inexact_array)

            results["hessian"] = jax.hessian(scalar)(x)
            results["jacfwd_jacrev"] = jax.jacfwd(jax.jacrev(vector))(x)
        return results

    got, want = _jit(lambda rule, x: (compose(case.f), compose(case.truth)))(rule, x)
    for name in want:
        _assert_close(got[name], want[name], name, rtol=1e-4, atol=1e-5)


@situation("symbolic_zeros")
def _symbolic_zeros(case: Case, dtype: str) -> None:
    """On the `jit` × `vmap` grid: differentiating with respect to `x` alone or the
    rule alone (the other argument unperturbed: a symbolic zero) gives that part of
    the full gradient, finite, and exact zeros wherever the full gradient is exactly
    zero; in forward mode the split adds up to the full JVP, and a materialised zero
    tangent gives exact zeros."""
    rule, x, xs, f = case.rule, case.x(), case.xs(), case.f
    d, static = eqx.partition((rule, x), eqx.is_inexact_array)
    t = _random_like(7, d)
    zeros = _zeros_like(t)

    def parts(x):
        results = dict(
            only_x=eqx.filter_grad(lambda x: _loss(f(rule, x)))(x),
            only_rule=eqx.filter_grad(lambda r: _loss(f(r, x)))(rule),
        )
        if case.several:

            def alone(j):
                def loss(a):
                    return _loss(f(rule, eqxrules.Args((*x[:j], a, *x[j + 1 :]))))

                return eqx.filter_grad(loss)(x[j])

            results["only_input"] = [alone(j) for j in range(len(x))]
        if case.entry.forward_mode:
            # This `x`'s floating-point leaves (`d_x`) and the rest (a mask).
            d_x, x_static = eqx.partition(x, eqx.is_inexact_array)

            def F(d):
                r, x = eqx.combine(d, (static[0], x_static))
                return eqx.filter(f(r, x), eqx.is_inexact_array)

            (d_rule, _), (t_rule, t_x) = d, t
            results["jvp_x"] = jax.jvp(lambda x: F((d_rule, x)), (d_x,), (t_x,))[1]
            results["jvp_rule"] = jax.jvp(lambda r: F((r, d_x)), (d_rule,), (t_rule,))[
                1
            ]
            results["jvp_both"] = jax.jvp(F, ((d_rule, d_x),), (t,))[1]
            results["jvp_zero"] = jax.jvp(F, ((d_rule, d_x),), (zeros,))[1]
        return results

    grid = _jit(lambda x, xs: (parts(x), eqx.filter_vmap(parts)(xs)))(x, xs)
    for where, r, at in (
        ("jit", grid[0], x),
        ("jit∘vmap", _first_slice(grid[1]), _at(xs, 0)),
    ):
        _assert_finite(r, f"{where}: ")
        g_rule, g_x = _baseline(case)(rule, at)[1]
        _assert_close(r["only_x"], g_x, f"{where}: grad wrt x alone")
        _assert_close(r["only_rule"], g_rule, f"{where}: grad wrt the rule alone")
        for got, full in zip(_inexact_leaves(r["only_x"]), _inexact_leaves(g_x)):
            _assert_zero(got[full == 0], f"{where}: ")
        # Each input alone, the others held fixed (`None` tangents).
        for j, alone in enumerate(r.get("only_input", [])):
            _assert_close(alone, g_x[j], f"{where}: grad wrt input {j} alone")
        if case.entry.forward_mode:
            summed = jtu.tree_map(np.add, r["jvp_x"], r["jvp_rule"])
            _assert_close(summed, r["jvp_both"], f"{where}: jvp split")
            _assert_zero(r["jvp_zero"], f"{where}: jvp of a zero tangent")


@situation("zero_cotangent")
def _zero_cotangent(case: Case, dtype: str) -> None:
    """Under `jit∘vmap`, a zero cotangent gives exactly zero gradients (no NaN), and
    running the same backward pass twice, in one trace or in two calls, gives
    bit-identical results."""
    rule, xs = case.rule, case.xs()
    ct = _out_cotangent(case, rule, _at(xs, 0), 8)

    def pullback(rule, x, ct):
        _, pull = eqx.filter_vjp(lambda rx: case.f(*rx), (rule, x))
        return pull(ct), pull(ct)

    batched = _jit(eqx.filter_vmap(pullback, in_axes=(None, 0, None)))
    z1, z2 = batched(rule, xs, _zeros_like(ct))
    _assert_zero(z1, "zero cotangent: ")
    _assert_close(z1, z2, "zero cotangent twice", exact=True)
    (g1, g2), (g3, _) = batched(rule, xs, ct), batched(rule, xs, ct)
    _assert_close(g1, g2, "backward twice in one trace", exact=True)
    _assert_close(g1, g3, "backward twice across calls", exact=True)
