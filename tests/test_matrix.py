"""The transformation matrix: every catalogue entry through every situation it
supports (issue 5), at every dtype that situation runs in.

One parametrised test over `catalogue() × situation × dtype`. Which situations an
entry gets, and with which of its examples, is read from its data when the module is
collected (`forward_mode`, `elementwise`, `pytree_input`, `is_exact()`,
`higher_order()`, `reference_vjp`, `input_domain()`, `call_kwargs`): nothing here names a
rule, nothing is skipped at run time, and a new rule is covered by declaring it.

What `tests/test_catalogue.py` already proves is not repeated: the `check_rule`
battery, the hypothesis comparison with the references, the bf16/f16/f32 dtype of
value and gradient under `filter_jit`, the `TypeError` of an elementwise rule on an
integer input, and the reverse-only error under `jvp`/`jacfwd`/`hessian`. Sharding
is in `tests/test_sharding.py`, misuse in `tests/test_misuse.py`. The bfloat16 and
float16 columns are marked `slow`.

Most situations compare a transformed rule with the same rule plainly jitted (value
and gradient, compiled once per example and reused); the second-order, dtype and
pytree situations compare with the rule's own references. Compilation is what costs
here, so each situation compiles one program computing everything it compares, host
arrays are built with numpy (an eager JAX operation on a new shape is a compilation
too), and the harness's programs are compiled without LLVM optimisation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools as ft
import gc
import io
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from conftest import CALL_KEY, ENTRIES, examples as _examples

import eqxrules
from eqxrules.testing import DEFAULT_TOLERANCES
from eqxrules.testing._compat import enable_x64
from eqxrules.testing._tree import (
    assert_finite as _assert_finite,
    assert_trees_close,
    assert_zero as _assert_zero,
    cast as _cast,
    fill as _fill,
    first_slice as _first_slice,
    is_inexact as _is_inexact,
    random_like as _random_like,
    stack as _stack,
    sum_trees as _sum,
    zeros_like as _zeros_like,
)

BATCH = 3
F32, F64, BF16, F16 = "float32", "float64", "bfloat16", "float16"

# Comparisons of one computation under two transformations (vmap against a loop,
# scan against unrolled, ...): the same operations, possibly reassociated.
SAME_RTOL, SAME_ATOL = 1e-5, 1e-6

# Each program runs a handful of times on tiny inputs: compile it without LLVM's
# optimisations, which takes about half the time. Bit-for-bit comparisons are only
# ever made between runs of one program.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


# --------------------------------------------------------------------------------
# Host-side helpers.


@ft.cache
def _sample(domain: eqxrules.Domain, seed: int) -> np.ndarray:
    """A float32 input from `domain`, off its kinks, as a host array."""
    return np.asarray(domain.sample(jax.random.key(seed), jnp.float32, off_kinks=True))


def _weights(shape: Sequence[int], dtype: Any) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64))
    w = np.cos(np.arange(n, dtype=np.float64) * 0.7 + 0.3).reshape(shape)
    return w.astype(dtype)


def _assert_close(
    actual: Any,
    expected: Any,
    what: str,
    *,
    rtol: float = SAME_RTOL,
    atol: float = SAME_ATOL,
    exact: bool = False,
) -> None:
    assert_trees_close(actual, expected, what, rtol=rtol, atol=atol, exact=exact)


def _moveaxis(a: Any) -> np.ndarray:
    return np.moveaxis(np.asarray(a), 0, -1)


def _batch_axes(rule: Any) -> Any:
    return jtu.tree_map(lambda a: 0 if eqx.is_inexact_array(a) else None, rule)


def _perturbed(rule: Any, i: int) -> Any:
    """A copy of `rule` whose floating-point arrays differ slightly per `i`, so a
    batch of rules is not a batch of identical ones."""

    def perturb(a):
        if not eqx.is_inexact_array(a):
            return a
        b = np.asarray(a, np.float64) + 0.01 * i * _weights(a.shape, np.float64)
        return jnp.asarray(b.astype(a.dtype))

    return jtu.tree_map(perturb, rule)


def _np_loss(out: Any) -> float:
    """`_loss` on the host."""
    return float(
        sum(
            np.sum(np.asarray(o, np.float64) * _weights(o.shape, np.float64))
            for o in jtu.tree_leaves(out)
            if _is_inexact(o)
        )
    )


# --------------------------------------------------------------------------------
# Traced helpers: losses, gradients and references.


def _loss(out: Any) -> jax.Array:
    """A weighted sum of every floating-point leaf: its cotangent is neither
    constant nor symmetric, so a transposed or permuted gradient shows."""
    total = jnp.zeros((), jnp.float32)
    for o in jtu.tree_leaves(out):
        if eqx.is_inexact_array(o):
            wide = jnp.promote_types(o.dtype, jnp.float32)
            w = _weights(o.shape, wide)
            total = total + jnp.sum(o.astype(wide) * w).astype(total.dtype)
    return total


def _curved_loss(out: Any) -> jax.Array:
    """Not linear in the output, so second derivatives also see the derivative of
    the value itself, not only that of the tangent map."""
    squares = jtu.tree_map(lambda o: o * o if eqx.is_inexact_array(o) else o, out)
    return _loss(out) + 0.5 * _loss(squares)


def _dot(ct: Any, out: Any) -> jax.Array:
    """`<ct, out>` over the floating-point leaves (`ct` has `None` elsewhere)."""
    outs = [o for o in jtu.tree_leaves(out) if eqx.is_inexact_array(o)]
    return sum(
        (jnp.sum(c * o) for c, o in zip(jtu.tree_leaves(ct), outs)),
        jnp.zeros((), jnp.float32),
    )


def _grads(f: Callable[[Any, Any], Any], rule: Any, x: Any, loss=_loss) -> Any:
    """`(grad wrt rule, grad wrt x)` of `loss(f(rule, x))`; `None` on every leaf that
    is not a floating-point array."""
    return eqx.filter_grad(lambda rx: loss(f(*rx)))((rule, x))


def _jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`eqx.filter_jit` with `COMPILER_OPTIONS`: array leaves of the arguments are
    traced, every other leaf is static (and must be hashable); non-array outputs
    are passed through."""
    cache: dict[Any, tuple[Callable[..., Any], list[Any]]] = {}

    def wrapper(*args):
        dynamic, static = eqx.partition(args, eqx.is_array)
        leaves, treedef = jtu.tree_flatten(static)
        key = (treedef, tuple(leaves))
        if key not in cache:
            out_static: list[Any] = []

            def arrays_only(dynamic):
                out = fn(*eqx.combine(dynamic, static))
                arrays, other = eqx.partition(out, eqx.is_array)
                out_static.append(other)
                return arrays

            cache[key] = (
                jax.jit(arrays_only, compiler_options=COMPILER_OPTIONS),
                out_static,
            )
        jitted, out_static = cache[key]
        arrays = jitted(dynamic)
        return eqx.combine(arrays, out_static[-1])

    return wrapper


@dataclasses.dataclass(frozen=True)
class Case:
    """One example of one entry, and everything the situations derive from it."""

    entry: eqxrules.Entry
    index: int

    @property
    def rule(self) -> eqxrules.Rule:
        return _examples(self.entry)[self.index]

    @ft.cached_property
    def kwargs(self) -> dict[str, Any]:
        return self.rule.call_kwargs(CALL_KEY)

    @ft.cached_property
    def domain(self) -> eqxrules.Domain:
        return self.rule.input_domain()

    def x(self, seed: int = 1, dtype: Any = np.float32) -> jax.Array:
        return jnp.asarray(_sample(self.domain, seed).astype(dtype))

    def xs(self, n: int = BATCH, dtype: Any = np.float32) -> jax.Array:
        samples = [_sample(self.domain, 10 + i) for i in range(n)]
        return jnp.asarray(np.stack(samples).astype(dtype))

    def f(self, rule: Any, x: Any) -> Any:
        return rule(x, **self.kwargs)

    def reference(self, rule: Any, x: Any) -> Any:
        """A function whose plain autodiff derivative is the rule's (only for
        entries without `reference_vjp`)."""
        return rule.reference_derivative(x, **self.kwargs)

    def truth(self, rule: Any, x: Any) -> Any:
        """The plain composition that higher derivatives are checked against."""
        if self.entry.reference_vjp:
            return rule.reference_forward(x, **self.kwargs)
        return self.reference(rule, x)

    def reference_grads(self, rule: Any, x: Any, loss=_loss) -> Any:
        """The gradient of `loss(rule(x))` from the references, aligned with
        `_grads`: the plain derivative through `reference_derivative`, or
        `reference_vjp` with zero cotangents for the outputs `loss` ignores."""
        if not self.entry.reference_vjp:
            return _grads(self.reference, rule, x, loss)
        out = self.f(rule, x)
        ct = _fill(eqx.filter_grad(loss)(out), eqx.filter(out, eqx.is_inexact_array))
        ct_rule, ct_x = rule.reference_vjp(ct, x, **self.kwargs)
        return _fill((ct_rule, ct_x), eqx.filter((rule, x), eqx.is_inexact_array))


@ft.cache
def _baseline(case: Case) -> Callable[[Any, Any], tuple[Any, Any]]:
    """Jitted value and gradient of `_loss`, compiled once per example: what the
    transformed rule is compared with."""

    @_jit
    def value_and_grads(rule, x):
        def loss(rx):
            out = case.f(*rx)
            return _loss(out), eqx.filter(out, eqx.is_array)

        (_, out), g = eqx.filter_value_and_grad(loss, has_aux=True)((rule, x))
        return out, g

    return value_and_grads


@ft.cache
def _pullback(case: Case) -> Callable[[Any, Any, Any], Any]:
    """Jitted value and VJP with a given cotangent, compiled once per example."""

    @_jit
    def vjp(rule, x, ct):
        out, pull = eqx.filter_vjp(lambda rx: case.f(*rx), (rule, x))
        return eqx.filter(out, eqx.is_array), pull(ct)[0]

    return vjp


def _out_cotangent(case: Case, rule: Any, x: Any, seed: int) -> Any:
    out = eqx.filter_eval_shape(case.f, rule, x)
    return _random_like(seed, out)


@contextlib.contextmanager
def _checking_leaks():
    """`jax.checking_leaks`, with the objects that existed before it frozen out of
    the garbage collector (`gc.freeze`). Its check collects garbage at the end of
    every trace, which would otherwise scan the whole session's heap each time; the
    tracers it looks for are created inside, so they are still found."""
    gc.freeze()
    try:
        with jax.checking_leaks():
            yield
    finally:
        gc.unfreeze()


def _reverse_only_match(entry: eqxrules.Entry) -> str:
    return f"`{entry.name}` supports reverse mode only"


# --------------------------------------------------------------------------------
# The situations. Each is registered with the examples and dtypes it runs at: those
# are functions of the entry's data, evaluated at collection.


@dataclasses.dataclass(frozen=True)
class Situation:
    name: str
    run: Callable[[Case, str], None]
    examples: Callable[[eqxrules.Entry], Sequence[int]]
    dtypes: tuple[str, ...]


SITUATIONS: dict[str, Situation] = {}


def _first(entry: eqxrules.Entry) -> list[int]:
    return [0]


def _every(entry: eqxrules.Entry) -> list[int]:
    return list(range(len(_examples(entry))))


def _first_higher_order(entry: eqxrules.Entry) -> list[int]:
    return [i for i, r in enumerate(_examples(entry)) if r.higher_order()][:1]


def _when(predicate: Callable[[eqxrules.Entry], bool]):
    def examples(entry: eqxrules.Entry) -> list[int]:
        return [0] if predicate(entry) else []

    return examples


def _richest_output(entry: eqxrules.Entry) -> list[int]:
    """The example with the most output leaves (ties: the first), so that unused
    outputs receive `None` cotangents wherever an example has several."""
    counts = []
    for i in range(len(_examples(entry))):
        case = Case(entry, i)
        out = eqx.filter_eval_shape(case.f, case.rule, case.x())
        counts.append(len(jtu.tree_leaves(out)))
    return [int(np.argmax(counts))]


def situation(
    name: str,
    examples: Callable[[eqxrules.Entry], Sequence[int]] = _first,
    dtypes: tuple[str, ...] = (F32,),
):
    def register(fn: Callable[[Case, str], None]):
        SITUATIONS[name] = Situation(name, fn, examples, dtypes)
        return fn

    return register


class _Holder(eqx.Module):
    """A user's Module holding a rule next to non-array leaves."""

    rule: Any
    kwargs: dict[str, Any]
    label: str = "layer"
    count: int = 3

    def __call__(self, x: Any) -> dict[str, Any]:
        out = self.rule(x, **self.kwargs)
        return {"out": out, "label": self.label, "count": self.count}


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
        grads = eqx.filter_grad(lambda h: _loss(h(xs[0])["out"]))(holder)
        return eqx.filter(values, eqx.is_array), grads

    values, grads = held(_Holder(rule, case.kwargs), xs)
    for i in range(BATCH):
        v_i = jtu.tree_map(lambda a, i=i: np.asarray(a)[i], values)
        _assert_close(v_i, _baseline(case)(rule, xs[i])[0], f"filter_vmap[{i}]")
    g_rule = _baseline(case)(rule, xs[0])[1][0]
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
    X, CT = jnp.asarray(_moveaxis(np.stack(xs))), _stack(cts)
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
    v = _weights(x.shape, x.dtype)
    forward = case.entry.forward_mode

    def compose(f):
        def inner(rule, x):
            return eqx.filter_grad(lambda x: _curved_loss(f(rule, x)))(x)

        def outer(rx, checkpoint=False):
            g = eqx.filter_checkpoint(inner) if checkpoint else inner
            return jnp.vdot(v, g(*rx))

        results = dict(
            grad_grad=eqx.filter_grad(outer)((rule, x)),
            grad_checkpoint_grad=eqx.filter_grad(ft.partial(outer, checkpoint=True))(
                (rule, x)
            ),
        )
        if forward:

            def scalar(x):
                return _curved_loss(f(rule, x))

            def vector(x):
                return eqx.filter(f(rule, x), eqx.is_inexact_array)

            results["hessian"] = jax.hessian(scalar)(x)
            results["jacfwd_jacrev"] = jax.jacfwd(jax.jacrev(vector))(x)
        return results

    got, want = _jit(lambda rule, x: (compose(case.f), compose(case.truth)))(rule, x)
    for name in want:
        _assert_close(got[name], want[name], name, rtol=1e-4, atol=1e-5)


@situation("control_flow")
def _control_flow(case: Case, dtype: str) -> None:
    """Inside `lax.scan`, `lax.fori_loop` and `lax.cond` (a traced predicate, both
    branches taken): value and gradient equal the unrolled computation, and so
    does, with forward mode, the JVP through `scan`."""
    rule, xs, f = case.rule, case.xs(), case.f
    t = _random_like(6, xs)

    def scanned(rule, xs):
        def body(c, x):
            return c + _loss(f(rule, x)), None

        return jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)[0]

    def fori(rule, xs):
        def body(i, c):
            return c + _loss(f(rule, xs[i]))

        return jax.lax.fori_loop(0, BATCH, body, jnp.zeros((), jnp.float32))

    @_jit
    def program(rule, xs, p):
        def cond(rule, xs):
            return jax.lax.cond(
                p, lambda: _loss(f(rule, xs[0])), lambda: _loss(f(rule, xs[1]))
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
    base = [_baseline(case)(rule, xs[i]) for i in range(BATCH)]
    losses = [_np_loss(out) for out, _ in base]
    g_rules = [g[0] for _, g in base]
    g_xs = [np.asarray(g[1]) for _, g in base]

    def only(i):
        return np.stack([g if j == i else np.zeros_like(g) for j, g in enumerate(g_xs)])

    unrolled = (np.float32(sum(losses)), (_sum(g_rules), np.stack(g_xs)))
    for p in (True, False):
        r = program(rule, xs, jnp.asarray(p))
        _assert_close(r["scan"], unrolled, "scan")
        _assert_close(r["fori_loop"], unrolled, "fori_loop")
        i = 0 if p else 1
        branch = (np.float32(losses[i]), (g_rules[i], only(i)))
        _assert_close(r["cond"], branch, f"cond({p})")
        if case.entry.forward_mode:
            jvp = sum(float(np.vdot(g, np.asarray(t_i))) for g, t_i in zip(g_xs, t))
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
        if case.entry.forward_mode:

            def F(d):
                return eqx.filter(f(*eqx.combine(d, static)), eqx.is_inexact_array)

            (d_rule, _), (t_rule, t_x) = d, t
            results["jvp_x"] = jax.jvp(lambda x: F((d_rule, x)), (x,), (t_x,))[1]
            results["jvp_rule"] = jax.jvp(lambda r: F((r, x)), (d_rule,), (t_rule,))[1]
            results["jvp_both"] = jax.jvp(F, ((d_rule, x),), (t,))[1]
            results["jvp_zero"] = jax.jvp(F, ((d_rule, x),), (zeros,))[1]
        return results

    grid = _jit(lambda x, xs: (parts(x), eqx.filter_vmap(parts)(xs)))(x, xs)
    for where, r, at in (
        ("jit", grid[0], x),
        ("jit∘vmap", _first_slice(grid[1]), xs[0]),
    ):
        _assert_finite(r, f"{where}: ")
        g_rule, g_x = _baseline(case)(rule, at)[1]
        _assert_close(r["only_x"], g_x, f"{where}: grad wrt x alone")
        _assert_close(r["only_rule"], g_rule, f"{where}: grad wrt the rule alone")
        _assert_zero(np.asarray(r["only_x"])[np.asarray(g_x) == 0], f"{where}: ")
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
    ct = _out_cotangent(case, rule, xs[0], 8)

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
                rule_w.reference_forward(x_w, **case.kwargs), eqx.is_inexact_array
            ),
            grads=_grads(f, rule, x),
            ref_grads=case.reference_grads(rule_w, x_w),
        )
        if case.entry.forward_mode:
            results["jvp"] = jax.jvp(lambda x: f(rule, x), (x,), (x,))[1]
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


# --------------------------------------------------------------------------------
# The matrix.


# The low-precision columns compile one more program per entry each, and
# `test_catalogue.py` already checks their dtypes: they run with the slow tests.
SLOW_DTYPES = (BF16, F16)


def _matrix() -> list[Any]:
    return [
        pytest.param(
            entry,
            index,
            s.name,
            dtype,
            id=f"{entry.name}-{index}-{s.name}-{dtype}",
            marks=[pytest.mark.slow] if dtype in SLOW_DTYPES else [],
        )
        for entry in ENTRIES
        for s in SITUATIONS.values()
        for index in s.examples(entry)
        for dtype in s.dtypes
    ]


MATRIX = _matrix()


def test_every_entry_gets_the_situations_its_data_implies():
    """The matrix is built from data: every entry is in every situation that
    applies to all entries, in exactly one of `forward_mode` and `reverse_only`,
    and in the situations its flags imply."""
    cells = {(p.values[0].name, p.values[2]) for p in MATRIX}
    universal = [s.name for s in SITUATIONS.values() if s.examples in (_first, _every)]
    for entry in ENTRIES:
        mine = {name for e, name in cells if e == entry.name}
        assert set(universal) <= mine, entry.name
        assert mine & {"forward_mode", "reverse_only"} == {
            "forward_mode" if entry.forward_mode else "reverse_only"
        }
        assert ("integer_input" in mine) == entry.elementwise
        assert ("pytree_input" in mine) == entry.module.pytree_input
        higher = any(r.higher_order() for r in _examples(entry))
        assert ("second_order" in mine) == higher


def test_the_leak_check_still_finds_a_leak():
    """`_checking_leaks` freezes the old heap for speed; a tracer stored in a
    container from before is still reported."""
    leaked: list[Any] = []
    with pytest.raises(Exception, match="Leaked"):
        with _checking_leaks():
            jax.make_jaxpr(lambda x: leaked.append(x) or x)(1.0)


@pytest.mark.parametrize("entry,index,situation,dtype", MATRIX)
def test_matrix(entry, index, situation, dtype):
    SITUATIONS[situation].run(Case(entry, index), dtype)
