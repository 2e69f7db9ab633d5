"""`python -m eqxrules check`: one user rule, checked on random inputs."""

from __future__ import annotations

import argparse
import dataclasses
import functools as ft
import importlib
import inspect
import json
from collections.abc import Callable
from typing import Any, NamedTuple, overload

import jax
import jax.numpy as jnp

from ._catalogue import Rule, catalogue
from ._cli_output import (
    _LEGEND,
    _SEED_LIMIT,
    _device_line,
    _header,
    _no_warnings,
    _row,
    _say,
    _table,
)
from ._cli_user import built_with_defaults, modes_of, rule_class
from ._domain import Args, Inputs
from ._registry import defines, entry_of
from ._verify import _NOT_DIFFERENTIABLE, tangent_space
from .testing import RuleReport, check_rule


def _import(spec: str, what: str, command: str = "check") -> Callable[..., Any]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(
            f"eqxrules {command}: {what} (={spec!r}) must look like PKG.MODULE:NAME"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise SystemExit(
            f"eqxrules {command}: cannot import {module_name!r}: {e}"
        ) from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise SystemExit(
                f"eqxrules {command}: {module_name!r} has no attribute {attr!r}"
            ) from None
    if not callable(obj):
        raise SystemExit(f"eqxrules {command}: {spec!r} is not callable")
    return obj


def _seed(flag: str) -> Callable[[str], int]:
    """An argparse `type` for a PRNG seed, whose error names `flag` and the value."""

    def parse(text: str) -> int:
        try:
            seed = int(text)
        except ValueError:
            seed = -1
        if not 0 <= seed < _SEED_LIMIT:
            raise argparse.ArgumentTypeError(
                f"`{flag}` (={text!r}) must be a non-negative integer below 2**63, "
                "e.g. 0"
            )
        return seed

    return parse


def _rule_of(obj: Any, spec: str) -> Rule | None:
    """The rule instance `check` checks, where `obj` is one: an instance (yours or
    the catalogue's), a rule class (built with its defaults), or the functional
    form of a catalogue rule (its class, built so). `None` for a plain function."""
    if isinstance(obj, Rule):
        return obj
    cls = rule_class(obj)
    if cls is not None:
        return built_with_defaults(cls, spec, "check")
    cls = next((e.module for e in catalogue() if obj is e.function), None)
    if cls is None:
        return None
    try:
        return cls()
    except (TypeError, ValueError) as err:
        raise SystemExit(
            f"eqxrules check: cannot check `{spec}`: it is the function of "
            f"`{cls.__name__}`, which cannot be built with its defaults ({err}); "
            "point at an instance instead"
        ) from None


def _key_parameter(fn: Callable[..., Any]) -> str | None:
    """`"required"` or `"optional"` if `fn` takes a `key` argument by name (with or
    without a default), else `None`."""
    try:
        param = inspect.signature(fn).parameters.get("key")
    except (TypeError, ValueError):
        return None
    if param is None or param.kind in (param.POSITIONAL_ONLY, param.VAR_POSITIONAL):
        return None
    return "required" if param.default is param.empty else "optional"


@overload
def _with_key(fn: Callable[..., Any], key: Any) -> Callable[..., Any]: ...
@overload
def _with_key(fn: None, key: Any) -> None: ...
@overload
def _with_key(fn: Callable[..., Any] | None, key: Any) -> Callable[..., Any] | None: ...
def _with_key(fn: Callable[..., Any] | None, key: Any) -> Callable[..., Any] | None:
    if fn is None or key is None or _key_parameter(fn) is None:
        return fn
    return ft.partial(fn, key=key)


def _fd_hint(args: argparse.Namespace) -> str:
    return (
        f"hint: `{args.rule}`'s value is constant around the input (a step of "
        "1e-3 changes most of its elements not at all), as a straight-through "
        "(surrogate) rule's is: its derivative is then not the derivative of its "
        "value, and finite differences cannot check it. Pass the surrogate with "
        "`--derivative PKG.MODULE:NAME`."
    )


def _constant_around(fn: Callable[..., Any], x: Any) -> bool:
    """Whether most output elements of `fn` stay exactly the same when every
    input element moves by about 1e-3: a piecewise-constant value (a sign, a
    rounding), whose finite differences are 0, not a wrong derivative."""
    try:
        step = jax.random.normal(jax.random.key(1), jnp.shape(x), jnp.float32)
        y0 = jax.tree_util.tree_leaves(fn(x))
        y1 = jax.tree_util.tree_leaves(fn(x + (1e-3 * step).astype(x.dtype)))
    except Exception:  # noqa: BLE001  (no hint, then)
        return False
    same = sum(int(jnp.sum(a == b)) for a, b in zip(y0, y1))
    total = sum(int(jnp.size(a)) for a in y0)
    return total > 0 and same >= total / 2


class _Target(NamedTuple):
    """What `check` checks: a plain function (`fn`, how it takes a key: see
    `_key_parameter`), or a rule instance (`rule`, checked as `verify` checks an
    example: with its own references, as a Module argument, on its domain)."""

    fn: Any
    needs: str | None
    rule: Rule | None = None


def _target(args: argparse.Namespace) -> _Target:
    obj = _import(args.rule, "the rule")
    rule = _rule_of(obj, args.rule)
    if rule is None:
        return _Target(obj, _key_parameter(obj))
    # Every Module accepts `key=`; whether it needs one is the instance's say (its
    # `primal`'s, or its hyperparameters': `rounding="stochastic"`).
    needs = "required" if rule.needs_key() else _key_parameter(type(rule).primal)
    return _Target(rule, needs, rule)


def _modes_problem(declared: bool | None, report: RuleReport) -> list[str]:
    """A rule's declared forward mode against the checker's finding, as
    `verify` compares them."""
    if declared is None:
        return []
    if declared and report["jvp"].status == "unsupported":
        found = "does not support it"
    elif not declared and report.forward_mode:
        found = "supports it"
    else:
        return []
    kind = "JVPRule" if declared else "VJPRule"
    return [
        f"forward mode: declared {declared} (as a {kind}), but the checker found "
        f"that the rule {found}"
    ]


def _rule_key(args: argparse.Namespace, needs: str | None) -> tuple[Any, list[str]]:
    """The key to pass the rule, and a note when it is the default. A rule that
    needs a key gets `key(0)` without `--key`, as `verify` gives it a fixed one, so
    that `check` works as it stands; `--key` for a rule that takes none is an error
    rather than ignored."""
    if args.key is not None:
        if needs is None:
            raise SystemExit(
                f"eqxrules check: `--key` (={args.key}) was given, but `{args.rule}` "
                "takes no `key` argument"
            )
        return jax.random.key(args.key), []
    if needs == "required":
        note = (
            f"note: `{args.rule}` needs a PRNG key: using jax.random.key(0) "
            "(choose another with `--key SEED`)"
        )
        return jax.random.key(0), [note]
    return None, []


def _shape(args: argparse.Namespace) -> tuple[int, ...] | None:
    if args.shape is None:
        return None
    try:
        return tuple(int(s) for s in args.shape.split(",") if s.strip())
    except ValueError:
        raise SystemExit(
            f"eqxrules check: `--shape` (={args.shape!r}) must be integers "
            "separated by commas, e.g. 8,4"
        ) from None


def _dtype(args: argparse.Namespace) -> Any:
    try:
        dtype = jnp.dtype(args.dtype)
    except TypeError:
        raise SystemExit(f"eqxrules check: unknown `--dtype` {args.dtype!r}") from None
    if not jnp.issubdtype(dtype, jnp.inexact):
        # Else `check_rule` would blame its own `args`, which the user never wrote.
        raise SystemExit(
            f"eqxrules check: `--dtype` (={args.dtype!r}) must be a floating-point "
            "or complex dtype, e.g. float32 or bfloat16: the checks differentiate "
            "the rule"
        )
    return dtype


def _domain(args: argparse.Namespace, rule: Rule, shape: Any) -> Any:
    """The rule's declared domain, of `--shape` if given (one input's only)."""
    domain = rule.input_domain()
    if shape is None:
        return domain
    if isinstance(domain, Inputs):
        names = ", ".join(f"`{n}`" for n in domain.names)
        raise SystemExit(
            f"eqxrules check: `--shape` (={args.shape!r}) is one input's shape, but "
            f"`{args.rule}` takes several ({names}), each of its declared domain's "
            "shape: leave `--shape` out"
        )
    return dataclasses.replace(domain, shape=shape)


def _rule_problem(
    args: argparse.Namespace, rule: Rule, key: Any, forward: Any, derivative: Any
) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """`check_rule`'s arguments for a rule instance, as `verify` checks one of its
    examples: the Module as an argument, inputs drawn from its declared domain
    (several for a rule of several inputs), its own references unless `--forward`
    or `--derivative` replaces them (each taking the inputs alone), cotangents
    scaled to either side of its thresholds, tangents in its domain's tangent space, and finite
    differences where its derivative is the true one."""
    domain = _domain(args, rule, _shape(args))
    x = domain.sample(jax.random.key(args.seed), _dtype(args), off_kinks=True)
    entry = entry_of(type(rule))
    fn, call_args, refs = entry.check_arguments(
        rule, x, jax.random.key(0) if key is None else key
    )
    cls = type(rule)
    if forward is not None:
        refs["forward"] = lambda m, *xs: _with_key(forward, key)(*xs)
    elif not defines(cls, "reference_forward"):
        refs.pop("forward")
    if derivative is not None:
        refs.pop("reference_vjp", None)
        refs["derivative"] = lambda m, *xs: _with_key(derivative, key)(*xs)
    elif not (defines(cls, "reference_derivative") or defines(cls, "reference_vjp")):
        refs.pop("derivative", None)
        if not rule.is_exact():
            raise SystemExit(
                f"eqxrules check: `{args.rule}` declares no reference derivative "
                "and is not exact: its derivative is a straight-through "
                "surrogate's, not the derivative of its value, so finite "
                "differences cannot check it. Pass the surrogate with "
                "`--derivative PKG.MODULE:NAME`."
            )
    options = dict(
        finite_differences=rule.is_exact(),
        cotangent_thresholds=rule.cotangent_thresholds(),
        tangent_space=tangent_space(domain, isinstance(x, Args)),
        order=2 if rule.second_order() else 1,
    )
    return fn, call_args, {**refs, **options}


def _check(args: argparse.Namespace) -> int:
    forward = _import(args.forward, "`--forward`") if args.forward else None
    derivative = _import(args.derivative, "`--derivative`") if args.derivative else None
    fn, needs, rule = _target(args)
    key, notes = _rule_key(args, needs)
    kwargs: dict[str, Any]
    if rule is not None:
        fn, call_args, kwargs = _rule_problem(args, rule, key, forward, derivative)
        declared: bool | None = type(rule).forward_mode
    else:
        shape = _shape(args) or (8, 4)
        x = jax.random.normal(jax.random.key(args.seed), shape, jnp.float32)
        x = x.astype(_dtype(args))
        fn, call_args, declared = _with_key(fn, key), (x,), None
        kwargs = dict(
            forward=_with_key(forward, key), derivative=_with_key(derivative, key)
        )
    try:
        with _no_warnings(args.verbose):
            report: RuleReport = check_rule(
                fn,
                *call_args,
                **kwargs,
                raise_on_failure=False,
                key=jax.random.key(args.seed),
            )
    except (TypeError, ValueError) as e:
        several = (
            " (`check` gives a function one input, of `--shape`; check one of "
            "several inputs as a rule declaring them with `eqxrules.Inputs`, or "
            "call `eqxrules.testing.check_rule` from Python)"
            if rule is None and "`fn` must take" in str(e)
            else ""
        )
        raise SystemExit(
            f"eqxrules check: cannot check `{args.rule}`: {e}{several}"
        ) from None
    if rule is not None and not rule.second_order():
        second = report["second_order"]
        second.status, second.detail = "unsupported", _NOT_DIFFERENTIABLE
    fd = report["finite_differences"]
    hints = (
        [_fd_hint(args)]
        if rule is None
        and derivative is None
        and fd.status == "failed"
        and fd.exception is None
        and _constant_around(fn, call_args[0])
        else []
    )
    # A rule's modes are those it declares (a JVPRule: both), checked against the
    # checker's finding; a function's, what the checker found.
    modes = modes_of(report.forward_mode if declared is None else declared)
    problems = _modes_problem(declared, report)
    passed = report.passed and not problems
    if args.json:
        shown_json = _report_json(args.rule, report, notes + hints, modes, problems)
        _say(json.dumps(shown_json, indent=2))
        return 0 if passed else 1
    status = {r.name: r.status for r in report.results}
    row = _row(
        args.rule, "+".join(modes), lambda c: status.get(c, "skipped"), report.seconds
    )
    _say(_device_line(), *notes, _table([row], _header()), _LEGEND)
    shown = [r for r in report.results if r.status == "failed" or args.verbose]
    _say(*(f"  {r.describe()}" for r in shown), *(f"  {p}" for p in problems))
    _say(*hints, "passed" if passed else "FAILED")
    return 0 if passed else 1


def _report_json(
    rule: str,
    report: RuleReport,
    notes: list[str],
    modes: tuple[str, ...],
    problems: list[str],
) -> dict[str, Any]:
    return {
        "rule": rule,
        "backend": jax.default_backend(),
        "passed": report.passed and not problems,
        "modes": list(modes),
        "problems": problems,
        "checks": {
            r.name: {"status": r.status, "message": r.describe()}
            for r in report.results
        },
        "seconds": round(report.seconds, 3),
        "notes": notes,
    }
