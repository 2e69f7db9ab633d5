"""Where a rule's derivative is 0, its gradient is exactly 0, whatever else is
non-finite: an inf or NaN element anywhere in the input, in both modes, eager and
jitted, in float32, bfloat16 and float16 (issue 18 §2); and, for rules whose
derivative is a mask or a slope per element, an inf or NaN cotangent or tangent
too (masks select, they never multiply).

The zeros come from the rule's reference, per probe: the Jacobian of
`reference_derivative` in forward mode (column `i` is the tangent of `e_i`, so a
mask false at `i` gives exactly 0 there), or `reference_vjp` with a finite
cotangent. A column (for the VJP) or row (for the JVP) counts as zero when its
diagonal entry is exactly 0 and no other entry is finite and non-zero: the only
other entries such a column holds are the reference's own `0 · NaN` (a stopped
scale that is NaN, times a zero tangent), which is what the rules must not do.

0.2.0 failed this for `magnitude_aware_sign` in reverse mode: its tangent
`where(mask, t·scale, 0)` transposes into `where(mask, ct, 0)·scale`, and `0·NaN` is
NaN wherever the mask is 0 once one element of the channel is NaN or inf. The
planted defect below is that tangent, and the check must find it.
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
from conftest import CALL_KEY, ENTRIES, example_cases, examples

import eqxrules
from eqxrules.testing._tree import cast

F32, BF16, F16 = "float32", "bfloat16", "float16"
FINITE, POS_INF, NAN = "finite", "+inf", "nan"


def _example(entry, index):
    return examples(entry)[index]


def _own_maths(rule) -> bool:
    """No arrays or callables inside: the derivative is the rule's own formula, not
    the autodiff of a wrapped model or surrogate (whose `0 · inf` is its own)."""
    return not jtu.tree_leaves(rule.several if isinstance(rule, _Alone) else rule)


class _Alone(eqx.Module):
    """Input `j` of a rule of several inputs, the others held at a sample: the
    probes below see a rule of one input (each floating-point input in turn)."""

    several: Any
    others: Any
    j: int = eqx.field(static=True)

    def input_domain(self):
        return self.several.input_domain().domains[self.j]

    def call_kwargs(self, key):
        return self.several.call_kwargs(key)

    def _args(self, x):
        return (*self.others[: self.j], x, *self.others[self.j + 1 :])

    def __call__(self, x, **kwargs):
        return self.several(*self._args(x), **kwargs)

    def reference_derivative(self, x, **kwargs):
        return self.several.reference_derivative(*self._args(x), **kwargs)


def _probed(rule, dtype: str) -> list[Any]:
    """`rule`, or for a rule of several inputs one `_Alone` per floating-point
    input, the others drawn from their domains in `dtype`."""
    domain = rule.input_domain()
    if not isinstance(domain, eqxrules.Inputs):
        return [rule]
    others = cast(domain.sample(jax.random.key(1), jnp.float32), jnp.dtype(dtype))
    return [
        _Alone(rule, others, j)
        for j, d in enumerate(domain.domains)
        if not isinstance(d, eqxrules.Mask)
    ]


def _probes(rule, dtype: str) -> list[np.ndarray]:
    """The domain's kinks, a float either side of each, its ends and beyond, zero,
    as one input; then that input with its first or its last element +inf, -inf or
    NaN (which makes a scale such as a mean magnitude non-finite)."""
    d = rule.input_domain()
    f32 = np.float32
    pool = [f32(v) for v in (*d.kinks, d.low, d.high, d.low - 1, d.high + 1, 0.0)]
    pool += [np.nextafter(v, f32(s)) for v in pool[: len(d.kinks)] for s in (-1, 1)]
    size = int(np.prod(d.shape))
    base = np.resize(np.asarray(pool, f32), size)
    out = []
    for bad in (np.inf, -np.inf, np.nan):
        for where in (0, size - 1):
            x = base.copy()
            x[where] = bad
            out.append(x.reshape(d.shape).astype(jnp.dtype(dtype)))
    return out


def _flows(like) -> dict[str, object]:
    """The cotangents (or tangents) sent in, shaped like the pytree `like`: a
    finite one that is neither constant nor symmetric, and a non-finite one of
    each kind."""

    def finite(a):
        n = int(np.prod(a.shape, dtype=np.int64))
        return jnp.asarray(np.cos(np.arange(n) * 0.7 + 0.3).reshape(a.shape), a.dtype)

    return {
        FINITE: jtu.tree_map(finite, like),
        POS_INF: jtu.tree_map(lambda a: jnp.full(a.shape, np.inf, a.dtype), like),
        NAN: jtu.tree_map(lambda a: jnp.full(a.shape, np.nan, a.dtype), like),
    }


def _flat(tree) -> np.ndarray:
    """Every leaf of `tree`, raveled and joined, as float32 on the host."""
    leaves = [np.asarray(a, np.float32).reshape(-1) for a in jtu.tree_leaves(tree)]
    return np.concatenate(leaves)


def _zeros(jac: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """From the reference Jacobian `jac` (outputs × inputs): which columns and rows
    are zero, and whether it is diagonal (no finite non-zero entry off it)."""
    if jac.shape[0] != jac.shape[1]:
        return np.all(jac == 0, axis=0), np.all(jac == 0, axis=1), False
    off = ~np.eye(jac.shape[0], dtype=bool)
    live = np.isfinite(jac) & (jac != 0) & off
    zero_diag = np.diag(jac) == 0
    return zero_diag & ~live.any(axis=0), zero_diag & ~live.any(axis=1), not live.any()


def _has_reference_vjp(rule) -> bool:
    rule = rule.several if isinstance(rule, _Alone) else rule
    return type(rule).reference_vjp is not eqxrules.Rule.reference_vjp


def _reference(rule, kw, ct):
    """`xs ↦` per probe (the rows of `xs`), the reference's Jacobian, or, for a rule
    with `reference_vjp` (its backward is not a Jacobian), its cotangent for the
    finite `ct`."""
    if _has_reference_vjp(rule):
        return jax.vmap(lambda x: rule.reference_vjp(ct, x, **kw)[1])
    return jax.vmap(jax.jacfwd(lambda x: rule.reference_derivative(x, **kw)))


def _reference_zeros(rule, xs, reference):
    """Per probe: columns and rows that are zero, and whether the rule's derivative
    is one per element; for a rule with `reference_vjp`, the zeros of its
    cotangent."""
    if _has_reference_vjp(rule):
        return [(_flat(c) == 0, None, False) for c in _unstack(reference, len(xs))]
    n = xs[0].size
    out = []
    for j in _unstack(reference, len(xs)):
        rows = [np.asarray(a, np.float32).reshape(-1, n) for a in jtu.tree_leaves(j)]
        out.append(_zeros(np.concatenate(rows)))
    return out


def _unstack(tree, n: int) -> list:
    return [jtu.tree_map(lambda a, i=i: np.asarray(a)[i], tree) for i in range(n)]


def _flows_through(rule, forward_mode: bool):
    """`x ↦ (cotangents for each flow, tangents for each flow)` of `rule`."""
    kw = rule.call_kwargs(CALL_KEY)

    def run(x):
        out, pullback = jax.vjp(lambda x: rule(x, **kw), x)
        cts = {k: pullback(c)[0] for k, c in _flows(out).items()}
        if not forward_mode:
            return cts, {}
        ts = {
            k: jax.jvp(lambda x: rule(x, **kw), (x,), (t,))[1]
            for k, t in _flows(x).items()
        }
        return cts, ts

    return run


def non_zeros(rule, forward_mode: bool, dtype: str, ways=("eager", "jit")) -> list[str]:
    """Where `rule`'s reference derivative is 0 but its gradient (or tangent) is
    not exactly 0, eager or jitted, described. Finite flows are checked for every
    rule; non-finite ones where the derivative is one per element (a mask or a
    slope: those select, never multiply) and the rule's own maths (not a wrapped
    model's). The probes run as one batch (`vmap`), each of the `ways`."""
    kw = rule.call_kwargs(CALL_KEY)
    xs = jnp.asarray(np.stack(_probes(rule, dtype)))
    ct_finite = _flows(jax.eval_shape(lambda x: rule(x, **kw), xs[0]))[FINITE]
    reference = _reference(rule, kw, ct_finite)
    strict = _own_maths(rule)
    run = jax.vmap(_flows_through(rule, forward_mode))
    # Jitted, the reference and the flows are one program (compiling dominates).
    both = jax.jit(lambda xs: (reference(xs), run(xs)))
    zeros = None
    found = []
    for how in ways:
        if how == "jit":
            ref, flows = both(xs)
        else:
            ref, flows = (None if zeros else jax.jit(reference)(xs)), run(xs)
        zeros = zeros or _reference_zeros(rule, xs, ref)
        for i, (cts, ts) in enumerate(_unstack(flows, len(xs))):
            cols, rows, diagonal = zeros[i]
            x = np.asarray(xs[i], np.float32).reshape(-1)[[0, -1]]
            where = f"x={x} ({dtype}, {how})"
            for what, by_kind, zero in (
                ("cotangent", cts, cols),
                ("tangent", ts, rows),
            ):
                for kind, g in by_kind.items():
                    if kind != FINITE and not (strict and diagonal):
                        continue
                    g = _flat(g)[zero]
                    if np.any(g != 0):
                        bad = int(np.sum(g != 0))
                        found.append(
                            f"{what} for a {kind} flow at {where}: {bad} not 0"
                        )
    return found


# Jitted float32 runs with the quick tests; eager execution (a compilation per
# primitive and shape) and the low-precision dtypes run with the slow ones. Eager
# execution, where XLA cannot simplify `0 * nan` away across operations, is a
# property of the operations, not of their dtype: it runs in float32, and the
# low-precision dtypes run jitted (where a rule's casts and fusions differ).
NONFINITE_CASES = [
    pytest.param(
        *c.values,
        dtype,
        how,
        id=f"{c.id}-{dtype}-{how}",
        marks=[pytest.mark.slow] if (dtype, how) != (F32, "jit") else [],
    )
    for c in example_cases()
    for dtype, how in ((F32, "jit"), (F32, "eager"), (BF16, "jit"), (F16, "jit"))
]


@pytest.mark.first_entry_quick
@pytest.mark.parametrize("entry,index,dtype,how", NONFINITE_CASES)
def test_zero_derivative_stays_zero_beside_non_finite_values(entry, index, dtype, how):
    for rule in _probed(_example(entry, index), dtype):
        assert non_zeros(rule, entry.forward_mode, dtype, (how,)) == []


class _MultipliedScale(eqxrules.MagnitudeAwareSign):
    """The planted defect: 0.2.0's tangent, the scale multiplied in after the mask
    selects the tangent, so that its transpose multiplies a zero by a NaN scale."""

    def tangent(self, args, t_args, t_self, out, **kwargs):
        (x,), (t,) = args, t_args
        if t is None:
            return None
        scale = jnp.mean(jnp.abs(x), axis=tuple(range(x.ndim - 1)), keepdims=True)
        mask = jnp.abs(x) <= self.clip_value
        return jnp.where(mask, t * scale, jnp.zeros_like(t))


class _MultipliedMask(eqxrules.SteSign):
    """The planted defect: the clip mask multiplied in, not selected."""

    def tangent(self, args, t_args, t_self, out, **kwargs):
        (x,), (t,) = args, t_args
        return t * (jnp.abs(x) <= self.clip_value).astype(t.dtype)


@pytest.mark.first_case_quick
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_the_check_catches_0_2_0s_magnitude_aware_sign(dtype):
    found = non_zeros(_MultipliedScale(), True, dtype)
    for how in ("eager", "jit"):
        assert any(
            f.startswith("cotangent for a finite flow") and f"{how})" in f
            for f in found
        ), found
    # ... in reverse mode only: forward mode selected correctly in 0.2.0.
    assert not any(f.startswith("tangent") for f in found), found


def test_the_check_catches_a_multiplied_mask():
    found = non_zeros(_MultipliedMask(), True, F32)
    assert any(f.startswith("cotangent for a nan flow") for f in found), found
    assert any(f.startswith("tangent for a +inf flow") for f in found), found


@ft.cache
def _entry_of(cls):
    return next(e for e in ENTRIES if isinstance(_example(e, 0), cls))


def test_every_entry_is_probed():
    """The table above covers every example of every entry, in every dtype and
    mode: nothing is left out by name."""
    probed = {(p.values[0].name, p.values[1]) for p in NONFINITE_CASES}
    assert probed == {(e.name, i) for e in ENTRIES for i in range(len(examples(e)))}
    assert _entry_of(eqxrules.MagnitudeAwareSign).forward_mode
