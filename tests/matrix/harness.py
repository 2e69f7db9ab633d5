"""The transformation matrix's harness: host-side helpers, traced helpers (losses,
gradients, references), `Case` (one example of one entry) and the registry of
situations, which `transforms`, `modes` and `inputs` fill and `tests/test_matrix.py`
runs (see its docstring)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools as ft
import gc
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from conftest import CALL_KEY, call as _call, examples as _examples

import eqxrules
from eqxrules.testing._tree import (
    assert_trees_close,
    cast as _tree_cast,
    fill as _fill,
    is_inexact as _is_inexact,
    random_like as _random_like,
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
def _sample(domain: eqxrules.Domain, seed: int) -> Any:
    """A float32 input from `domain`, off its kinks, as a host array (an `Args` of
    them for a rule of several inputs)."""
    x = domain.sample(jax.random.key(seed), jnp.float32, off_kinks=True)
    return jtu.tree_map(np.asarray, x)


def _input(x: Any, dtype: Any) -> Any:
    """The input `x` (an array, or an `Args`) as device arrays, its floating-point
    leaves in `dtype` (a boolean mask stays boolean)."""
    return jtu.tree_map(jnp.asarray, _tree_cast(x, dtype))


def _at(xs: Any, i: int) -> Any:
    """Example `i` of a batch of inputs (`Case.xs`): `xs[i]`, leaf by leaf."""
    return jtu.tree_map(lambda a: a[i], xs)


def _tangent_like(seed: int, x: Any) -> Any:
    """Random tangents for the input `x`: float0 zeros for a boolean mask, which
    `jax.jvp` wants there."""
    t = _random_like(seed, x)
    return jtu.tree_map(
        lambda t, a: np.zeros(np.shape(a), jax.dtypes.float0) if t is None else t,
        t,
        x,
        is_leaf=lambda t: t is None,
    )


def _inexact_leaves(tree: Any) -> list[np.ndarray]:
    """The floating-point leaves of `tree` (float0 and `None` left out), on the
    host."""
    return [np.asarray(a) for a in jtu.tree_leaves(tree) if _is_inexact(np.asarray(a))]


def _abstract(domain: Any) -> Any:
    """The input of `domain` as shapes (float32; a mask boolean), unsampled."""
    if isinstance(domain, eqxrules.Inputs):
        return eqxrules.Args(
            jax.ShapeDtypeStruct(
                d.shape, jnp.bool_ if isinstance(d, eqxrules.Mask) else jnp.float32
            )
            for d in domain.domains
        )
    return jax.ShapeDtypeStruct(tuple(domain.shape), jnp.float32)


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


def _moveaxis(a: Any) -> Any:
    """Each leaf's leading axis moved last."""
    return jtu.tree_map(lambda a: np.moveaxis(np.asarray(a), 0, -1), a)


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

    @property
    def several(self) -> bool:
        """Whether the rule takes several inputs (its `x` an `eqxrules.Args`)."""
        return isinstance(self.domain, eqxrules.Inputs)

    def x(self, seed: int = 1, dtype: Any = np.float32) -> Any:
        """An input: an array, or for a rule of several inputs an `Args`."""
        return _input(_sample(self.domain, seed), dtype)

    def xs(self, n: int = BATCH, dtype: Any = np.float32) -> Any:
        """`n` inputs stacked on a leading axis (leaf by leaf; `_at(xs, i)`)."""
        samples = [_sample(self.domain, 10 + i) for i in range(n)]
        return _input(jtu.tree_map(lambda *a: np.stack(a), *samples), dtype)

    def f(self, rule: Any, x: Any) -> Any:
        return _call(rule, x, **self.kwargs)

    def reference(self, rule: Any, x: Any) -> Any:
        """A function whose plain autodiff derivative is the rule's (only for
        entries without `reference_vjp`)."""
        return _call(rule.reference_derivative, x, **self.kwargs)

    def truth(self, rule: Any, x: Any) -> Any:
        """The plain composition that higher derivatives are checked against."""
        if self.entry.reference_vjp:
            return _call(rule.reference_forward, x, **self.kwargs)
        return self.reference(rule, x)

    def reference_grads(self, rule: Any, x: Any, loss=_loss) -> Any:
        """The gradient of `loss(rule(x))` from the references, aligned with
        `_grads`: the plain derivative through `reference_derivative`, or
        `reference_vjp` with zero cotangents for the outputs `loss` ignores."""
        if not self.entry.reference_vjp:
            return _grads(self.reference, rule, x, loss)
        out = self.f(rule, x)
        ct = _fill(eqx.filter_grad(loss)(out), eqx.filter(out, eqx.is_inexact_array))
        ct_rule, *ct_x = _call(ft.partial(rule.reference_vjp, ct), x, **self.kwargs)
        ct_x = eqxrules.Args(ct_x) if self.several else ct_x[0]
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


@ft.cache
def _richest_output(entry: eqxrules.Entry) -> list[int]:
    """The example with the most output leaves (ties: the first), so that unused
    outputs receive `None` cotangents wherever an example has several."""
    return [_richest_index(entry)]


@ft.cache
def _richest_index(entry: eqxrules.Entry) -> int:
    """`_richest_output`'s index, once per entry. Evaluated at collection, so on the
    input's shape and dtype only: `Case.x()` is a float32 array of
    `case.domain.shape`, and `filter_eval_shape` traces it abstractly whatever its
    values, so the count is the one a sampled input gives (without the eager
    sampling, a compilation per new shape). A lone example is the richest without
    tracing it."""
    if len(_examples(entry)) == 1:
        return 0
    counts = []
    for i in range(len(_examples(entry))):
        case = Case(entry, i)
        out = eqx.filter_eval_shape(case.f, case.rule, _abstract(case.domain))
        counts.append(len(jtu.tree_leaves(out)))
    return int(np.argmax(counts))


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
        out = _call(self.rule, x, **self.kwargs)
        return {"out": out, "label": self.label, "count": self.count}
