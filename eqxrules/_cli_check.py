"""`python -m eqxrules check`: one user rule, checked on random inputs."""

from __future__ import annotations

import argparse
import functools as ft
import importlib
import inspect
import json
from collections.abc import Callable
from typing import Any, NamedTuple, overload

import jax
import jax.numpy as jnp

from ._catalogue import Entry, Rule, catalogue
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
from ._cli_user import built_with_defaults, modes_of, rule_class, spec_of
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


def _catalogued(obj: Any, spec: str) -> tuple[Entry | None, Rule | None] | None:
    """The catalogue entry of a functional form, a Module class or an instance of
    one (with the instance the check calls: a class is built with its defaults).
    A user's rule class, or an instance of one, is taken the same way, with no
    entry."""
    for e in catalogue():
        if obj is e.function:
            return e, None
        if type(obj) is e.module:
            return e, obj
        if obj is e.module:
            return e, built_with_defaults(e.module, spec, "check")
    cls = rule_class(obj)
    if cls is not None:
        return None, built_with_defaults(cls, spec, "check")
    if isinstance(obj, Rule):
        return None, obj
    return None


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
        f"hint: if `{args.rule}` is a straight-through (surrogate) rule, its "
        "derivative is not the derivative of its value, so finite differences "
        "cannot check it: pass the surrogate with `--derivative PKG.MODULE:NAME`."
    )


class _Target(NamedTuple):
    """What `check` checks: the callable, how it takes a key (see
    `_key_parameter`), and, for a rule, whether it declares forward mode (`None`
    for a plain function: the checker finds out)."""

    fn: Any
    needs: str | None
    forward_mode: bool | None = None


def _target(args: argparse.Namespace, derivative: Any) -> _Target:
    """A rule that is not exact is refused without `--derivative`: finite
    differences, the only check left, would fail for a reason that is no bug."""
    fn = _import(args.rule, "the rule")
    found = _catalogued(fn, args.rule)
    if found is None:
        return _Target(fn, _key_parameter(fn))
    entry, instance = found
    exact = instance.is_exact() if instance is not None else entry and entry.exact
    if not exact and derivative is None:
        name = entry.name if entry is not None else args.rule
        verify = entry.name if entry is not None else spec_of(type(instance))
        raise SystemExit(
            f"eqxrules check: `{name}` is not exact: its derivative is a "
            "straight-through surrogate's, not the derivative of its value, so "
            "finite differences cannot check it. Pass the surrogate with "
            "`--derivative PKG.MODULE:NAME`, or run `python -m eqxrules verify "
            f"{verify}` to check it against its own references."
        )
    if instance is None:
        assert entry is not None
        return _Target(fn, _key_parameter(fn), entry.forward_mode)
    forward_mode = type(instance).forward_mode
    # Every Module accepts `key=`; whether it needs one is the instance's say (its
    # `primal`'s, or its hyperparameters': `rounding="stochastic"`).
    if instance.needs_key():
        return _Target(instance, "required", forward_mode)
    return _Target(instance, _key_parameter(type(instance).primal), forward_mode)


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


def _check(args: argparse.Namespace) -> int:
    forward = _import(args.forward, "`--forward`") if args.forward else None
    derivative = _import(args.derivative, "`--derivative`") if args.derivative else None
    fn, needs, declared = _target(args, derivative)
    try:
        shape = tuple(int(s) for s in args.shape.split(",") if s.strip())
    except ValueError:
        raise SystemExit(
            f"eqxrules check: `--shape` (={args.shape!r}) must be integers "
            "separated by commas, e.g. 8,4"
        ) from None
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
    key, notes = _rule_key(args, needs)
    x = jax.random.normal(jax.random.key(args.seed), shape, jnp.float32).astype(dtype)
    try:
        with _no_warnings(args.verbose):
            report: RuleReport = check_rule(
                _with_key(fn, key),
                x,
                forward=_with_key(forward, key),
                derivative=_with_key(derivative, key),
                raise_on_failure=False,
                key=jax.random.key(args.seed),
            )
    except (TypeError, ValueError) as e:
        raise SystemExit(f"eqxrules check: cannot check `{args.rule}`: {e}") from None
    status = {r.name: r.status for r in report.results}
    hints = (
        [_fd_hint(args)]
        if status.get("finite_differences") == "failed" and derivative is None
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
