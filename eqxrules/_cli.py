"""`python -m eqxrules`: verify the catalogue on this machine, list it, check a
user's rule, or plot rules."""

from __future__ import annotations

import argparse
import contextlib
import functools as ft
import importlib
import inspect
import json
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ._catalogue import Entry, Rule, catalogue
from ._verify import EntryResult, verify
from .testing import CHECKS, RuleReport, check_rule

_SYMBOL = {"passed": "ok", "failed": "FAIL", "unsupported": "n/a", "skipped": "-"}
# Column names where a check's own name is too wide for the table.
_SHORT = {
    "linearity": "linear",
    "transpose": "transp",
    "finite_differences": "fd",
    "held_fixed": "held",
    "batching": "vmap",
    "zero_cotangent": "zero",
    "second_order": "2nd",
}
_LEGEND = "ok = passed, FAIL = failed, n/a = mode not supported, - = not applicable"
_MODES_WIDTH = len("fwd+rev")
_SEED_LIMIT = 2**63  # `jax.random.key` takes a seed that fits an int64


def _say(*lines: str, err: bool = False) -> None:
    """Print and flush at once, so that a pipe or a CI log sees each line as it
    happens, not when the buffer fills."""
    stream = sys.stderr if err else sys.stdout
    for line in lines:
        print(line, file=stream, flush=True)


@contextlib.contextmanager
def _no_warnings(verbose: bool) -> Iterator[None]:
    """Keep warnings raised while checking (NumPy's divide-by-zero in a relative
    error where the reference is 0, say) off the terminal: the report says what
    went wrong. With `--verbose` each distinct warning is shown once, as a note."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    if verbose:
        seen = dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught)
        _say(*(f"note: a check warned {w}" for w in seen), err=True)


def _device_line() -> str:
    devices = jax.devices()
    d = devices[0]
    return (
        f"JAX {jax.__version__} on backend {jax.default_backend()!r}: "
        f"{len(devices)} x {d.device_kind} ({d.platform})"
    )


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([_line(header, widths), rule, *(_line(r, widths) for r in rows)])


def _header() -> list[str]:
    return ["rule", "modes", *(_SHORT.get(c, c) for c in CHECKS), "time"]


def _row(name: str, modes: str, status: Callable[[str], str], seconds: float):
    return [name, modes, *(_SYMBOL[status(c)] for c in CHECKS), f"{seconds:.2f}s"]


def _stream_widths(names: Sequence[str]) -> list[int]:
    """Column widths fixed before any rule is verified, so that each row can be
    printed as soon as its rule is done."""
    symbol = max(len(s) for s in _SYMBOL.values())
    name, modes, *checks, time = _header()
    return [
        max(len(name), *(len(n) for n in names)),
        max(len(modes), _MODES_WIDTH),
        *(max(len(h), symbol) for h in checks),
        len(time),  # the last column: nothing after it to align
    ]


def _verify(args: argparse.Namespace) -> int:
    entries = _select(args.names)
    widths = _stream_widths([e.name for e in entries])
    if not args.json:
        _say(
            _device_line(),
            f"Verifying {len(entries)} rules with eqxrules.testing.check_rule ...",
            _line(_header(), widths),
            "  ".join("-" * w for w in widths),
        )
    results: list[EntryResult] = []
    for entry in entries:
        if args.verbose:
            _say(f"verifying {entry.name} ...", err=True)
        with _no_warnings(args.verbose):
            r = verify(entry)
        results.append(r)
        if args.verbose:
            done = f"{len(r.reports)} examples checked in {r.seconds:.2f}s"
            _say(
                f"  {entry.name}: {done}, {'passed' if r.passed else 'FAILED'}",
                err=True,
            )
        if not args.json:
            modes = "+".join(entry.modes)
            _say(_line(_row(entry.name, modes, r.status, r.seconds), widths))
    failed = [r for r in results if not r.passed]
    if args.json:
        _say(json.dumps([_result_json(r) for r in results], indent=2))
        return 1 if failed else 0
    _say(_LEGEND)
    for r in failed:
        _say("", f"{r.entry.name} FAILED:", *(f"  {line}" for line in r.failures()))
    total = sum(r.seconds for r in results)
    verdict = "FAILED" if failed else "passed"
    _say(
        f"\n{len(results) - len(failed)}/{len(results)} rules passed "
        f"({sum(len(r.reports) for r in results)} checked examples, "
        f"{total:.1f}s): {verdict}"
    )
    return 1 if failed else 0


def _result_json(r: EntryResult) -> dict[str, Any]:
    return {
        "name": r.entry.name,
        "module": r.entry.module.__name__,
        "passed": r.passed,
        "modes": list(r.entry.modes),
        "checks": {c: r.status(c) for c in CHECKS},
        "examples": len(r.reports),
        "seconds": round(r.seconds, 3),
        "failures": r.failures(),
    }


def _select(names: Sequence[str] | None) -> tuple[Entry, ...]:
    entries = catalogue()
    if not names:
        return entries
    by_name = {e.name: e for e in entries} | {e.module.__name__: e for e in entries}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(
            f"eqxrules: unknown rule(s) {unknown}; known: "
            f"{sorted(e.name for e in entries)}"
        )
    return tuple(by_name[n] for n in names)


def _escape(text: str) -> str:
    # GitHub tables need pipes escaped, inside code spans too.
    return text.replace("|", "\\|")


def catalogue_markdown() -> str:
    """The README's catalogue table, generated from `catalogue()`."""
    lines = [
        "| function | Module | modes | exact | summary |",
        "|---|---|---|---|---|",
    ]
    for e in catalogue():
        lines.append(
            f"| `{e.name}` | `{e.module.__name__}` | {' + '.join(e.modes)} | "
            f"{'yes' if e.exact else 'no'} | {_escape(e.summary)} |"
        )
    return "\n".join(lines)


def _list(args: argparse.Namespace) -> int:
    if args.markdown:
        _say(catalogue_markdown())
        return 0
    if args.json:
        entries = [
            {
                "name": e.name,
                "module": e.module.__name__,
                "modes": list(e.modes),
                "exact": e.exact,
                "elementwise": e.elementwise,
                "summary": e.summary,
            }
            for e in catalogue()
        ]
        _say(json.dumps(entries, indent=2))
        return 0
    header = ["rule", "Module", "modes", "exact"]
    rows = [
        [e.name, e.module.__name__, "+".join(e.modes), "yes" if e.exact else "no"]
        for e in catalogue()
    ]
    if args.verbose:
        header.append("summary")
        for row, e in zip(rows, catalogue()):
            row.append(e.summary)
    _say(_table(rows, header))
    return 0


def _import(spec: str, what: str) -> Callable[..., Any]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(
            f"eqxrules check: {what} (={spec!r}) must look like PKG.MODULE:NAME"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise SystemExit(f"eqxrules check: cannot import {module_name!r}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise SystemExit(
                f"eqxrules check: {module_name!r} has no attribute {attr!r}"
            ) from None
    if not callable(obj):
        raise SystemExit(f"eqxrules check: {spec!r} is not callable")
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


def _catalogued(obj: Any, spec: str) -> tuple[Entry, Rule | None] | None:
    """The catalogue entry of a functional form, a Module class or an instance of
    one (with the instance the check calls: a class is built with its defaults)."""
    for e in catalogue():
        if obj is e.function:
            return e, None
        if type(obj) is e.module:
            return e, obj
        if obj is e.module:
            try:
                return e, e.module()
            except (TypeError, ValueError) as err:
                raise SystemExit(
                    f"eqxrules check: {spec!r} is a Module class that cannot be built "
                    f"with its defaults ({err}); point at an instance instead"
                ) from None
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


def _target(args: argparse.Namespace, derivative: Any) -> tuple[Any, str | None]:
    """The callable `check` checks, and how it takes a key (see `_key_parameter`).
    A catalogue rule that is not exact is refused without `--derivative`: finite
    differences, the only check left, would fail for a reason that is no bug."""
    fn = _import(args.rule, "the rule")
    found = _catalogued(fn, args.rule)
    if found is None:
        return fn, _key_parameter(fn)
    entry, instance = found
    exact = entry.exact if instance is None else instance.is_exact()
    if not exact and derivative is None:
        raise SystemExit(
            f"eqxrules check: `{entry.name}` is not exact: its derivative is a "
            "straight-through surrogate's, not the derivative of its value, so "
            "finite differences cannot check it. Pass the surrogate with "
            "`--derivative PKG.MODULE:NAME`, or run `python -m eqxrules verify "
            f"{entry.name}` to check it against its own references."
        )
    if instance is None:
        return fn, _key_parameter(fn)
    # Every Module accepts `key=`; whether it needs one is its `primal`'s say.
    return instance, _key_parameter(type(instance).primal)


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
    fn, needs = _target(args, derivative)
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
    if args.json:
        _say(json.dumps(_report_json(args.rule, report, notes + hints), indent=2))
        return 0 if report.passed else 1
    modes = "fwd+rev" if report.forward_mode else "rev"
    row = _row(args.rule, modes, lambda c: status.get(c, "skipped"), report.seconds)
    _say(_device_line(), *notes, _table([row], _header()), _LEGEND)
    shown = [r for r in report.results if r.status == "failed" or args.verbose]
    _say(*(f"  {r.describe()}" for r in shown), *hints)
    _say("passed" if report.passed else "FAILED")
    return 0 if report.passed else 1


def _report_json(rule: str, report: RuleReport, notes: list[str]) -> dict[str, Any]:
    return {
        "rule": rule,
        "backend": jax.default_backend(),
        "passed": report.passed,
        "modes": ["fwd", "rev"] if report.forward_mode else ["rev"],
        "checks": {
            r.name: {"status": r.status, "message": r.describe()}
            for r in report.results
        },
        "seconds": round(report.seconds, 3),
        "notes": notes,
    }


def _plot(args: argparse.Namespace) -> int:
    try:
        from ._plot import plot
    except ModuleNotFoundError as e:
        _say(f"eqxrules plot: {e}", err=True)
        return 2
    try:
        paths = plot(args.names or None, args.out)
    except (ModuleNotFoundError, ValueError) as e:
        _say(f"eqxrules plot: {e}", err=True)
        return 2
    if args.json:
        _say(json.dumps([str(p) for p in paths]))
    else:
        _say(*(str(p) for p in paths))
    return 0


_JSON_HELP = "print JSON instead of a table"
_VERBOSE_HELP = (
    "say more: progress on stderr (verify), a summary column (list), every check's "
    "result and any warning (check); not for plot"
)


def _flags(default: Any) -> argparse.ArgumentParser:
    # On the main parser the flags default to False; on a subcommand they default
    # to SUPPRESS, so that a flag given before the subcommand is not reset by the
    # subcommand's parser (argparse copies every subparser default over it).
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--json", action="store_true", default=default, help=_JSON_HELP)
    flags.add_argument(
        "--verbose", action="store_true", default=default, help=_VERBOSE_HELP
    )
    return flags


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m eqxrules",
        description="Verify the eqxrules catalogue on this machine's JAX backend "
        "(the default), list it, check your own rule, or plot rules. `--json` and "
        "`--verbose` go before or after the command.",
        parents=[_flags(False)],
    )
    flags = [_flags(argparse.SUPPRESS)]
    parser.set_defaults(func=_verify, names=None)
    sub = parser.add_subparsers(title="commands")

    v = sub.add_parser(
        "verify", help="verify rules (the default: all of them)", parents=flags
    )
    v.add_argument("names", nargs="*", help="rules to verify (default: all)")
    v.set_defaults(func=_verify)

    ls = sub.add_parser("list", help="print the catalogue", parents=flags)
    ls.add_argument("--markdown", action="store_true", help="as the README's table")
    ls.set_defaults(func=_list)

    c = sub.add_parser(
        "check", help="check your own rule on random inputs", parents=flags
    )
    c.add_argument("rule", help="the rule, as PKG.MODULE:NAME")
    c.add_argument("--forward", help="reference value, as PKG.MODULE:NAME")
    c.add_argument(
        "--derivative",
        help="function whose autodiff derivative the rule's must equal, PKG.MODULE:NAME",
    )
    c.add_argument("--shape", default="8,4", help="input shape, e.g. 8,4")
    c.add_argument("--dtype", default="float32", help="input dtype, e.g. bfloat16")
    c.add_argument(
        "--seed",
        type=_seed("--seed"),
        default=0,
        help="seed of the random input and the checks' random directions",
    )
    c.add_argument(
        "--key",
        type=_seed("--key"),
        default=None,
        metavar="SEED",
        help="pass key=jax.random.key(SEED) to a rule that takes `key` (a rule that "
        "needs one gets key(0) by default)",
    )
    c.set_defaults(func=_check)

    p = sub.add_parser(
        "plot",
        help="plot each rule's value and derivative (needs matplotlib)",
        parents=flags,
    )
    p.add_argument("names", nargs="*", help="rules to plot (default: all)")
    p.add_argument("--out", default="plots", help="output directory")
    p.set_defaults(func=_plot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.func is _plot and args.verbose:
        parser.error(
            "`--verbose` does not apply to `plot`: it prints each path it writes"
        )
    if args.func is _list and args.markdown and args.json:
        parser.error("`list`: `--markdown` and `--json` cannot be used together")
    return args.func(args)
