"""`python -m eqxrules`: verify the catalogue on this machine, list it, check a
user's rule, or plot rules."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ._catalogue import Entry, catalogue
from ._verify import EntryResult, verify
from .testing import CHECKS, RuleReport, check_rule

_SYMBOL = {"passed": "ok", "failed": "FAIL", "unsupported": "n/a", "skipped": "-"}
_SHORT = {
    "primal": "primal",
    "jvp": "jvp",
    "linearity": "linear",
    "vjp": "vjp",
    "transpose": "transp",
    "finite_differences": "fd",
    "batching": "vmap",
    "jit": "jit",
    "zero_cotangent": "zero",
    "dtype": "dtype",
}
_LEGEND = "ok = passed, FAIL = failed, n/a = mode not supported, - = not applicable"


def _device_line() -> str:
    devices = jax.devices()
    d = devices[0]
    return (
        f"JAX {jax.__version__} on backend {jax.default_backend()!r}: "
        f"{len(devices)} x {d.device_kind} ({d.platform})"
    )


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def _header() -> list[str]:
    return ["rule", "modes", *(_SHORT[c] for c in CHECKS), "time"]


def _row(name: str, modes: str, status: Callable[[str], str], seconds: float):
    return [name, modes, *(_SYMBOL[status(c)] for c in CHECKS), f"{seconds:.2f}s"]


def _verify(args: argparse.Namespace) -> int:
    entries = _select(args.names)
    if not args.json:
        print(_device_line())
        print(f"Verifying {len(entries)} rules with eqxrules.testing.check_rule ...")
    results: list[EntryResult] = []
    for entry in entries:
        results.append(verify(entry))
        if not args.json and args.verbose:
            print(f"  {entry.name}: {results[-1].seconds:.2f}s", file=sys.stderr)
    failed = [r for r in results if not r.passed]
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "name": r.entry.name,
                        "module": r.entry.module.__name__,
                        "passed": r.passed,
                        "modes": list(r.entry.modes),
                        "checks": {c: r.status(c) for c in CHECKS},
                        "examples": len(r.reports),
                        "seconds": round(r.seconds, 3),
                        "failures": r.failures(),
                    }
                    for r in results
                ],
                indent=2,
            )
        )
    else:
        rows = [
            _row(r.entry.name, "+".join(r.entry.modes), r.status, r.seconds)
            for r in results
        ]
        print(_table(rows, _header()))
        print(_LEGEND)
        for r in failed:
            print(f"\n{r.entry.name} FAILED:")
            for line in r.failures():
                print(f"  {line}")
        total = sum(r.seconds for r in results)
        verdict = "FAILED" if failed else "passed"
        print(
            f"\n{len(results) - len(failed)}/{len(results)} rules passed "
            f"({sum(len(r.reports) for r in results)} checked examples, "
            f"{total:.1f}s): {verdict}"
        )
    return 1 if failed else 0


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
        print(catalogue_markdown())
        return 0
    rows = [
        [e.name, e.module.__name__, "+".join(e.modes), "yes" if e.exact else "no"]
        for e in catalogue()
    ]
    print(_table(rows, ["rule", "Module", "modes", "exact"]))
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


def _check(args: argparse.Namespace) -> int:
    fn = _import(args.rule, "the rule")
    forward = _import(args.forward, "`--forward`") if args.forward else None
    derivative = _import(args.derivative, "`--derivative`") if args.derivative else None
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
    x = jax.random.normal(jax.random.key(args.seed), shape, jnp.float32).astype(dtype)
    print(_device_line())
    report: RuleReport = check_rule(
        fn,
        x,
        forward=forward,
        derivative=derivative,
        raise_on_failure=False,
        key=jax.random.key(args.seed),
    )
    modes = "fwd+rev" if report.forward_mode else "rev"
    print(
        _table(
            [_row(args.rule, modes, lambda c: report[c].status, report.seconds)],
            _header(),
        )
    )
    print(_LEGEND)
    for r in report.results:
        if r.status == "failed":
            print(f"  {r.describe()}")
    print("passed" if report.passed else "FAILED")
    return 0 if report.passed else 1


def _plot(args: argparse.Namespace) -> int:
    try:
        from ._plot import plot
    except ModuleNotFoundError as e:
        print(f"eqxrules plot: {e}", file=sys.stderr)
        return 2
    try:
        paths = plot(args.names or None, args.out)
    except ModuleNotFoundError as e:
        print(f"eqxrules plot: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"eqxrules plot: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m eqxrules",
        description="Verify the eqxrules catalogue on this machine's JAX backend "
        "(the default), list it, check your own rule, or plot rules.",
    )
    parser.add_argument(
        "--json", action="store_true", help="print JSON, one object per rule"
    )
    parser.add_argument(
        "--verbose", action="store_true", help="print progress to stderr"
    )
    parser.set_defaults(func=_verify, names=None)
    sub = parser.add_subparsers(title="commands")

    v = sub.add_parser("verify", help="verify rules (the default: all of them)")
    v.add_argument("names", nargs="*", help="rules to verify (default: all)")
    v.add_argument(
        "--json", action="store_true", help="print JSON, one object per rule"
    )
    v.add_argument("--verbose", action="store_true", help="print progress to stderr")
    v.set_defaults(func=_verify)

    ls = sub.add_parser("list", help="print the catalogue")
    ls.add_argument("--markdown", action="store_true", help="as the README's table")
    ls.set_defaults(func=_list)

    c = sub.add_parser("check", help="check your own rule on random inputs")
    c.add_argument("rule", help="the rule, as PKG.MODULE:NAME")
    c.add_argument("--forward", help="reference value, as PKG.MODULE:NAME")
    c.add_argument(
        "--derivative",
        help="function whose autodiff derivative the rule's must equal, PKG.MODULE:NAME",
    )
    c.add_argument("--shape", default="8,4", help="input shape, e.g. 8,4")
    c.add_argument("--dtype", default="float32", help="input dtype, e.g. bfloat16")
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(func=_check)

    p = sub.add_parser(
        "plot", help="plot each rule's value and derivative (needs matplotlib)"
    )
    p.add_argument("names", nargs="*", help="rules to plot (default: all)")
    p.add_argument("--out", default="plots", help="output directory")
    p.set_defaults(func=_plot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return args.func(args)
