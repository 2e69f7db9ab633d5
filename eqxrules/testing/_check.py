"""`check_rule`: prove a custom derivative rule against references, check by check.

Each check is a small function over the same prepared problem (`_checks.TABLE`,
`_problem._Problem`); each reports separately, and a rule that raises inside a check
fails that check only.

Speed: compiling dominates a check. The rule's and the references' value and
derivatives at the point are one compiled program (`_core`), shared by the checks
that read them and reused by a later call at the same shapes; random tangents and
cotangents are drawn, and the checks' own arithmetic (perturbed points, linear
combinations, comparisons) done, in NumPy on the host, never as eager JAX
operations (each of which compiles a program per leaf shape). Only the rule and its
references run as compiled programs, each built once per call and shared by the
checks that need it (`_programs`).
"""

from __future__ import annotations

import inspect
import math
import numbers
import time
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any

from jaxtyping import PRNGKeyArray

from ._checks import (
    FINITE_DIFFERENCE_TOLERANCES as FINITE_DIFFERENCE_TOLERANCES,
    TABLE,
    _Check,
    _Options,
    _Raised,
)
from ._compare import DEFAULT_TOLERANCES as DEFAULT_TOLERANCES, _Failure
from ._options import _is_reverse_only_error
from ._problem import TangentSpace, _Problem
from ._report import (
    CheckResult as CheckResult,
    RuleCheckError as RuleCheckError,
    RuleReport as RuleReport,
)

CHECKS: tuple[str, ...] = tuple(TABLE)
"""Every check `check_rule` runs, in order."""


def _check_signature(name: str, f: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*args)
    except TypeError as e:
        what = (
            "must take the arguments given after it"
            if name == "fn"
            else "must take the same arguments as `fn`"
        )
        raise TypeError(
            f"`check_rule`: `{name}` {what} ({len(args)} positional: `*args`), but "
            f"binding them to its signature `{sig}` failed: {e}"
        ) from None


def _check_tangent_space(tangent_space: Any, n: int) -> TangentSpace:
    if tangent_space is None or callable(tangent_space):
        return tangent_space
    if isinstance(tangent_space, (list, tuple)):
        if len(tangent_space) != n:
            raise ValueError(
                f"`check_rule`: `tangent_space` gives {len(tangent_space)} "
                f"projection(s) but there are {n} argument(s): give one per "
                "argument (`None` for an unconstrained one), or one function for all."
            )
        bad = [s for s in tangent_space if s is not None and not callable(s)]
        if not bad:
            return tuple(tangent_space)
    raise TypeError(
        "`check_rule`: `tangent_space` must be a function (a projection onto the "
        "arguments' tangent space) or a tuple of one such function or `None` per "
        f"argument, not {type(tangent_space).__name__} (={tangent_space!r})."
    )


def _check_scales(values: Any, name: str = "cotangent_scales") -> tuple[float, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Collection):
        raise TypeError(
            f"`check_rule`: `{name}` must be a tuple of positive numbers, not "
            f"{type(values).__name__} (={values!r})."
        )
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(
                f"`check_rule`: `{name}` must hold numbers, but holds {v!r} of "
                f"type {type(v).__name__}."
            )
        if name == "cotangent_scales" and not (math.isfinite(v) and float(v) > 0):
            raise ValueError(
                f"`check_rule`: `{name}` (={tuple(values)!r}) must hold finite "
                f"positive numbers, not {v!r}."
            )
    return tuple(float(v) for v in values)


def _check_names(name: str, value: Any) -> frozenset[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Collection):
        hint = (
            f"; for one check write `{name}=({value!r},)`"
            if isinstance(value, str)
            else ""
        )
        raise TypeError(
            f"`check_rule`: `{name}` must be a tuple or list of check names, not "
            f"{type(value).__name__} (={value!r}){hint}."
        )
    for item in value:
        if not isinstance(item, str):
            raise TypeError(
                f"`check_rule`: `{name}` must hold check names (str), but holds "
                f"{item!r} of type {type(item).__name__}."
            )
    unknown = [item for item in value if item not in TABLE]
    if unknown:
        raise ValueError(
            f"`check_rule`: `{name}` (={tuple(value)!r}) names unknown check(s) "
            f"{', '.join(map(repr, unknown))}; the checks are "
            f"{', '.join(map(repr, TABLE))}."
        )
    return frozenset(value)


def _selection(checks: Any, skip: Any, order: Any) -> frozenset[str]:
    """The names of the checks to run, from `checks` or `skip`, validated."""
    if isinstance(order, bool) or not isinstance(order, numbers.Integral):
        raise TypeError(
            f"`check_rule`: `order` must be an int (1 or 2), not "
            f"{type(order).__name__} (={order!r})."
        )
    if order not in (1, 2):
        raise ValueError(f"`check_rule`: `order` (={order!r}) must be 1 or 2.")
    if checks is not None and skip is not None:
        raise ValueError(
            f"`check_rule`: pass `checks` (the checks to run, ={checks!r}) or `skip` "
            f"(the checks to leave out, ={skip!r}), not both."
        )
    if checks is not None:
        selected = _check_names("checks", checks)
        if not selected:
            raise ValueError(
                f"`check_rule`: `checks` (={checks!r}) must name at least one check."
            )
        if "second_order" in selected and order < 2:
            raise ValueError(
                "`check_rule`: `checks` selects 'second_order' but `order` is 1; "
                "pass `order=2` to check second derivatives."
            )
        return selected
    if skip is not None:
        return frozenset(TABLE) - _check_names("skip", skip)
    return frozenset(TABLE)


def _run_one(
    name: str,
    check: _Check,
    problem: _Problem | None,
    setup_error: BaseException | None,
    options: _Options,
) -> CheckResult:
    modes = options.modes
    if name == "second_order" and options.order < 2:
        return CheckResult(name, "skipped", "`order=1` (pass `order=2`)")
    if problem is None:
        assert setup_error is not None
        return CheckResult(
            name,
            "failed",
            f"the rule raised {type(setup_error).__name__}: {setup_error}",
            exception=setup_error,
        )
    if check.needs and not set(check.needs) & set(modes):
        which = "forward" if check.needs == ("fwd",) else "reverse"
        return CheckResult(name, "skipped", f"{which} mode not asked for")
    reason = None if check.skip is None else check.skip(problem, options)
    forward_only = check.forward_only(modes)
    if forward_only:
        # Skipped for want of a reference, a check need not find out whether the
        # rule has forward mode (a trace); `_run` relabels it "unsupported" if
        # another check finds it has none.
        if reason is not None and not problem.forward_mode_known:
            return CheckResult(name, "skipped", reason)
        if problem.forward_mode() is False:
            return CheckResult(name, "unsupported", _NO_FORWARD)
    if reason is not None:
        return CheckResult(name, "skipped", reason)
    try:
        figures = check.run(problem, options)
    except _Failure as f:
        return CheckResult(name, "failed", f.detail, **f.figures)
    except _Raised as r:
        return _raised(name, problem, r.exception, r.context)
    except Exception as e:
        if forward_only and _is_reverse_only_error(e):
            return CheckResult(name, "unsupported", _NO_FORWARD)
        return _raised(name, problem, e)
    if isinstance(figures, str):
        return CheckResult(name, "skipped", figures)
    return CheckResult(name, "passed", **figures)


def _raised(
    name: str, problem: _Problem, e: Exception, context: str | None = None
) -> CheckResult:
    """The failure of a check in which the rule raised `e` (in `context`): named by
    its cause where that is known."""
    cause = problem.untransposable(e)
    if cause is None:
        where = "" if context is None else f" ({context})"
        detail = f"the rule raised {type(e).__name__}{where}: {e}"
    else:
        detail = cause if context is None else f"{context}: {cause}"
    return CheckResult(name, "failed", detail, exception=e)


_NO_FORWARD = "the rule has no forward mode"


def _run(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    forward: Callable[..., Any] | None,
    derivative: Callable[..., Any] | None,
    reference_vjp: Callable[..., Any] | None,
    key: PRNGKeyArray | None,
    rtol: float | None,
    atol: float | None,
    options: _Options,
    selected: frozenset[str],
    tangent_space: TangentSpace,
) -> RuleReport:
    start = time.perf_counter()
    try:
        problem: _Problem | None = _Problem(
            fn,
            args,
            forward,
            derivative,
            reference_vjp,
            key,
            rtol,
            atol,
            options.modes,
            tangent_space,
        )
    except TypeError as e:
        if "nothing to differentiate" in str(e):
            raise
        problem, setup_error = None, e
    except Exception as e:
        problem, setup_error = None, e
    else:
        setup_error = None
        problem.unchecked_nan = options.unchecked_nan
        problem.options = (options, selected)
    setup_seconds = time.perf_counter() - start

    results: list[CheckResult] = []
    for name, check in TABLE.items():
        start = time.perf_counter()
        if name in selected:
            result = _run_one(name, check, problem, setup_error, options)
        else:
            result = CheckResult(name, "skipped", "not selected")
        result.seconds = time.perf_counter() - start
        results.append(result)
    # Preparing the problem (a trace for the output's shape) counts to the first
    # check run, so that the checks' seconds add up to the call's.
    ran = [r for r in results if r.detail != "not selected"]
    if ran:
        ran[0].seconds += setup_seconds
    forward_mode = problem is not None and problem.forward_mode() is True
    if problem is not None and problem.forward_mode() is False:
        for r in results:
            if TABLE[r.name].forward_only(options.modes) and r.status == "skipped":
                if r.detail not in ("not selected", "forward mode not asked for"):
                    r.status, r.detail = "unsupported", _NO_FORWARD
    return RuleReport(results, forward_mode=forward_mode)


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
    order: int = 1,
    checks: Sequence[str] | None = None,
    skip: Sequence[str] | None = None,
    where_reference_nan: str = "nan",
    cotangent_scales: Sequence[float] = (1e-3, 1.0, 1e3),
    cotangent_thresholds: Sequence[float] = (),
    tangent_space: TangentSpace = None,
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
    | `held_fixed` | with one argument (or one field of a Module argument) perturbed and the rest held fixed, so the rule gets `None` tangents for them, its JVP and VJP equal the reference's restricted the same way (or, with no reference, its own with zero tangents) |
    | `finite_differences` | $\partial f(x)\,v \approx (f(x+\epsilon v) - f(x-\epsilon v))/2\epsilon$ along random unit $v$, in float64 where available |
    | `batching` | `vmap` of the VJP (and JVP) equals the stacked per-example ones |
    | `jit` | jitted value and VJP equal eager ones |
    | `zero_cotangent` | $c = 0$ gives exactly zero cotangents, no NaN |
    | `dtype` | every cotangent has its primal's dtype (and every tangent its output's) |
    | `second_order` | with `order=2`: the JVP of the VJP and the VJP of the VJP equal the reference's |

    A rule without forward mode (a `custom_vjp`) is detected: its forward-mode checks
    are reported `"unsupported"`, and finite differences use the VJP instead (by the
    dot-product identity). With `modes=("fwd",)` finite differences compare the JVP
    along each direction with the central difference, the directional derivative.

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
    - `order`: `1`, or `2` to also check second derivatives (`second_order`),
        against plain autodiff through `derivative`'s VJP, through `reference_vjp`,
        or (for a true derivative with neither) through `forward`. Only for rules
        that declare their higher derivatives. With `2`, the checks' shared
        program computes the second derivatives even where `second_order` is not
        selected (so that calls at several inputs, with and without it, share
        one program).
    - `checks`: the names (of [`CHECKS`][]) of the checks to run; the others are
        reported `"skipped"`, "not selected", and (but for the second derivatives
        under `order=2`) cost nothing.
    - `skip`: the names of the checks to leave out. Give `checks` or `skip`, not
        both.
    - `where_reference_nan`: what the rule must give where a reference is NaN:
        `"nan"` (NaN too, the default) or `"any"` (anything: the reference says
        nothing there). With `"any"`, a derivative may also be anything where the
        reference's derivative is infinite (its own arithmetic overflowing at an
        extreme input, where the rule's need not; an infinite value is still
        compared); an element a reference gives as finite must still be finite
        and match, and a zero cotangent may give NaN only where the reference's
        own VJP of it does. For inputs where a reference's formula breaks down
        though the rule need not (a norm's derivative at a slice holding inf):
        [`eqxrules.verify_rule`][] checks its degenerate and extreme inputs so.
    - `cotangent_scales`: the `vjp` check compares the rule's cotangents with the
        reference's for the random cotangent times each of these (the absolute
        tolerance scaled alike): a backward pass that is not linear in its
        cotangent (a clipped gradient) is then tried on both sides of its
        thresholds, and any other for overflow and underflow.
    - `cotangent_thresholds`: where your rule's backward pass changes with the
        size of its cotangent (a clipping level, `max_norm`): `vjp` also scales
        the cotangent so that its largest element lies at half and twice each,
        and its norm at 0.9 and 1.1 times each, so that a threshold 10% out of
        place (or compared the wrong way) is seen from either side.
    - `tangent_space`: for arguments confined to a subspace (a symmetric matrix,
        a probability vector), a function projecting a tangent of the argument
        onto that subspace, orthogonally (linear, idempotent and self-adjoint:
        `lambda t: (t + t.T) / 2`, `lambda t: t - t.mean(-1, keepdims=True)`), or
        a tuple of one such function (or `None`) per argument. Every random
        tangent and finite-difference direction is projected, and so is every
        cotangent before it is compared: a cotangent is defined only up to the
        directions the argument cannot move in.

    **Returns:**

    A [`RuleReport`][]. A warning the rule raises while being checked is listed in
    its `warnings` and re-emitted once, however many checks ran into it.

    **Raises:**

    [`RuleCheckError`][] (an `AssertionError`) if any check fails. Its message names
    the check, the leaf, the worst element (its index, the input there, and the
    rule's and the reference's values there), the largest absolute and relative
    error and the tolerance; an exception raised by the rule inside a check is
    chained to it. Arguments are named as `fn`'s signature names them
    (`lambda m, x: m(x)`: `x`, `m.sub_model.weight`), else by position (`args[1]`).
    A JVP that is not linear in its tangent, which JAX cannot transpose, fails the
    reverse-mode checks with that cause named, not JAX's bare error.
    `ValueError` or `TypeError` for arguments of the wrong value or type.
    """
    _check_signature("fn", fn, args)
    for name, ref in (("forward", forward), ("derivative", derivative)):
        if ref is not None:
            _check_signature(name, ref, args)
    bad_modes = set(modes) - {"fwd", "rev"}
    if bad_modes or not modes:
        raise ValueError(
            f"`check_rule`: `modes` (={tuple(modes)!r}) must be a non-empty subset of "
            "('fwd', 'rev')."
        )
    selected = _selection(checks, skip, order)
    if not isinstance(where_reference_nan, str):
        raise TypeError(
            "`check_rule`: `where_reference_nan` must be a str ('nan' or 'any'), "
            f"not {type(where_reference_nan).__name__} (={where_reference_nan!r})."
        )
    if where_reference_nan not in ("nan", "any"):
        raise ValueError(
            f"`check_rule`: `where_reference_nan` (={where_reference_nan!r}) must be "
            "'nan' (the rule is NaN where a reference is) or 'any' (unchecked there)."
        )
    scales = _check_scales(cotangent_scales)
    thresholds = _check_scales(cotangent_thresholds, "cotangent_thresholds")
    tangent_space = _check_tangent_space(tangent_space, len(args))
    if finite_differences is None:
        finite_differences = derivative is None and reference_vjp is None
    options = _Options(
        modes=tuple(modes),
        finite_differences=finite_differences,
        num_directions=num_directions,
        order=int(order),
        unchecked_nan=where_reference_nan == "any",
        cotangent_scales=scales,
        cotangent_thresholds=thresholds,
    )

    # Warnings raised while checking are the rule's (the checker's own arithmetic
    # raises none): each distinct one is reported once, not once per check.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = _run(
            fn,
            args,
            forward,
            derivative,
            reference_vjp,
            key,
            rtol,
            atol,
            options,
            selected,
            tangent_space,
        )
    seen: dict[tuple[Any, ...], warnings.WarningMessage] = {}
    for w in caught:
        seen.setdefault((w.category, str(w.message), w.filename, w.lineno), w)
    report.warnings = [f"{w.category.__name__}: {w.message}" for w in seen.values()]
    for w in seen.values():
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    if raise_on_failure and not report.passed:
        failed = [r for r in report.results if r.status == "failed"]
        first_exception = next(
            (r.exception for r in failed if r.exception is not None), None
        )
        name = getattr(fn, "__name__", type(fn).__name__)
        lines = [r.describe() for r in failed]
        raise RuleCheckError(
            f"`check_rule` on `{name}`: {len(lines)} check(s) failed:\n  "
            + "\n  ".join(lines),
            report,
        ) from first_exception
    return report
