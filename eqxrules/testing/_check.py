"""`check_rule`: prove a custom derivative rule against references, check by check.

Each check is a small function over the same prepared problem (`_Problem`); each
reports separately, and a rule that raises inside a check fails that check only.

Speed: compiling dominates a check, so random tangents and cotangents are drawn, and
the checks' own arithmetic (perturbed points, linear combinations, comparisons) done,
in NumPy on the host, never as eager JAX operations (each of which compiles a program
per leaf shape). Only the rule and its references run under `jax.jit`, and each
jitted function is compiled once and shared by the checks that need it. Nothing is
cached across calls: a cache keyed on the function would go stale when a closure's
variables change, and a checker must never report on an old version of a rule.
"""

from __future__ import annotations

import dataclasses
import functools as ft
import inspect
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PRNGKeyArray

Status = Literal["passed", "failed", "unsupported", "skipped"]

CHECKS: tuple[str, ...] = (
    "primal",
    "jvp",
    "linearity",
    "vjp",
    "transpose",
    "finite_differences",
    "batching",
    "jit",
    "zero_cotangent",
    "dtype",
)
"""Every check `check_rule` runs, in order."""

DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-9, 1e-9),
    "float32": (1e-5, 1e-6),
    "float16": (4e-3, 4e-3),
    "bfloat16": (4e-2, 4e-2),
}
"""`(rtol, atol)` per dtype. An element passes when `|actual - expected| <= atol +
rtol * |expected|`. About four units in the last place for the low-precision types,
where the rule and its reference may round in a different order."""

FINITE_DIFFERENCE_TOLERANCES: dict[bool, tuple[float, float, float]] = {
    True: (1e-5, 1e-6, 1e-6),
    False: (3e-2, 3e-3, 1e-2),
}
"""`(rtol, atol, step)` for central differences, keyed by whether float64 is
available (`jax.enable_x64`). Without float64 they run in float32, and are loose."""

_BATCH = 3


class RuleCheckError(AssertionError):
    """Raised by [`check_rule`][] when a check fails. `report` holds every result,
    `failed` the names of the failing checks."""

    def __init__(self, message: str, report: RuleReport):
        super().__init__(message)
        self.report = report
        self.failed = report.failed


@dataclasses.dataclass
class CheckResult:
    """The outcome of one check.

    - `name`: one of [`CHECKS`][].
    - `status`: `"passed"`, `"failed"`, `"unsupported"` (forward-mode checks of a
        reverse-only rule) or `"skipped"` (no reference given, or mode not asked for).
    - `detail`: why it failed or was skipped.
    - `path`: the leaf where the largest error was (`jax.tree_util.keystr`).
    - `max_abs_error`, `max_rel_error`, `rtol`, `atol`: the figures behind it.
    - `seconds`: wall time of the check.
    - `exception`: the exception the rule raised inside the check, if any.
    """

    name: str
    status: Status
    detail: str = ""
    path: str = ""
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    rtol: float = 0.0
    atol: float = 0.0
    seconds: float = 0.0
    exception: BaseException | None = None

    def describe(self) -> str:
        where = f" at `{self.path}`" if self.path else ""
        figures = (
            f": max abs error {self.max_abs_error:.3g}, max rel error "
            f"{self.max_rel_error:.3g} (rtol={self.rtol:g}, atol={self.atol:g})"
            if self.status == "failed" and self.exception is None
            else ""
        )
        detail = f". {self.detail}" if self.detail else ""
        return f"check `{self.name}` {self.status}{where}{figures}{detail}"


@dataclasses.dataclass
class RuleReport:
    """Every [`CheckResult`][] of one [`check_rule`][] call, in [`CHECKS`][] order."""

    results: list[CheckResult]
    forward_mode: bool

    @property
    def passed(self) -> bool:
        return not self.failed

    @property
    def failed(self) -> list[str]:
        return [r.name for r in self.results if r.status == "failed"]

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.results)

    def __getitem__(self, name: str) -> CheckResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(name)

    def __str__(self) -> str:
        return "\n".join(r.describe() for r in self.results)


class _Failure(Exception):
    def __init__(self, detail: str, **figures: Any):
        super().__init__(detail)
        self.detail = detail
        self.figures = figures


def _dtype_name(x: Any) -> str:
    return jnp.dtype(jnp.result_type(x)).name


def _tolerance(dtype_name: str, rtol: float | None, atol: float | None):
    r, a = DEFAULT_TOLERANCES.get(dtype_name, DEFAULT_TOLERANCES["float32"])
    return (r if rtol is None else rtol), (a if atol is None else atol)


def _is_none(x: Any) -> bool:
    return x is None


def _fill(tree: Any, like: Any) -> Any:
    """`tree` aligned to `like` (whose leaves may be `None`), with `None` in `tree`
    standing for zeros of `like`'s leaf."""

    def fill(lk, t):
        if lk is None:
            return None
        if t is None:
            return jtu.tree_map(jnp.zeros_like, lk)
        return t

    return jtu.tree_map(fill, like, tree, is_leaf=_is_none)


def _compare(
    actual: Any,
    expected: Any,
    *,
    prefix: str,
    rtol: float | None,
    atol: float | None,
    scale: Any = None,
    check_dtype: bool = True,
    floor: str | None = None,
) -> dict[str, Any]:
    """Fail (raise `_Failure`) unless every leaf agrees. Returns the figures."""
    a_leaves, a_def = jtu.tree_flatten_with_path(actual, is_leaf=_is_none)
    e_leaves, e_def = jtu.tree_flatten_with_path(expected, is_leaf=_is_none)
    if a_def != e_def:
        raise _Failure(
            f"the pytree structure differs from the reference's: {a_def} vs {e_def}",
            path=prefix,
        )
    s_leaves = (
        [None] * len(a_leaves)
        if scale is None
        else jtu.tree_leaves(scale, is_leaf=_is_none)
    )
    worst: dict[str, Any] = dict(
        path="", max_abs_error=0.0, max_rel_error=0.0, rtol=0.0, atol=0.0
    )
    for (path, a), (_, e), s in zip(a_leaves, e_leaves, s_leaves):
        where = prefix + jtu.keystr(path)
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
        if jnp.result_type(e) == jax.dtypes.float0:
            continue
        r, t = _tolerance(_dtype_name(e), rtol, atol)
        if floor is not None:
            fr, ft_ = _tolerance(floor, rtol, atol)
            r, t = max(r, fr), max(t, ft_)
        an = np.asarray(a).astype(np.float64 if _x64() else np.float32)
        en = np.asarray(e).astype(an.dtype)
        sn = np.abs(en) if s is None else np.asarray(s, an.dtype)
        a_nan, e_nan = np.isnan(an), np.isnan(en)
        if np.any(a_nan != e_nan):
            which = (
                "NaN where the reference is finite"
                if np.any(a_nan & ~e_nan)
                else "finite where the reference is NaN"
            )
            raise _Failure(which, path=where, rtol=r, atol=t)
        same_inf = np.isinf(an) & (an == en)
        with np.errstate(invalid="ignore", over="ignore"):
            err = np.where(a_nan | same_inf, 0.0, np.abs(an - en))
            err = np.where(np.isnan(err), np.inf, err)
            bound = t + r * np.where(np.isinf(sn), 0.0, sn)
            rel = np.where(
                np.abs(en) > 0, err / np.abs(en), np.where(err > 0, np.inf, 0)
            )
        abs_max = float(err.max()) if err.size else 0.0
        rel_max = float(rel.max()) if rel.size else 0.0
        if abs_max >= worst["max_abs_error"]:
            worst = dict(
                path=where, max_abs_error=abs_max, max_rel_error=rel_max, rtol=r, atol=t
            )
        if np.any(err > bound):
            raise _Failure(
                "values differ from the reference beyond tolerance",
                path=where,
                max_abs_error=abs_max,
                max_rel_error=rel_max,
                rtol=r,
                atol=t,
            )
    return worst


def _x64() -> bool:
    return jax.dtypes.canonicalize_dtype(jnp.float64) == jnp.float64


def _entropy(key: PRNGKeyArray | None) -> list[int]:
    """The bits of a PRNG key (typed or raw `uint32`), to seed NumPy with."""
    if key is None:
        return [0, 0]  # the bits of `jax.random.key(0)`
    if jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return [int(b) for b in np.asarray(key).ravel()]


def _device(tree: Any) -> Any:
    """NumPy leaves of `tree` as JAX arrays (a transfer, no compiled program), so a
    rule never sees NumPy semantics; float0 leaves stay NumPy, as JAX has them."""

    def put(x: Any) -> Any:
        if isinstance(x, np.ndarray) and x.dtype != jax.dtypes.float0:
            return jax.device_put(x)
        return x

    return jtu.tree_map(put, tree)


def _random_like(rng: np.random.Generator, tree: Any) -> Any:
    """Standard-normal arrays, drawn on the host, shaped like the inexact leaves of
    `tree`; float0 zeros for the other array leaves; `None` elsewhere."""
    leaves, treedef = jtu.tree_flatten(tree, is_leaf=_is_none)
    out = []
    for leaf in leaves:
        if eqx.is_inexact_array(leaf):
            x = rng.standard_normal(np.shape(leaf), dtype=np.float32)
            out.append(jax.device_put(x.astype(jnp.dtype(leaf.dtype))))
        elif eqx.is_array(leaf):
            out.append(np.zeros(leaf.shape, jax.dtypes.float0))
        else:
            out.append(None)
    return jtu.tree_unflatten(treedef, out)


def _vdot(a: Any, b: Any) -> tuple[float, float]:
    """`<a, b>` over all inexact leaves, in float64 numpy, and `sum |a * b|`."""
    total, scale = 0.0, 0.0
    for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b)):
        if not eqx.is_inexact_array(x):
            continue
        xy = np.asarray(x, np.float64) * np.asarray(y, np.float64)
        total += float(xy.sum())
        scale += float(np.abs(xy).sum())
    return total, scale


def _lowest_precision(*trees: Any) -> str:
    order = ["bfloat16", "float16", "float32", "float64"]
    names = [
        _dtype_name(x)
        for t in trees
        for x in jtu.tree_leaves(t)
        if eqx.is_inexact_array(x)
    ]
    ranked = [n for n in order if n in names]
    return ranked[0] if ranked else "float32"


def _is_reverse_only_error(e: BaseException) -> bool:
    msg = str(e)
    return (
        "can't apply forward-mode autodiff" in msg
        or "supports reverse mode only" in msg
    )


def _check_signature(name: str, f: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*args)
    except TypeError as e:
        raise TypeError(
            f"`check_rule`: `{name}` must take the same arguments as `fn` "
            f"({len(args)} positional), but binding them failed: {e}"
        ) from None


class _Problem:
    """Everything the checks share: the split of `args` into differentiable leaves and
    the rest, the rule and its references as functions of the differentiable leaves,
    and the random tangents and cotangents."""

    def __init__(self, fn, args, forward, derivative, reference_vjp, key, rtol, atol):
        self.args = args
        self.diff, self.static = eqx.partition(args, eqx.is_inexact_array)
        if not jtu.tree_leaves(self.diff):
            raise TypeError(
                "`check_rule`: `args` hold no floating-point array, so there is "
                "nothing to differentiate. Pass at least one inexact (float or "
                "complex) array, or a Module holding one."
            )
        self.fn = fn
        self.forward = forward
        self.derivative = derivative
        self.reference_vjp = reference_vjp
        self.rtol, self.atol = rtol, atol
        streams = ("t", "t2", "ct", "batch", "fd")
        seeds = np.random.SeedSequence(_entropy(key)).spawn(len(streams))
        self.seeds: dict[str, np.random.SeedSequence] = dict(zip(streams, seeds))
        self.t = _random_like(self.rng("t"), self.diff)
        self.out = self.f(self.diff)
        self.ct = _random_like(self.rng("ct"), self.out)
        self.forward_mode: bool | None = None

    def rng(self, stream: str) -> np.random.Generator:
        """A fresh generator per use, so a check's draws do not depend on which
        checks ran before it."""
        return np.random.default_rng(self.seeds[stream])

    def combine(self, d: Any) -> tuple[Any, ...]:
        return eqx.combine(d, self.static)

    def f(self, d: Any) -> Any:
        return self.fn(*self.combine(d))

    def g(self, d: Any) -> Any:
        assert self.derivative is not None
        return self.derivative(*self.combine(d))

    def jvp(self, d: Any, t: Any, fn: Callable[[Any], Any] | None = None) -> Any:
        return jax.jvp(fn or self.f, (d,), (t,))[1]

    def vjp(self, d: Any, ct: Any, fn: Callable[[Any], Any] | None = None) -> Any:
        _, pullback = jax.vjp(fn or self.f, d)
        return pullback(ct)[0]

    def reference_cotangent(self, d: Any, ct: Any) -> Any:
        # `d` is an argument (not `self.diff` closed over) so that, under `jax.jit`,
        # the point is not a constant for XLA to fold: folding a large model's
        # weights into the program costs seconds.
        if self.reference_vjp is not None:
            ref = self.reference_vjp(ct, *self.combine(d))
            # `None` may stand for a whole subtree (the rule Module, say).
            ref = jtu.tree_map(
                lambda r, d: jtu.tree_map(lambda _: None, d) if r is None else r,
                ref,
                self.args,
                is_leaf=_is_none,
            )
            return _fill(eqx.filter(ref, eqx.is_array), self.diff)
        return self.vjp(d, ct, self.g)

    # Each jitted function is compiled once per problem and shared by the checks.
    @ft.cached_property
    def jvp_jit(self) -> Callable[[Any, Any], Any]:
        return jax.jit(self.jvp)

    @ft.cached_property
    def vjp_jit(self) -> Callable[[Any, Any], Any]:
        return jax.jit(self.vjp)

    @ft.cached_property
    def rule_jvp(self) -> Any:
        return self.jvp_jit(self.diff, self.t)

    @ft.cached_property
    def rule_vjp(self) -> Any:
        return self.vjp_jit(self.diff, self.ct)

    def compare(self, actual, expected, prefix, **kw) -> dict[str, Any]:
        # Tolerances follow the least precise dtype among the inputs and outputs: a
        # bfloat16 rule is only as exact as bfloat16, whatever its cotangents' dtype.
        return _compare(
            actual,
            expected,
            prefix=prefix,
            rtol=self.rtol,
            atol=self.atol,
            floor=_lowest_precision(self.diff, self.out),
            **kw,
        )


def _check_primal(p: _Problem) -> dict[str, Any] | str:
    if p.forward is None:
        return "no `forward` reference given"
    return p.compare(p.out, p.forward(*p.args), "out")


def _check_jvp(p: _Problem) -> dict[str, Any] | str:
    if p.derivative is None:
        return "no `derivative` reference given"
    expected = jax.jit(ft.partial(p.jvp, fn=p.g))(p.diff, p.t)
    return p.compare(p.rule_jvp, expected, "jvp(out)")


def _check_linearity(p: _Problem) -> dict[str, Any] | str:
    t2 = _random_like(p.rng("t2"), p.diff)
    combo = _device(jtu.tree_map(_host_combination, p.t, t2))
    j1, j2, j12 = p.rule_jvp, p.jvp_jit(p.diff, t2), p.jvp_jit(p.diff, combo)
    expected = jtu.tree_map(_host_combination, j1, j2)
    scale = jtu.tree_map(
        lambda a, b: (
            2 * np.abs(np.asarray(a)).astype(np.float32)
            + np.abs(np.asarray(b)).astype(np.float32) / 2
        ),
        j1,
        j2,
    )
    return p.compare(j12, expected, "jvp(out)", scale=scale)


def _host_combination(a: Any, b: Any) -> Any:
    """`2 a - b / 2` in NumPy, in the leaves' dtype; float0 leaves pass through."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == jax.dtypes.float0:
        return a
    return 2 * a - b / 2


def _check_vjp(p: _Problem) -> dict[str, Any] | str:
    if p.derivative is None and p.reference_vjp is None:
        return "no `derivative` or `reference_vjp` reference given"
    expected = jax.jit(p.reference_cotangent)(p.diff, p.ct)
    return p.compare(p.rule_vjp, expected, "args", check_dtype=False)


def _check_transpose(p: _Problem) -> dict[str, Any] | str:
    lhs, s1 = _vdot(p.ct, p.rule_jvp)
    rhs, s2 = _vdot(p.rule_vjp, p.t)
    r, a = _tolerance(_lowest_precision(p.diff, p.out), p.rtol, p.atol)
    figures = dict(
        path="<ct, J t> vs <J^T ct, t>",
        max_abs_error=abs(lhs - rhs),
        max_rel_error=abs(lhs - rhs) / max(abs(lhs), 1e-30),
        rtol=r,
        atol=a,
    )
    if not abs(lhs - rhs) <= a + r * (s1 + s2):
        raise _Failure(
            f"the rule's JVP and VJP are not transposes: <ct, J t> = {lhs:.6g} but "
            f"<J^T ct, t> = {rhs:.6g}",
            **figures,
        )
    return figures


def _check_finite_differences(p: _Problem, num_directions: int) -> dict[str, Any]:
    x64 = jax.enable_x64(True) if hasattr(jax, "enable_x64") else None
    have_x64 = x64 is not None
    rtol, atol, eps = FINITE_DIFFERENCE_TOLERANCES[have_x64]
    forward_mode = bool(p.forward_mode)
    worst: dict[str, Any] = {}
    with x64 if x64 is not None else _null():
        wide = np.float64 if have_x64 else np.float32
        d = _device(jtu.tree_map(lambda x: np.asarray(x).astype(wide), p.diff))
        ct = _device(
            jtu.tree_map(
                lambda x: np.asarray(x).astype(wide) if eqx.is_inexact_array(x) else x,
                p.ct,
            )
        )
        # The points are perturbed on the host, so that one compiled `f` serves
        # every evaluation (a program holding all of them compiles slower).
        f, jvp, vjp = jax.jit(p.f), jax.jit(p.jvp), jax.jit(p.vjp)
        rng = p.rng("fd")
        host_d = jtu.tree_map(np.asarray, d)
        ct_vjp = None
        for _ in range(num_directions):
            v = jtu.tree_map(np.asarray, _random_like(rng, d))
            norm = np.sqrt(sum(float(np.sum(x**2)) for x in jtu.tree_leaves(v)))
            v = jtu.tree_map(lambda x: x / norm, v)
            plus = f(_device(jtu.tree_map(lambda x, y: x + eps * y, host_d, v)))
            minus = f(_device(jtu.tree_map(lambda x, y: x - eps * y, host_d, v)))
            fd = jtu.tree_map(
                lambda a, b: (
                    (np.asarray(a) - np.asarray(b)) / (2 * eps)
                    if eqx.is_inexact_array(a)
                    else None
                ),
                plus,
                minus,
            )
            v = _device(v)
            if forward_mode:
                jv = jtu.tree_map(_float_or_none, jvp(d, v))
                worst = _compare(
                    jv, fd, prefix="jvp(out)", rtol=rtol, atol=atol, check_dtype=False
                )
            else:
                ct_vjp = vjp(d, ct) if ct_vjp is None else ct_vjp
                lhs, s1 = _vdot(ct, fd)
                rhs, s2 = _vdot(ct_vjp, v)
                worst = dict(
                    path="<ct, finite difference> vs <J^T ct, v>",
                    max_abs_error=abs(lhs - rhs),
                    max_rel_error=abs(lhs - rhs) / max(abs(lhs), 1e-30),
                    rtol=rtol,
                    atol=atol,
                )
                if not abs(lhs - rhs) <= atol + rtol * (s1 + s2):
                    raise _Failure(
                        f"the VJP disagrees with central differences: {rhs:.6g} vs "
                        f"{lhs:.6g}",
                        **worst,
                    )
    return worst


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _stack(trees: Sequence[Any]) -> Any:
    return _device(
        jtu.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)
    )


def _check_batching(p: _Problem) -> dict[str, Any]:
    rng = p.rng("batch")
    ds = [p.diff] + [
        _device(
            jtu.tree_map(
                lambda x, n: np.asarray(x) + (np.asarray(n) / 20).astype(x.dtype),
                p.diff,
                _random_like(rng, p.diff),
            )
        )
        for _ in range(1, _BATCH)
    ]
    cts = [p.ct] + [_random_like(rng, p.out) for _ in range(1, _BATCH)]
    cts = [_drop_float0(c) for c in cts]
    ts = [p.t] + [_random_like(rng, p.diff) for _ in range(1, _BATCH)]
    D, CT, T = _stack(ds), _stack(cts), _stack(ts)

    batched_vjp = jax.jit(jax.vmap(lambda d, ct: p.vjp(d, _restore_float0(ct, p.ct))))(
        D, CT
    )
    looped = _stack([p.vjp_jit(d, _restore_float0(c, p.ct)) for d, c in zip(ds, cts)])
    worst = p.compare(batched_vjp, looped, "vmap(vjp)(args)")
    if p.forward_mode:
        looped = _stack([p.jvp_jit(d, t) for d, t in zip(ds, ts)])
        batched_jvp = jax.jit(jax.vmap(p.jvp))(D, T)
        p.compare(
            jtu.tree_map(_float_or_none, batched_jvp),
            jtu.tree_map(_float_or_none, looped),
            "vmap(jvp)(out)",
        )
    return worst


def _float_or_none(x: Any) -> Any:
    return x if eqx.is_inexact_array(x) else None


def _drop_float0(tree: Any) -> Any:
    return jtu.tree_map(
        lambda x: None if jnp.result_type(x) == jax.dtypes.float0 else x, tree
    )


def _restore_float0(tree: Any, like: Any) -> Any:
    return jtu.tree_map(
        lambda x, lk: lk if x is None else x, tree, like, is_leaf=_is_none
    )


def _check_jit(p: _Problem) -> dict[str, Any]:
    worst = p.compare(jax.jit(p.f)(p.diff), p.out, "jit(out)")
    p.compare(p.rule_vjp, p.vjp(p.diff, p.ct), "jit(vjp)(args)")
    return worst


def _check_zero_cotangent(p: _Problem) -> dict[str, Any]:
    zeros = _device(
        jtu.tree_map(lambda c: np.zeros_like(c) if eqx.is_inexact_array(c) else c, p.ct)
    )
    grads = p.vjp_jit(p.diff, zeros)
    for path, g in jtu.tree_flatten_with_path(grads)[0]:
        g = np.asarray(g, np.float32)
        if np.any(g != 0):
            raise _Failure(
                "a zero cotangent gave a non-zero gradient "
                f"({'NaN' if np.any(np.isnan(g)) else 'non-zero values'})",
                path="args" + jtu.keystr(path),
                max_abs_error=float(np.nanmax(np.abs(g))) if g.size else 0.0,
            )
    return {}


def _check_dtype(p: _Problem) -> dict[str, Any]:
    grads = p.rule_vjp
    pairs: Iterable[tuple[str, Any, Any]] = [
        ("args" + jtu.keystr(path), g, x)
        for (path, x), g in zip(
            jtu.tree_flatten_with_path(p.diff)[0], jtu.tree_leaves(grads)
        )
    ]
    if p.forward_mode:
        jt = p.rule_jvp
        pairs = [
            *pairs,
            *(
                ("jvp(out)" + jtu.keystr(path), t, o)
                for (path, o), t in zip(
                    jtu.tree_flatten_with_path(p.out)[0], jtu.tree_leaves(jt)
                )
                if eqx.is_inexact_array(o)
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


def check_rule(
    fn: Callable[..., Any],
    *args: Any,
    forward: Callable[..., Any] | None = None,
    derivative: Callable[..., Any] | None = None,
    finite_differences: bool | None = None,
    modes: Sequence[str] = ("fwd", "rev"),
    rtol: float | None = None,
    atol: float | None = None,
    key: PRNGKeyArray | None = None,
    reference_vjp: Callable[..., Any] | None = None,
    num_directions: int = 2,
    raise_on_failure: bool = True,
) -> RuleReport:
    r"""Check a custom derivative rule against references, one check at a time.

    `fn(*args)` is differentiated with respect to every inexact-array leaf of `args`.
    To check a Module's parameters too, pass it as an argument:
    `check_rule(lambda m, x: m(x), model, x, derivative=lambda m, x: ...)`.

    With $f$ = `fn`, $g$ = `derivative`, random tangent $t$ and cotangent $c$:

    | check | passes when |
    |---|---|
    | `primal` | $f(x) =$ `forward(x)` (values, shapes and dtypes) |
    | `jvp` | $\partial f(x)\,t = \partial g(x)\,t$ |
    | `linearity` | $\partial f(x)(2t_1 - t_2/2) = 2\,\partial f(x)t_1 - \partial f(x)t_2/2$ |
    | `vjp` | $c^\top \partial f(x) = c^\top \partial g(x)$ (or `reference_vjp`) |
    | `transpose` | $\langle c, \partial f(x)\,t\rangle = \langle \partial f(x)^\top c, t\rangle$ |
    | `finite_differences` | $\partial f(x)\,v \approx (f(x+\epsilon v) - f(x-\epsilon v))/2\epsilon$ along random unit $v$, in float64 where available |
    | `batching` | `vmap` of the VJP (and JVP) equals the stacked per-example ones |
    | `jit` | jitted value and VJP equal eager ones |
    | `zero_cotangent` | $c = 0$ gives exactly zero cotangents, no NaN |
    | `dtype` | every cotangent has its primal's dtype (and every tangent its output's) |

    A rule without forward mode (a `custom_vjp`) is detected: its forward-mode checks
    are reported `"unsupported"`, and finite differences use the VJP instead.

    **Arguments:**

    - `fn`: the rule, as a function of `args`.
    - `args`: the point to check at: any pytrees.
    - `forward`: reference for the value, taking the same arguments as `fn`.
    - `derivative`: a function, taking the same arguments as `fn`, whose ordinary
        autodiff derivative the rule's derivative must equal. For a straight-through
        estimator this is the surrogate.
    - `finite_differences`: whether to check against central differences (only for
        rules that are true derivatives). Defaults to `True` when neither
        `derivative` nor `reference_vjp` is given.
    - `modes`: which of `"fwd"` and `"rev"` to check.
    - `rtol`, `atol`: override [`DEFAULT_TOLERANCES`][] (chosen by the reference's
        dtype).
    - `key`: a PRNG key for the random tangents and cotangents (default `key(0)`).
    - `reference_vjp`: `reference_vjp(cotangent, *args)` gives reference cotangents
        for `args`, for rules whose backward is not linear in the cotangent.
    - `num_directions`: random directions for finite differences.
    - `raise_on_failure`: if `False`, return the report instead of raising.

    **Returns:**

    A [`RuleReport`][].

    **Raises:**

    [`RuleCheckError`][] (an `AssertionError`) if any check fails. Its message names
    the check, the leaf, the largest absolute and relative error and the tolerance;
    an exception raised by the rule inside a check is chained to it.
    """
    for name, ref in (("forward", forward), ("derivative", derivative)):
        if ref is not None:
            _check_signature(name, ref, args)
    _check_signature("fn", fn, args)
    bad_modes = set(modes) - {"fwd", "rev"}
    if bad_modes or not modes:
        raise ValueError(
            f"`check_rule`: `modes` (={tuple(modes)!r}) must be a non-empty subset of "
            "('fwd', 'rev')."
        )
    if finite_differences is None:
        finite_differences = derivative is None and reference_vjp is None

    try:
        problem = _Problem(
            fn, args, forward, derivative, reference_vjp, key, rtol, atol
        )
    except TypeError as e:
        if "nothing to differentiate" in str(e):
            raise
        problem = None
        setup_error: BaseException | None = e
    except Exception as e:
        problem = None
        setup_error = e
    else:
        setup_error = None

    results: list[CheckResult] = []
    first_exception: BaseException | None = None

    def run(name: str, check: Callable[[], dict[str, Any] | str], needs: str = ""):
        nonlocal first_exception
        start = time.perf_counter()
        if problem is None:
            assert setup_error is not None
            result = CheckResult(
                name,
                "failed",
                f"the rule raised {type(setup_error).__name__}: {setup_error}",
                exception=setup_error,
            )
            first_exception = first_exception or setup_error
        elif needs == "fwd" and "fwd" not in modes:
            result = CheckResult(name, "skipped", "forward mode not asked for")
        elif needs == "fwd" and problem.forward_mode is False:
            result = CheckResult(name, "unsupported", "the rule has no forward mode")
        elif needs == "rev" and "rev" not in modes:
            result = CheckResult(name, "skipped", "reverse mode not asked for")
        else:
            try:
                figures = check()
            except _Failure as f:
                result = CheckResult(name, "failed", f.detail, **f.figures)
            except Exception as e:
                if needs == "fwd" and _is_reverse_only_error(e):
                    problem.forward_mode = False
                    result = CheckResult(
                        name, "unsupported", "the rule has no forward mode"
                    )
                else:
                    result = CheckResult(
                        name,
                        "failed",
                        f"the rule raised {type(e).__name__}: {e}",
                        exception=e,
                    )
                    first_exception = first_exception or e
            else:
                if isinstance(figures, str):
                    result = CheckResult(name, "skipped", figures)
                else:
                    result = CheckResult(name, "passed", **figures)
        result.seconds = time.perf_counter() - start
        results.append(result)

    if problem is not None and "fwd" in modes:
        # Run (not just trace) the JVP: under `jit`, JAX reports forward mode through
        # a `custom_vjp` only when lowering, so tracing alone would not find it.
        try:
            problem.rule_jvp
            problem.forward_mode = True
        except Exception as e:
            problem.forward_mode = False if _is_reverse_only_error(e) else None
    if problem is not None and problem.forward_mode is None and "fwd" not in modes:
        problem.forward_mode = False

    p = problem
    run("primal", lambda: _check_primal(p))  # type: ignore[arg-type]
    run("jvp", lambda: _check_jvp(p), "fwd")  # type: ignore[arg-type]
    run("linearity", lambda: _check_linearity(p), "fwd")  # type: ignore[arg-type]
    run("vjp", lambda: _check_vjp(p), "rev")  # type: ignore[arg-type]
    run(
        "transpose",
        lambda: (
            _check_transpose(p)  # type: ignore[arg-type]
            if "rev" in modes
            else "needs both modes"
        ),
        "fwd",
    )
    run(
        "finite_differences",
        lambda: (
            _check_finite_differences(p, num_directions)  # type: ignore[arg-type]
            if finite_differences
            else "not a true derivative (or a reference was given)"
        ),
        "rev",
    )
    run("batching", lambda: _check_batching(p), "rev")  # type: ignore[arg-type]
    run("jit", lambda: _check_jit(p), "rev")  # type: ignore[arg-type]
    run("zero_cotangent", lambda: _check_zero_cotangent(p), "rev")  # type: ignore[arg-type]
    run("dtype", lambda: _check_dtype(p), "rev")  # type: ignore[arg-type]

    report = RuleReport(results, forward_mode=bool(p is not None and p.forward_mode))
    if raise_on_failure and not report.passed:
        name = getattr(fn, "__name__", type(fn).__name__)
        lines = [r.describe() for r in results if r.status == "failed"]
        raise RuleCheckError(
            f"`check_rule` on `{name}`: {len(lines)} check(s) failed:\n  "
            + "\n  ".join(lines),
            report,
        ) from first_exception
    return report
