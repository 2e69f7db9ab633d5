"""The checks: one small function each over the same `_Problem`, and `TABLE`, the
order they run and report in. A check returns its figures, or a string saying why
it did not apply (reported `"skipped"`); it raises `_Failure` when the rule is
wrong, and lets the rule's own exceptions through (`_Raised` says where)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from . import _programs
from ._compare import (
    _dtype_name,
    _Failure,
    _host_combination,
    _identity,
    _is_inexact,
    _is_none,
    _linear_expected,
    _lowest_precision,
    _max_abs,
    _scalar,
    _tolerance,
    _vdot,
)
from ._finite_differences import (
    FINITE_DIFFERENCE_TOLERANCES as FINITE_DIFFERENCE_TOLERANCES,
    _check_finite_differences,
    _float_or_none,
)
from ._groups import _Group
from ._host import _device, _random_like, _scaled, _zeros_like
from ._options import _Options as _Options, _Raised as _Raised, _where
from ._problem import _Problem

_BATCH = 3


def _check_primal(p: _Problem, o: _Options) -> dict[str, Any] | str:
    assert p.forward is not None
    # An infinite reference value is a value (a masked row's -inf): compared.
    return p.compare(
        p.f_jit(p.diff),
        p.forward_jit(p.diff),
        "out",
        reference=True,
        unchecked_inf=False,
    )


def _check_jvp(p: _Problem, o: _Options) -> dict[str, Any] | str:
    expected = p.reference_jvp_jit(p.diff, p.t)
    return p.compare(p.rule_jvp, expected, "jvp(out)", reference=True)


def _check_linearity(p: _Problem, o: _Options) -> dict[str, Any] | str:
    t2 = p.tangent(p.rng("t2"))
    combo = _device(jtu.tree_map(_host_combination, p.t, t2))
    j1, j2, j12 = p.rule_jvp, p.jvp_jit(p.diff, t2), p.jvp_jit(p.diff, combo)
    expected = jtu.tree_map(lambda a, b, c: _linear_expected(a, b, c)[0], j1, j2, j12)
    scale = jtu.tree_map(lambda a, b, c: _linear_expected(a, b, c)[1], j1, j2, j12)
    return p.compare(j12, expected, "jvp(out)", scale=scale)


def _check_vjp(p: _Problem, o: _Options) -> dict[str, Any] | str:
    figures = p.compare_args(
        p.project(p.rule_vjp),
        p.project(p.reference_vjp_value),
        check_dtype=False,
        reference=True,
    )
    # The cotangent scaled up and down, and to either side of each threshold the
    # caller names: a backward pass that is not linear in it (a clipped gradient)
    # is checked on both sides of its thresholds, and any other for overflow and
    # underflow.
    for scale in (*o.cotangent_scales, *_crossing(p.ct, o.cotangent_thresholds)):
        if scale == 1.0:
            continue
        ct = _scaled(p.ct, scale)
        with _where(f"with the cotangent times {scale:g}"):
            p.compare_args(
                p.project(p.vjp_jit(p.diff, ct)),
                p.project(p.reference_vjp_jit(p.diff, ct)),
                check_dtype=False,
                reference=True,
                atol_scale=scale,
            )
    return figures


def _crossing(ct: Any, thresholds: Sequence[float]) -> list[float]:
    """Scales of `ct` that put its largest element at half and twice each
    threshold, and its norm at 0.9 and 1.1 times it: either side of a threshold
    on an element (an elementwise clip: the elements then spread on both sides)
    or on the norm (a clip of the norm), close enough that a threshold 10% out
    of place is seen."""
    leaves = [np.abs(np.asarray(c, np.float64)) for c in _inexact(ct)]
    largest = max((float(c.max()) for c in leaves if c.size), default=0.0)
    norm = float(np.sqrt(sum(float(np.sum(c**2)) for c in leaves)))
    scales = []
    for t in (abs(float(t)) for t in thresholds):
        if not (np.isfinite(t) and t > 0 and largest > 0):
            continue
        scales += [t / 2 / largest, 2 * t / largest, 0.9 * t / norm, 1.1 * t / norm]
    return scales


def _check_transpose(p: _Problem, o: _Options) -> dict[str, Any] | str:
    lhs, s1 = _vdot(p.ct, p.rule_jvp)
    rhs, s2 = _vdot(p.rule_vjp, p.t)
    r, a = _tolerance(_lowest_precision(p.diff, p.out_shape), p.rtol, p.atol)
    holds, figures = _identity(
        lhs, s1, rhs, s2, path="<ct, J t> vs <J^T ct, t>", rtol=r, atol=a
    )
    if holds is None:
        raise _Failure(
            f"nothing compared: <ct, J t> = {lhs} and <J^T ct, t> = {rhs}, neither "
            "finite, so the identity would hold whatever the rule gave",
            **figures,
        )
    if not holds:
        raise _Failure(
            f"the rule's JVP and VJP are not transposes: <ct, J t> = {lhs:.6g} but "
            f"<J^T ct, t> = {rhs:.6g}",
            **figures,
        )
    return figures


def _held_fixed(p: _Problem, group: _Group, mode: str, full: Any, t: Any, ct: Any):
    """The rule's JVP along `group`'s part of `t`, or its cotangent for `group`
    alone. `full` is an argument of the program, not a tangent: the rule receives
    symbolic-zero (`None`) tangents for everything but `group`."""

    def f(part: Any) -> Any:
        return p.f(group.put(full, part))

    if mode == "JVP":
        return jax.jvp(f, (group.get(full),), (group.get(t),))[1]
    _, pullback = jax.vjp(f, group.get(full))
    return pullback(ct)[0]


def _check_held_fixed(p: _Problem, o: _Options) -> dict[str, Any] | str:
    modes = ["JVP"] if "fwd" in o.modes and p.forward_mode() is not False else []
    modes += ["VJP"] if "rev" in o.modes else []
    jobs = [(group, mode) for group in p.groups for mode in modes]
    t = p.t if "JVP" in modes else None
    ct = p.ct if "VJP" in modes else None

    def run(jobs: list[tuple[_Group, str]]) -> Callable[..., Any]:
        return _programs.jit(
            lambda full, t, ct: [_held_fixed(p, g, m, full, t, ct) for g, m in jobs]
        )

    try:
        # One program for every group and mode: compiling dominates.
        actuals = run(jobs)(p.diff, t, ct)
    except Exception:
        actuals = None  # the rule raised in one of them: which, is found below
    worst: dict[str, Any] = {}
    for i, (group, mode) in enumerate(jobs):
        with _where(f"{mode} with only `{group.label}` perturbed, the rest held fixed"):
            actual = run([jobs[i]])(p.diff, t, ct)[0] if actuals is None else actuals[i]
            if mode == "JVP":
                # By linearity the reference is its full JVP along zeros elsewhere
                # (or, with no `derivative`, the rule's own): no new program.
                along = group.put(_zeros_like(p.t), group.get(p.t))
                jvp = p.reference_jvp_jit if p.derivative is not None else p.jvp_jit
                worst = p.compare(
                    actual,
                    jvp(p.diff, along),
                    "jvp(out)",
                    reference=p.derivative is not None,
                )
            else:
                # The reference's cotangent (or, with no reference, the rule's own
                # with every argument perturbed) for this group alone.
                full = p.reference_vjp_value if p.has_reference else p.rule_vjp
                expected = group.get(full)
                worst = p.compare_args(
                    p.project(actual, group.path),
                    p.project(expected, group.path),
                    at=group.path,
                    check_dtype=False,
                    reference=p.has_reference,
                )
    return worst


def _stack(trees: Sequence[Any]) -> Any:
    return _device(
        jtu.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)
    )


@np.errstate(all="ignore")
def _check_batching(p: _Problem, o: _Options) -> dict[str, Any] | str:
    rng = p.rng("batch")
    ds = [p.diff] + [
        _device(
            jtu.tree_map(
                lambda x, n: np.asarray(x) + (np.asarray(n) / 20).astype(x.dtype),
                p.diff,
                p.tangent(rng),  # a step within the arguments' tangent spaces
            )
        )
        for _ in range(1, _BATCH)
    ]
    cts = [p.ct] + [_random_like(rng, p.out_shape) for _ in range(1, _BATCH)]
    cts = [_drop_float0(c) for c in cts]
    ts = [p.t] + [p.tangent(rng) for _ in range(1, _BATCH)]
    D, CT, T = _stack(ds), _stack(cts), _stack(ts)

    def vjp(d: Any, ct: Any) -> Any:
        return p.vjp(d, _restore_float0(ct, p.ct))

    forward = "fwd" in o.modes and p.forward_mode()
    both = None
    if forward:
        # One program for both modes (compiling dominates); apart if it raises.
        try:
            both = _programs.jit(jax.vmap(lambda d, ct, t: (vjp(d, ct), p.jvp(d, t))))(
                D, CT, T
            )
        except Exception:
            both = None
    batched_vjp = _programs.jit(jax.vmap(vjp))(D, CT) if both is None else both[0]
    looped = _stack([p.vjp_jit(d, _restore_float0(c, p.ct)) for d, c in zip(ds, cts)])
    worst = p.compare_args(batched_vjp, looped, "vmap(vjp)({})", point=D)
    if forward:
        looped = _stack([p.jvp_jit(d, t) for d, t in zip(ds, ts)])
        batched_jvp = _programs.jit(jax.vmap(p.jvp))(D, T) if both is None else both[1]
        p.compare(
            jtu.tree_map(_float_or_none, batched_jvp),
            jtu.tree_map(_float_or_none, looped),
            "vmap(jvp)(out)",
            point=D,
        )
    return worst


def _drop_float0(tree: Any) -> Any:
    return jtu.tree_map(
        lambda x: None if jnp.result_type(x) == jax.dtypes.float0 else x, tree
    )


def _restore_float0(tree: Any, like: Any) -> Any:
    return jtu.tree_map(
        lambda x, lk: lk if x is None else x, tree, like, is_leaf=_is_none
    )


def _check_jit(p: _Problem, o: _Options) -> dict[str, Any] | str:
    worst = p.compare(p.f_jit(p.diff), p.out, "jit(out)")
    p.compare_args(p.rule_vjp, p.vjp(p.diff, p.ct), "jit(vjp)({})")
    return worst


def _check_zero_cotangent(p: _Problem, o: _Options) -> dict[str, Any] | str:
    zeros = _device(
        jtu.tree_map(lambda c: np.zeros_like(c) if eqx.is_inexact_array(c) else c, p.ct)
    )
    grads = p.vjp_jit(p.diff, zeros)
    points = jtu.tree_leaves(p.diff)
    # With `where_reference_nan="any"`, NaN is allowed where the reference's own
    # VJP of the zero cotangent is NaN (its `0 · inf`); any other non-zero fails.
    allowed: list[Any] = [None] * len(points)
    if p.unchecked_nan and p.has_reference:
        if any(np.any(np.isnan(np.asarray(g))) for g in _inexact(grads)):
            reference = p.reference_vjp_jit(p.diff, zeros)
            allowed = [np.isnan(np.asarray(r)) for r in jtu.tree_leaves(reference)]
    leaves = jtu.tree_flatten_with_path(grads)[0]
    for (path, g), x, nan_ok in zip(leaves, points, allowed):
        g = np.asarray(g)
        if g.dtype == jax.dtypes.float0:
            continue
        nonzero = g != 0
        if nan_ok is not None:
            nonzero &= ~(np.isnan(g) & nan_ok)
        if np.any(nonzero):
            flat = int(np.argmax(nonzero.reshape(-1)))
            value = g.reshape(-1)[flat].item()
            index = tuple(int(i) for i in np.unravel_index(flat, g.shape))
            raise _Failure(
                "a zero cotangent gave a non-zero gradient "
                f"({'NaN' if np.any(np.isnan(g)) else 'non-zero values'})",
                path=p.arg_name(path),
                max_abs_error=_max_abs(g),
                index=index,
                actual=value if isinstance(value, complex) else float(value),
                expected=0.0,
                max_rel_error=float("inf"),  # relative to 0
                inputs={p.arg_name(path): _scalar(np.asarray(x)[index])},
            )
    return {}


def _inexact(tree: Any) -> list[Any]:
    return [g for g in jtu.tree_leaves(tree) if _is_inexact(g)]


def _check_dtype(p: _Problem, o: _Options) -> dict[str, Any] | str:
    grads = p.rule_vjp
    pairs: Iterable[tuple[str, Any, Any]] = [
        (p.arg_name(path), g, x)
        for (path, x), g in zip(
            jtu.tree_flatten_with_path(p.diff)[0], jtu.tree_leaves(grads)
        )
    ]
    if "fwd" in o.modes and p.forward_mode():
        jt = p.rule_jvp
        pairs = [
            *pairs,
            *(
                ("jvp(out)" + jtu.keystr(path), t, o)
                for (path, o), t in zip(
                    jtu.tree_flatten_with_path(p.out_shape)[0], jtu.tree_leaves(jt)
                )
                if _is_inexact(o)
            ),
        ]
    for where, got, want in pairs:
        if _dtype_name(got) != _dtype_name(want):
            raise _Failure(
                f"the (co)tangent has dtype {_dtype_name(got)} but its primal has "
                f"dtype {_dtype_name(want)}",
                path=where,
            )
    return {}


def _check_second_order(p: _Problem, o: _Options) -> dict[str, Any] | str:
    worst: dict[str, Any] = {}
    if "fwd" in o.modes and p.forward_mode() is not False:
        expected = p.second_order_jit("reference_jvp_of_vjp")(p.diff, p.ct, p.t)
        with _where("JVP of VJP"):
            actual = p.second_order_jit("jvp_of_vjp")(p.diff, p.ct, p.t)
            worst = _compare_second(p, actual, expected, "jvp(vjp)({})")
    expected = p.second_order_jit("reference_vjp_of_vjp")(p.diff, p.ct, p.u)
    with _where("VJP of VJP"):
        actual = p.second_order_jit("vjp_of_vjp")(p.diff, p.ct, p.u)
        figures = _compare_second(p, actual, expected, "vjp(vjp)({})")
    return worst or figures


def _compare_second(p: _Problem, actual: Any, expected: Any, name: str) -> Any:
    """Second derivatives compared leaf by leaf, each element within `rtol` of the
    leaf's largest second derivative or first-order cotangent, whichever is the
    larger. A second derivative is the derivative of the VJP: it sums products of
    the VJP's factors (of the size of the VJP itself, for the derivatives of order
    one the catalogue's rules have) and their derivatives, and in floating point
    errs by ulps of those products, not of its result, which cancellation can
    make arbitrarily small (an even slope's derivative at 0: SignSwish's,
    computed 1.2e-6 from 0 by its reference in float32 at x = 1e-30, beside a VJP
    of about 10). A second derivative that is wrong (killed by a
    `stop_gradient`, halved, NaN) is wrong by the size of the leaf's largest."""
    expected, actual = p.project(expected), p.project(actual)
    first = p.project(p.rule_vjp)
    scale = jtu.tree_map(
        lambda e, v: np.full(np.shape(e), max(_max_finite(e), _max_finite(v))),
        expected,
        first,
    )
    return p.compare_args(
        actual, expected, name, check_dtype=False, reference=True, scale=scale
    )


def _max_finite(x: Any) -> float:
    a = np.abs(np.asarray(x, np.float64))
    finite = a[np.isfinite(a)]
    return float(finite.max()) if finite.size else 0.0


def _no_forward(p: _Problem, o: _Options) -> str | None:
    return None if p.forward is not None else "no `forward` reference given"


def _no_derivative(p: _Problem, o: _Options) -> str | None:
    return None if p.derivative is not None else "no `derivative` reference given"


def _no_reference(p: _Problem, o: _Options) -> str | None:
    if p.has_reference:
        return None
    return "no `derivative` or `reference_vjp` reference given"


def _one_mode(p: _Problem, o: _Options) -> str | None:
    return None if "rev" in o.modes else "needs both modes"


def _one_group(p: _Problem, o: _Options) -> str | None:
    if len(p.groups) > 1:
        return None
    return "one differentiable argument: perturbing it alone is `jvp` and `vjp`"


def _not_true_derivative(p: _Problem, o: _Options) -> str | None:
    if o.finite_differences:
        return None
    return "not a true derivative (or a reference was given)"


def _first_order(p: _Problem, o: _Options) -> str | None:
    if o.order < 2:
        return "`order=1` (pass `order=2` to check second derivatives)"
    if p.has_reference or (o.finite_differences and p.forward is not None):
        return None
    return (
        "no reference for second derivatives: give `derivative` or "
        "`reference_vjp` (or `forward`, for a true derivative)"
    )


_FWD, _REV, _EITHER = ("fwd",), ("rev",), ("fwd", "rev")


@dataclasses.dataclass(frozen=True)
class _Check:
    """`run`: the check. `needs`: the modes it can run in (`()`: no derivative),
    so it does not apply if none of them is asked for. `skip`: why it does not
    apply to this problem, if it does not."""

    run: Callable[[_Problem, _Options], dict[str, Any] | str]
    needs: tuple[str, ...] = ()
    skip: Callable[[_Problem, _Options], str | None] | None = None

    def forward_only(self, modes: Sequence[str]) -> bool:
        """Whether, with `modes` asked for, it runs in forward mode alone (so is
        "unsupported" for a rule without forward mode)."""
        return [m for m in self.needs if m in modes] == ["fwd"]


TABLE: dict[str, _Check] = {
    "primal": _Check(_check_primal, (), _no_forward),
    "jvp": _Check(_check_jvp, _FWD, _no_derivative),
    "linearity": _Check(_check_linearity, _FWD),
    "vjp": _Check(_check_vjp, _REV, _no_reference),
    "transpose": _Check(_check_transpose, _FWD, _one_mode),
    "held_fixed": _Check(_check_held_fixed, _EITHER, _one_group),
    "finite_differences": _Check(
        _check_finite_differences, _EITHER, _not_true_derivative
    ),
    "batching": _Check(_check_batching, _REV),
    "jit": _Check(_check_jit, _REV),
    "zero_cotangent": _Check(_check_zero_cotangent, _REV),
    "dtype": _Check(_check_dtype, _REV),
    "second_order": _Check(_check_second_order, _REV, _first_order),
}
