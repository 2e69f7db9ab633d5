"""`python -m eqxrules`: verify the catalogue on this machine, list it, check a
user's rule, or plot rules."""

import argparse
import json
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax

from ._catalogue import Entry, catalogue
from ._cli_check import (
    _check,
    _import,
    _seed,
)
from ._cli_output import (
    _LEGEND,
    _count,
    _device_line,
    _header,
    _line,
    _no_warnings,
    _row,
    _say,
    _stream_widths,
    _table,
)
from ._cli_user import UserResult, verify_target, verify_user
from ._verify import EntryResult, verify
from .testing import CHECKS


def _verify(args: argparse.Namespace) -> int:
    targets = _select(args.names, users=True)
    widths = _stream_widths([name for name, _ in targets])
    if not args.json:
        _say(
            _device_line(),
            f"Verifying {_count(len(targets), 'rule')} with "
            "eqxrules.testing.check_rule ...",
            _line(_header(), widths),
            "  ".join("-" * w for w in widths),
        )
    results: list[EntryResult | UserResult] = []
    for name, target in targets:
        if args.verbose:
            _say(f"verifying {name} ...", err=True)
        with _no_warnings(args.verbose):
            # A user's class gets `verify_rule`'s whole battery: its declaration
            # and its invalid hyperparameters too, which the catalogue's tests
            # check for the library's rules.
            r = verify(target) if isinstance(target, Entry) else verify_user(*target)
        results.append(r)
        if args.verbose:
            done = (
                f"{_count(len(r.examples), 'example')} checked "
                f"({_count(len(r.reports), 'check_rule run')}) in {r.seconds:.2f}s"
            )
            _say(
                f"  {name}: {done}, {'passed' if r.passed else 'FAILED'}",
                err=True,
            )
        if not args.json:
            modes = "+".join(r.modes)
            _say(_line(_row(name, modes, r.status, r.seconds), widths))
    failed = [r for r in results if not r.passed]
    if args.json:
        _say(json.dumps([_result_json(r) for r in results], indent=2))
        return 1 if failed else 0
    _say(_LEGEND)
    for r in failed:
        _say("", f"{r.name} FAILED:", *(f"  {line}" for line in r.failures()))
    total = sum(r.seconds for r in results)
    verdict = "FAILED" if failed else "passed"
    _say(
        f"\n{len(results) - len(failed)}/{len(results)} rules passed "
        f"({_count(sum(len(r.examples) for r in results), 'checked example')} in "
        f"{_count(sum(len(r.reports) for r in results), 'check_rule run')}, "
        f"{total:.1f}s): {verdict}"
    )
    return 1 if failed else 0


def _result_json(r: EntryResult | UserResult) -> dict[str, Any]:
    return {
        "name": r.name,
        "module": r.module.__name__,
        "passed": r.passed,
        "modes": list(r.modes),
        "checks": {c: r.status(c) for c in CHECKS},
        "examples": len(r.examples),
        "check_rule_runs": len(r.reports),
        "seconds": round(r.seconds, 3),
        "failures": r.failures(),
    }


def _select(
    names: Sequence[str] | None, users: bool = False, command: str = "verify"
) -> list[tuple[str, Any]]:
    """`(name, entry)` for each catalogue name (all, if none is given); with
    `users`, a `PKG.MODULE:NAME` is imported: a library rule class gives its entry,
    a user's rule class `(name, (name, class))`."""
    entries = catalogue()
    if not names:
        return [(e.name, e) for e in entries]
    by_name = {e.name: e for e in entries} | {e.module.__name__: e for e in entries}
    unknown = [n for n in names if n not in by_name and not (users and ":" in n)]
    if unknown:
        yours = " (a rule of your own: PKG.MODULE:NAME)" if users else ""
        raise SystemExit(
            f"eqxrules: unknown rule(s) {unknown}{yours}; known: "
            f"{sorted(e.name for e in entries)}"
        )
    selected: list[tuple[str, Any]] = []
    for n in names:
        target = by_name.get(n) or verify_target(
            _import(n, "the rule", command), n, command
        )
        if isinstance(target, Entry):
            selected.append((target.name, target))
        else:
            selected.append((n, (n, target)))
    return selected


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


def _plot(args: argparse.Namespace) -> int:
    try:
        from ._plot import plot
    except ModuleNotFoundError as e:
        _say(f"eqxrules plot: {e}", err=True)
        return 2
    paths = []
    # One rule at a time, so that `--verbose` can say which is being drawn.
    for name, target in _select(args.names, users=True, command="plot"):
        rule = target if isinstance(target, Entry) else target[1]
        if args.verbose:
            _say(f"plotting {name} ...", err=True)
        start = time.perf_counter()
        try:
            (path,) = plot([rule], args.out)
        except (ModuleNotFoundError, ValueError) as e:
            _say(f"eqxrules plot: {e}", err=True)
            return 2
        if args.verbose:
            _say(f"  wrote {path} in {time.perf_counter() - start:.2f}s", err=True)
        paths.append(path)
    if args.json:
        _say(json.dumps([str(p) for p in paths]))
    else:
        where = pathlib.Path(args.out).resolve()
        default = " (the default: choose another with `--out DIR`)"
        _say(
            *(str(p) for p in paths),
            f"Wrote {_count(len(paths), 'plot')} to {where}"
            f"{default if args.out == _PLOTS else ''}.",
        )
    return 0


_JSON_HELP = "print JSON instead of a table"
_VERBOSE_HELP = (
    "say more: progress on stderr (verify, plot), a summary column (list), every "
    "check's result and any warning (check)"
)
_PLOTS = "plots"


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


def _version() -> str:
    """`eqxrules 0.2.0 (jax 0.10.2, equinox 0.13.0)`: what a bug report needs."""
    from . import __version__

    return f"eqxrules {__version__} (jax {jax.__version__}, equinox {eqx.__version__})"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m eqxrules",
        description="Verify the eqxrules catalogue on this machine's JAX backend "
        "(the default) or a rule class of your own, list the catalogue, check your "
        "own rule or function, or plot rules. `--json` and `--verbose` go before or "
        "after the command.",
        parents=[_flags(False)],
    )
    parser.add_argument(
        "--version",
        action="version",
        version=_version(),
        help="print the versions of eqxrules, JAX and Equinox, and exit",
    )
    flags = [_flags(argparse.SUPPRESS)]
    parser.set_defaults(func=_verify, names=None)
    sub = parser.add_subparsers(title="commands")

    v = sub.add_parser(
        "verify",
        help="verify rules (the default: all of them), or your own rule class",
        description="Verify catalogue rules against their own references (every "
        "rule when no name is given). A rule class of your own (a subclass of "
        "eqxrules.JVPRule or eqxrules.VJPRule), named as PKG.MODULE:NAME, gets "
        "eqxrules.verify_rule's whole battery: its declaration, every example at "
        "its kinks and by finite differences, forward mode as declared, its "
        "invalid hyperparameters rejected, bfloat16 kept.",
        parents=flags,
    )
    v.add_argument(
        "names",
        nargs="*",
        help="catalogue names (ste_sign or SteSign), or your rule classes as "
        "PKG.MODULE:NAME (default: the whole catalogue)",
    )
    v.set_defaults(func=_verify)

    ls = sub.add_parser("list", help="print the catalogue", parents=flags)
    ls.add_argument("--markdown", action="store_true", help="as the README's table")
    ls.set_defaults(func=_list)

    c = sub.add_parser(
        "check",
        help="check your own rule or function on random inputs",
        description="Check one callable with eqxrules.testing.check_rule on a "
        "random input: a function, a rule instance, or a rule class (a JVPRule or "
        "VJPRule subclass, yours or the catalogue's, or a catalogue rule's "
        "function), which is built with its defaults. A rule is checked as verify "
        "checks an example: against its own reference_forward and "
        "reference_derivative (or reference_vjp) unless --forward or --derivative "
        "replaces them, on inputs drawn from its declared domain (one per input, "
        "for a rule of several), with the Module's parameters as arguments. Its "
        "modes are those it declares.",
        parents=flags,
    )
    c.add_argument(
        "rule", help="the function, rule instance or rule class, as PKG.MODULE:NAME"
    )
    c.add_argument("--forward", help="reference value, as PKG.MODULE:NAME")
    c.add_argument(
        "--derivative",
        help="function whose autodiff derivative the rule's must equal, PKG.MODULE:NAME",
    )
    c.add_argument(
        "--shape",
        default=None,
        help="input shape, e.g. 8,4 (default: a rule's declared domain's; 8,4 for a "
        "function)",
    )
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
        help=f"plot each rule's value and derivative to NAME.png in ./{_PLOTS} "
        "(needs matplotlib)",
        description="Plot each rule's value and derivative (its first example, on "
        f"its domain) to DIR/NAME.png: ./{_PLOTS}/NAME.png unless `--out` says "
        "otherwise. Needs matplotlib.",
        parents=flags,
    )
    p.add_argument(
        "names",
        nargs="*",
        help="rules to plot: catalogue names, or your rule classes as "
        "PKG.MODULE:NAME (default: the whole catalogue)",
    )
    p.add_argument(
        "--out",
        default=_PLOTS,
        metavar="DIR",
        help="the directory to write NAME.png to, created if missing (default: "
        "%(default)s, under the current directory)",
    )
    p.set_defaults(func=_plot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.func is _list and args.markdown and args.json:
        parser.error("`list`: `--markdown` and `--json` cannot be used together")
    return args.func(args)
