"""Comparing a rule's (co)tangents with their references, on the host in NumPy.

Every function here that does arithmetic runs under `np.errstate(all="ignore")`:
infinities and NaNs in the values compared are data, not errors, and a NumPy warning
raised by the checker's own arithmetic must never be mistaken for (or, under
`filterwarnings = error`, turn into) a failure of the rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-9, 1e-9),
    "float32": (1e-5, 1e-6),
    "float16": (4e-3, 4e-3),
    "bfloat16": (4e-2, 4e-2),
}
"""`(rtol, atol)` per dtype. An element passes when `|actual - expected| <= atol +
rtol * |expected|`. About four units in the last place for the low-precision types,
where the rule and its reference may round in a different order."""


KeyPath = tuple[Any, ...]
"""A leaf's path in a pytree, as `jax.tree_util.tree_flatten_with_path` gives it."""

Inputs = Callable[[KeyPath, tuple[int, ...], tuple[int, ...]], dict[str, Any]]
"""`inputs(path, shape, index)`: the input elements, by argument name, behind the
element at `index` of the compared leaf at `path` (of shape `shape`)."""


class _Failure(Exception):
    def __init__(self, detail: str, **figures: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.figures = figures


def _dtype_name(x: Any) -> str:
    return jnp.dtype(x.dtype if hasattr(x, "dtype") else jnp.result_type(x)).name


def _tolerance(dtype_name: str, rtol: float | None, atol: float | None):
    r, a = DEFAULT_TOLERANCES.get(dtype_name, DEFAULT_TOLERANCES["float32"])
    return (r if rtol is None else rtol), (a if atol is None else atol)


def _is_none(x: Any) -> bool:
    return x is None


def _is_inexact(x: Any) -> bool:
    """An inexact array, or the shape and dtype of one (`jax.ShapeDtypeStruct`)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return bool(jnp.issubdtype(x.dtype, jnp.inexact))
    return eqx.is_inexact_array(x)


def _x64() -> bool:
    return jax.dtypes.canonicalize_dtype(jnp.float64) == jnp.float64


def _lowest_precision(*trees: Any) -> str:
    order = ["bfloat16", "float16", "float32", "float64"]
    names = [
        _dtype_name(x) for t in trees for x in jtu.tree_leaves(t) if _is_inexact(x)
    ]
    ranked = [n for n in order if n in names]
    return ranked[0] if ranked else "float32"


def _scalar(x: Any) -> complex | float:
    x = x.item()
    return x if isinstance(x, complex) else float(x)


def _element(actual: np.ndarray, expected: np.ndarray, flat: int) -> dict[str, Any]:
    """The figures naming one element: its index, and both sides' values there."""
    index = tuple(int(i) for i in np.unravel_index(flat, actual.shape))
    return dict(
        index=index,
        actual=_scalar(actual.reshape(-1)[flat]),
        expected=_scalar(expected.reshape(-1)[flat]),
    )


def _failure(
    detail: str,
    inputs: Inputs | None,
    keypath: KeyPath,
    shape: tuple[int, ...],
    **figures: Any,
) -> _Failure:
    """A failure at one element of the leaf at `keypath`, with the input elements
    behind it if `inputs` can say."""
    if inputs is not None and figures.get("index") is not None:
        figures["inputs"] = inputs(keypath, shape, figures["index"])
    return _Failure(detail, **figures)


@np.errstate(all="ignore")
def _compare(
    actual: Any,
    expected: Any,
    *,
    prefix: str | Callable[[KeyPath], str],
    rtol: float | None,
    atol: float | None,
    scale: Any = None,
    check_dtype: bool = True,
    floor: str | None = None,
    inputs: Inputs | None = None,
    unchecked_nan: bool = False,
    unchecked_inf: bool = False,
    atol_scale: float = 1.0,
) -> dict[str, Any]:
    """Fail (raise `_Failure`) unless every leaf agrees. Returns the figures: the
    leaf with the largest absolute error, and its worst element, and `compared`,
    how many elements were compared (both sides finite).

    `prefix` names a leaf by its path: a string is followed by the path
    (`"jvp(out)['a']"`), a function gives the whole name. A failure at an element
    carries `inputs` there, if given. NaN must be where `expected` has NaN, and
    only there; with `unchecked_nan`, an element where `expected` is NaN is not
    compared (the reference says nothing there), and NaN elsewhere still fails.
    With `unchecked_inf` too, an element where `expected` is infinite is not
    compared either (a reference's derivative overflowing where the rule's need
    not). Where `expected` is finite, `actual` must be too. A comparison that compares
    no element (none finite on both sides) fails: it would pass whatever the
    rule gave. `atol_scale` multiplies the absolute tolerance (for values scaled
    by it)."""
    name = prefix if callable(prefix) else (lambda path: prefix + jtu.keystr(path))
    a_leaves, a_def = jtu.tree_flatten_with_path(actual, is_leaf=_is_none)
    e_leaves, e_def = jtu.tree_flatten_with_path(expected, is_leaf=_is_none)
    if a_def != e_def:
        raise _Failure(
            f"the pytree structure differs from the reference's: {a_def} vs {e_def}",
            path=name(()),
        )
    s_leaves = (
        [None] * len(a_leaves)
        if scale is None
        else jtu.tree_leaves(scale, is_leaf=_is_none)
    )
    worst: dict[str, Any] = dict(
        path="", max_abs_error=0.0, max_rel_error=0.0, rtol=0.0, atol=0.0
    )
    compared, elements = 0, 0
    for (path, a), (_, e), s in zip(a_leaves, e_leaves, s_leaves):
        where = name(path)
        if a is None or e is None:
            if a is not e:
                raise _Failure("one side is None, the other is not", path=where)
            continue
        if jnp.shape(a) != jnp.shape(e):
            raise _Failure(
                f"shape {jnp.shape(a)} differs from the reference's {jnp.shape(e)}",
                path=where,
            )
        if check_dtype and _dtype_name(a) != _dtype_name(e):
            raise _Failure(
                f"dtype {_dtype_name(a)} differs from the reference's {_dtype_name(e)}",
                path=where,
            )
        if _dtype_name(e) == "float0":
            continue
        r, t = _tolerance(_dtype_name(e), rtol, atol)
        if floor is not None:
            fr, ft_ = _tolerance(floor, rtol, atol)
            r, t = max(r, fr), max(t, ft_)
        t *= atol_scale
        complex_ = jnp.issubdtype(jnp.result_type(a), jnp.complexfloating)
        wide = (np.complex128 if complex_ else np.float64) if _x64() else np.float32
        an = np.asarray(a).astype(wide)
        en = np.asarray(e).astype(an.dtype)
        sn = np.abs(en) if s is None else np.abs(np.asarray(s)).astype(np.float64)
        a_nan, e_nan = np.isnan(an), np.isnan(en)
        silent = e_nan | (np.isinf(en) if unchecked_inf else False)
        mismatch = (a_nan & ~silent) if unchecked_nan else (a_nan != e_nan)
        if np.any(mismatch):
            rule_nan = a_nan & ~e_nan
            flat = int(np.argmax((rule_nan if np.any(rule_nan) else mismatch).ravel()))
            there = en.reshape(-1)[flat]
            if not np.any(rule_nan):
                finite = np.isfinite(an.reshape(-1)[flat])
                which = f"{'' if finite else 'in'}finite where the reference is NaN"
            elif np.isfinite(there):
                which = "NaN where the reference is finite"
            else:
                which = "NaN where the reference is infinite"
            element = _element(an, en, flat)
            raise _failure(
                which, inputs, path, an.shape, path=where, rtol=r, atol=t, **element
            )
        lost = np.isinf(an) & np.isfinite(en)
        if np.any(lost):
            flat = int(np.argmax(lost.reshape(-1)))
            element = _element(an, en, flat)
            raise _failure(
                "infinite where the reference is finite",
                inputs,
                path,
                an.shape,
                path=where,
                rtol=r,
                atol=t,
                max_abs_error=float("inf"),
                max_rel_error=float("inf"),
                **element,
            )
        both = np.isfinite(an) & np.isfinite(en)
        compared += int(both.sum())
        elements += an.size
        same_inf = np.isinf(an) & (an == en)
        err = np.where(a_nan | silent | same_inf, 0.0, np.abs(an - en))
        err = np.where(np.isnan(err), np.inf, err)
        bound = t + r * np.where(np.isinf(sn), 0.0, sn)
        rel = np.where(np.abs(en) > 0, err / np.abs(en), np.where(err > 0, np.inf, 0))
        rel = np.where(np.isnan(rel), np.inf, rel)  # inf / inf: no relative error
        abs_max = float(err.max()) if err.size else 0.0
        rel_max = float(rel.max()) if rel.size else 0.0
        bad = err > bound
        # The worst element: the largest error among those out of tolerance.
        flat = int(np.argmax(np.where(bad, err, -1.0))) if err.size else 0
        figures = dict(
            path=where, max_abs_error=abs_max, max_rel_error=rel_max, rtol=r, atol=t
        )
        if err.size:
            figures.update(_element(an, en, flat))
        if abs_max >= worst["max_abs_error"]:
            worst = figures
        if np.any(bad):
            raise _failure(
                "values differ from the reference beyond tolerance",
                inputs,
                path,
                an.shape,
                **figures,
            )
    if elements and not compared:
        raise _Failure(
            f"nothing compared: of {elements} element(s), none is finite in both "
            "the rule's values and the reference's (NaN or infinite wherever the "
            "reference is), so the comparison would pass whatever the rule gave",
            path=name(()),
            compared=0,
        )
    return {**worst, "compared": compared}


@np.errstate(all="ignore")
def _vdot(a: Any, b: Any) -> tuple[float, float]:
    """`<a, b>` over the inexact leaves the two trees hold at the same path, in
    float64 NumPy, and `sum |a * b|`. Leaves are paired by their path, never by
    position: `None` and integer leaves (dropped on one side, kept as float0 on
    the other) cannot shift the pairing."""
    others = dict(jtu.tree_flatten_with_path(b, is_leaf=_is_none)[0])
    total, scale = 0.0, 0.0
    for path, x in jtu.tree_flatten_with_path(a, is_leaf=_is_none)[0]:
        y = others.get(path)
        if not (_is_inexact(x) and _is_inexact(y)):
            continue
        xy = np.asarray(x, np.float64) * np.asarray(y, np.float64)
        total += float(xy.sum())
        scale += float(np.abs(xy).sum())
    return total, scale


@np.errstate(all="ignore")
def _identity(
    lhs: float, s1: float, rhs: float, s2: float, **figures: Any
) -> tuple[bool | None, dict[str, Any]]:
    """Whether `lhs` (a sum of products whose absolute values sum to `s1`) equals
    `rhs` within `atol + rtol * (s1 + s2)` (`None` if neither side is finite: the
    identity then compares nothing), and the figures."""
    error = abs(lhs - rhs)
    relative = error / max(abs(lhs), 1e-30)
    figures.update(
        max_abs_error=float("inf") if np.isnan(error) else error,
        max_rel_error=float("inf") if np.isnan(relative) else relative,
        actual=rhs,
        expected=lhs,
        compared=int(bool(np.isfinite(lhs) and np.isfinite(rhs))),
    )
    if not (np.isfinite(lhs) or np.isfinite(rhs)):
        return None, figures
    holds = abs(lhs - rhs) <= figures["atol"] + figures["rtol"] * (s1 + s2)
    return bool(holds), figures


@np.errstate(all="ignore")
def _host_combination(a: Any, b: Any) -> Any:
    """`2 a - b / 2` in NumPy, in the leaves' dtype; float0 leaves pass through."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == jax.dtypes.float0:
        return a
    return 2 * a - b / 2


@np.errstate(all="ignore")
def _linear_expected(a: Any, b: Any, got: Any) -> tuple[Any, Any]:
    """What `J(2 t1 - t2 / 2)` must be given `a = J t1` and `b = J t2`, and the
    scale of its tolerance. Where `a` or `b` is not finite linearity says nothing
    (`inf - inf`), so `got` stands there and the element is not compared."""
    combo = _host_combination(a, b)
    if combo.dtype == jax.dtypes.float0:
        return combo, np.zeros(combo.shape, np.float32)
    a, b = np.asarray(a), np.asarray(b)
    finite = np.isfinite(a) & np.isfinite(b)
    expected = np.where(finite, combo, np.asarray(got)).astype(combo.dtype)
    # The tolerance scales with the leaf's largest |2 J t1| + |J t2 / 2|, not with
    # each element's own. A JVP evaluated in floating point errs, per element, by a
    # few ulps of the largest term it sums, not of its result, which cancellation
    # can make arbitrarily small. Softmax's JVP (Gumbel-softmax's derivative) is
    # the case in point: y_i (t_i - <y, t>) / tau errs by up to about
    # (n + 4) u y_i (|t_i| + <y, |t|>) / tau (n categories, u = 2^-24 in float32),
    # yet is 1e-2 where t_i nearly equals <y, t>; an elementwise bound of
    # rtol * 1e-2 then fails a correct rule (jax 0.7 evaluates it in another order
    # and misses by 1.19e-6). The terms y_i (|t_i| + <y, |t|>) / tau are of the
    # size of the leaf's largest outputs, so the error is about (n + 4) u ~ 5e-7
    # (n = 4) of the largest, 20 times inside rtol = 1e-5 of it; a JVP that is not
    # linear (t^2, |t|) still errs by O(1) of it and fails.
    scale = 2 * np.abs(a.astype(np.float32)) + np.abs(b.astype(np.float32)) / 2
    scale = np.where(finite, scale, 0.0)
    largest = float(scale.max()) if scale.size else 0.0
    return expected, np.where(finite, largest, 0.0)


@np.errstate(all="ignore")
def _max_abs(x: np.ndarray) -> float:
    x = np.abs(np.asarray(x, np.float64))
    return float(np.where(np.isnan(x), np.inf, x).max()) if x.size else 0.0
