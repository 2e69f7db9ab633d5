"""The baselines every rule is measured against, built generically from the rule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

import eqxrules
from eqxrules._domain import call

from . import learned
from .double_where import DOUBLE_WHERE

VARIANTS = ("eqxrules", "hand", "hand_ref", "trick")
VARIANT_NAMES = {
    "eqxrules": "eqxrules",
    "hand": "hand-written, same maths",
    "hand_ref": "hand-written from the references",
    "trick": "stop_gradient trick",
    "trick_same": "stop_gradient trick, the rule's own rounding",
    "quantized_hand": "`Quantized` + hand-written rule",
    "formula_0_1_0": "the 0.1.0 grid formula (`x - lo` first), hand-written",
}


def build_variants(rule: Any, kwargs: dict[str, Any]) -> dict[str, Callable]:
    """`{variant: fn(dyn, x)}` for one rule instance, where `dyn` holds the rule's
    floating-point arrays (a wrapped sub-model's parameters, say):

    - `eqxrules`: the rule as shipped, `rule(x)`;
    - `hand`: a plain `jax.custom_jvp` (or `custom_vjp`) calling the rule's own
      `primal` and `tangent` (`fwd`/`bwd`): what the mechanism must cost no more than;
    - `hand_ref`: a plain `jax.custom_jvp` whose value is `reference_forward` and whose
      tangent is `jax.jvp` of `reference_derivative` (or a `custom_vjp` calling
      `reference_vjp`): the rule written by hand from its independent references;
    - `trick`: `d + stop_gradient(f - d)` with `f = reference_forward` and
      `d = reference_derivative`, where the rule has a `reference_derivative`; for
      a learned quantiser, the formulation users write today instead
      (`benchmarks.learned.USER_TRICKS`); for a NaN-safe rule, the double where
      (`benchmarks.double_where.DOUBLE_WHERE`);
    - `formula_0_1_0`, for the static-grid quantisers only: a plain `jax.custom_jvp`
      with the rule's tangent and the value of eqxrules 0.1.0 (index from `x - lo`,
      level from `lo + (hi - lo) k / n`), which is cheaper but not exact: what the
      exact grid costs.
    - `trick_same`: the same with `f` the rule's own `primal` (the same rounding).
    """
    _, static = eqx.partition(rule, eqx.is_inexact_array)
    kw = dict(kwargs)

    def rebuild(dyn: Any) -> Any:
        return eqx.combine(dyn, static)

    def ours(dyn, x):
        return call(rebuild(dyn), x, **kw)

    variants: dict[str, Callable] = {"eqxrules": ours}
    if isinstance(rule, eqxrules.JVPRule):
        variants["hand"] = _hand_jvp(rebuild, kw)
    else:
        variants["hand"] = _hand_vjp(rebuild, kw)
    has_derivative = (
        type(rule).reference_derivative is not eqxrules.Rule.reference_derivative
    )
    if has_derivative:
        variants["hand_ref"] = _ref_jvp(rebuild, kw)

        def trick_around(value: str) -> Callable:
            # `d + stop_gradient(f - d)`, with `f` the rule's method `value`.
            def trick(dyn, x):
                r = rebuild(dyn)
                d = call(r.reference_derivative, x, **kw)
                f = call(getattr(r, value), x, **kw)
                return jtu.tree_map(lambda d, f: d + jax.lax.stop_gradient(f - d), d, f)

            return trick

        variants["trick"] = trick_around("reference_forward")
        user = learned.USER_TRICKS.get(type(rule)) or DOUBLE_WHERE.get(type(rule))
        if user is not None:
            variants["trick"] = user(rule)
        # The same trick around the rule's own value: the same rounding.
        variants["trick_same"] = trick_around("primal")
    else:
        variants["hand_ref"] = _ref_vjp(rebuild, kw)
    grid = _grid(rule)
    if grid is not None:
        variants["formula_0_1_0"] = _formula_0_1_0(rebuild, kw, *grid)
    return variants


def _grid(rule: Any) -> tuple[int, float, float] | None:
    if isinstance(rule, eqxrules.SteQuantize):
        return rule.bits, float(rule.lo), float(rule.hi)
    if isinstance(rule, eqxrules.DoReFa):
        return rule.bits, 0.0, 1.0
    return None


def _formula_0_1_0(rebuild: Callable, kw: dict[str, Any], bits, lo, hi) -> Callable:
    n = 2**bits - 1

    def value(dyn, x):
        # eqxrules 0.1.0's `_quantize`, with the rule's own mask.
        inside = rebuild(dyn).slope(x)
        w = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        u = jnp.where(inside, w, jnp.clip(w, lo, hi))
        k = jnp.round((u - lo) * (n / (hi - lo)))
        return (lo + (hi - lo) * (k / n)).astype(x.dtype)

    def tangent(primals, tangents, out):
        (dyn, x), (t_dyn, t_x) = primals, tangents
        t = rebuild(dyn).tangent((x,), (t_x,), t_dyn, out, **kw)
        return _instantiate(t, out)

    return _custom_jvp(value, tangent)


def _custom_jvp(value: Callable, tangent: Callable) -> Callable:
    """A plain `jax.custom_jvp` of `(dyn, x)`: `tangent(primals, tangents, out)`."""
    f = jax.custom_jvp(value)
    f.defjvp(lambda primals, tangents: _with_tangent(value, tangent, primals, tangents))
    return f


def _with_tangent(value, tangent, primals, tangents):
    out = value(*primals)
    return out, tangent(primals, tangents, out)


def _hand_jvp(rebuild: Callable, kw: dict[str, Any]) -> Callable:
    def tangent(primals, tangents, out):
        (dyn, x), (t_dyn, t_x) = primals, tangents
        t = rebuild(dyn).tangent(_args(x), _args(t_x, x), t_dyn, out, **kw)
        return _instantiate(t, out)

    return _custom_jvp(lambda dyn, x: call(rebuild(dyn).primal, x, **kw), tangent)


def _ref_jvp(rebuild: Callable, kw: dict[str, Any]) -> Callable:
    def tangent(primals, tangents, out):
        derivative = lambda d, x: call(rebuild(d).reference_derivative, x, **kw)  # noqa: E731
        return jax.jvp(derivative, primals, tangents)[1]

    return _custom_jvp(
        lambda dyn, x: call(rebuild(dyn).reference_forward, x, **kw), tangent
    )


def _args(x: Any, like: Any = None) -> tuple[Any, ...]:
    """The arguments of a rule's `tangent`: `(x,)`, or each input of the `Args` of
    a rule of several (a boolean input's float0 tangent as `None`, as
    `eqx.filter_custom_jvp` gives it)."""
    like = x if like is None else like
    if not isinstance(like, eqxrules.Args):
        return (x,)
    return tuple(
        None if getattr(t, "dtype", None) == jax.dtypes.float0 else t for t in x
    )


def _instantiate(t: Any, like: Any) -> Any:
    """A JVP rule's tangent with `None` (symbolic zero) made explicit zeros, as a
    plain `jax.custom_jvp` rule must return."""
    if t is None:
        return jtu.tree_map(jnp.zeros_like, like)
    return jtu.tree_map(
        lambda t, o: jnp.zeros_like(o) if t is None else t,
        t,
        like,
        is_leaf=lambda v: v is None,
    )


def _hand_vjp(rebuild: Callable, kw: dict[str, Any]) -> Callable:
    # Saves exactly what the rule's `fwd` returns, plus `x` only if its `bwd` reads
    # the arguments (as a careful hand-written `custom_vjp` would).
    shapes: dict[str, Any] = {}

    def make(lean: bool) -> Callable:
        def fwd(dyn, x):
            out, res = rebuild(dyn).fwd(x, **kw)
            shapes["x"] = jax.eval_shape(lambda: x)
            return out, (res, dyn, None if lean else x)

        def bwd(saved, ct):
            res, dyn, x = saved
            (ct_x,) = rebuild(dyn).bwd(res, ct, (x,), **kw)
            if ct_x is None:
                ct_x = jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["x"])
            return jtu.tree_map(jnp.zeros_like, dyn), ct_x

        f = jax.custom_vjp(lambda dyn, x: rebuild(dyn).primal(x, **kw))
        f.defvjp(fwd, bwd)
        return f

    lean, full = make(True), make(False)

    def f(dyn, x):
        try:
            jax.eval_shape(jax.grad(lambda x: total(lean(dyn, x))), x)
        except Exception:
            return full(dyn, x)
        return lean(dyn, x)

    return f


def _ref_vjp(rebuild: Callable, kw: dict[str, Any]) -> Callable:
    def fwd(dyn, x):
        return rebuild(dyn).reference_forward(x, **kw), (dyn, x)

    def bwd(saved, ct):
        dyn, x = saved
        _, ct_x = rebuild(dyn).reference_vjp(ct, x, **kw)
        return jtu.tree_map(jnp.zeros_like, dyn), ct_x

    f = jax.custom_vjp(lambda dyn, x: rebuild(dyn).reference_forward(x, **kw))
    f.defvjp(fwd, bwd)
    return f


def total(tree: Any) -> Any:
    """The sum of every floating-point leaf, in float32."""
    return sum(
        jnp.sum(x.astype(jnp.float32))
        for x in jtu.tree_leaves(tree)
        if eqx.is_inexact_array(x)
    )
