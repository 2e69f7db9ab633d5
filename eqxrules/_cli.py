"""`python -m eqxrules`: verify the catalogue on this machine, list it, check a
user's rule, or plot rules."""

import argparse
import json
import pathlib
import time
from collections.abc import Sequence
from typing import Any

from ._catalogue import Entry, catalogue
from ._cli_check import (
    _check,
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
from ._verify import EntryResult, verify
from .testing import CHECKS


def _verify(args: argparse.Namespace) -> int:
    entries = _select(args.names)
    widths = _stream_widths([e.name for e in entries])
    if not args.json:
        _say(
            _device_line(),
            f"Verifying {_count(len(entries), 'rule')} with "
            "eqxrules.testing.check_rule ...",
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
            done = (
                f"{_count(len(r.examples), 'example')} checked "
                f"({_count(len(r.reports), 'check_rule run')}) in {r.seconds:.2f}s"
            )
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
        f"({_count(sum(len(r.examples) for r in results), 'checked example')} in "
        f"{_count(sum(len(r.reports) for r in results), 'check_rule run')}, "
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
        "examples": len(r.examples),
        "check_rule_runs": len(r.reports),
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


def _plot(args: argparse.Namespace) -> int:
    try:
        from ._plot import plot
    except ModuleNotFoundError as e:
        _say(f"eqxrules plot: {e}", err=True)
        return 2
    paths = []
    # One rule at a time, so that `--verbose` can say which is being drawn.
    for entry in _select(args.names):
        if args.verbose:
            _say(f"plotting {entry.name} ...", err=True)
        start = time.perf_counter()
        try:
            (path,) = plot([entry.name], args.out)
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
        help=f"plot each rule's value and derivative to NAME.png in ./{_PLOTS} "
        "(needs matplotlib)",
        description="Plot each rule's value and derivative (its first example, on "
        f"its domain) to DIR/NAME.png: ./{_PLOTS}/NAME.png unless `--out` says "
        "otherwise. Needs matplotlib.",
        parents=flags,
    )
    p.add_argument("names", nargs="*", help="rules to plot (default: all)")
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
