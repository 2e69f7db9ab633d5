"""The command line: which sections to run, at which sizes, and where the report
and its JSON go."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import benchmarks
import eqxrules

from . import report
from .config import FULL, QUICK, ROOT, Job
from .sections import SECTIONS

BY_NAME = {s.NAME: s for s in SECTIONS}


def render(results: dict[str, Any]) -> str:
    """The whole report, from the figures of every section measured."""
    lines = report.header(results, list(BY_NAME))
    for section in SECTIONS:
        lines += section.render(results.get(section.NAME), results)
    return "\n".join(lines) + "\n"


def _entries(names: str | None) -> list[Any]:
    entries = list(eqxrules.catalogue())
    if names:
        wanted = set(names.split(","))
        unknown = wanted - {e.name for e in entries}
        if unknown:
            raise SystemExit(f"unknown rule(s): {', '.join(sorted(unknown))}")
        entries = [e for e in entries if e.name in wanted]
    return entries


def merge_rows(
    section: str,
    saved: dict[str, Any],
    figures: dict[str, Any],
    measured: dict[str, Any],
    entries: Sequence[Any],
) -> dict[str, Any]:
    """`--merge --rules ...`: the saved figures of `section` with the rows of the
    rules run now replaced (a section of one row per example, each row comparing a
    rule with its hand-written baseline in the same run). The section keeps its
    own `measured` stamp; this run's is appended to `remeasured` with the rules it
    re-measured, and the report says which rows are of which run. A rule added to
    the catalogue is measured this way without re-measuring the others."""
    names = [e.name for e in entries]
    if set(figures) != {"rows"} or set(saved) - {"rows", "measured", "remeasured"}:
        raise SystemExit(
            f"`--rules` with `--merge`: section {section!r} is not one row per rule "
            "example; run it without `--rules`"
        )
    order = [e.name for e in eqxrules.catalogue()]
    kept = [r for r in saved["rows"] if r["entry"] not in names]
    rows = sorted(
        [*kept, *figures["rows"]],
        key=lambda r: order.index(r["entry"]) if r["entry"] in order else len(order),
    )
    machine = report.machine()
    stamp = dict(measured, rules=names, cpu=machine["cpu"], cores=machine["cores"])
    return dict(saved, rows=rows, remeasured=[*saved.get("remeasured", []), stamp])


def _binariser(name: str) -> Any:
    by_name = {e.name: e for e in eqxrules.catalogue()}
    if name not in by_name:
        raise SystemExit(f"`--binariser` {name!r} is not in the catalogue")
    return by_name[name].examples(jax.random.key(0))[0]


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items() if k != "compiled"}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return x


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=benchmarks.__doc__.splitlines()[0],
        epilog="sections:\n"
        + "\n".join(f"  {s.NAME:<11}{s.__doc__.splitlines()[0]}" for s in SECTIONS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="small sizes, for developing")
    p.add_argument("--json", action="store_true", help="also write the figures as JSON")
    p.add_argument(
        "--suite", action="store_true", help="also time pytest and the CLI (minutes)"
    )
    p.add_argument("--only", help=f"comma-separated sections of {tuple(BY_NAME)}")
    p.add_argument("--rules", help="comma-separated catalogue names (default: all)")
    p.add_argument(
        "--all-examples",
        action="store_true",
        help="every example of each rule, not just the first (XLA figures only)",
    )
    p.add_argument("--binariser", default="ste_sign", help="rule of the binarised net")
    p.add_argument(
        "--out",
        help="the report (default `benchmarks/RESULTS.md`, with `--quick` "
        "`benchmarks/RESULTS.quick.md`); the JSON goes next to it, as `.json`",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the other sections of the JSON next to the report, replace the "
        "ones run now, and re-render (implies --json)",
    )
    p.add_argument(
        "--render", action="store_true", help="only re-render the saved JSON"
    )
    return p


def main(argv: Sequence[str] | None = None, prog: str = report.SCRIPT) -> int:
    """Run the chosen sections and write the report. `prog` is how this was invoked,
    recorded with each section's figures."""
    args = _parser(prog).parse_args(argv)
    if args.only:
        names = args.only.split(",")
    else:
        names = [s.NAME for s in SECTIONS if s.DEFAULT]
    if args.render:
        args.merge, names = True, []
    if args.suite and "suite" not in names:
        names.append("suite")
    unknown = set(names) - set(BY_NAME)
    if unknown:
        raise SystemExit(f"unknown section(s): {', '.join(sorted(unknown))}")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    given = sys.argv[1:] if argv is None else []
    command = " ".join([prog, *given])
    name = "RESULTS.quick.md" if args.quick else "RESULTS.md"
    out = pathlib.Path(args.out or ROOT / "benchmarks" / name)
    json_path = out.with_suffix(".json")
    results: dict[str, Any] = {}
    if args.merge and json_path.exists():
        results = json.loads(json_path.read_text())
        if results.get("quick", False) != args.quick:
            raise SystemExit("`--merge`: the saved results are of the other size")
    # Re-rendering measures nothing, and re-measuring some rules' rows, or some
    # sections of a saved report, keeps the report's machine (that of the rest):
    # each stamp measured on another machine names its own.
    partial = bool(args.merge and results and (args.rules or args.only))
    here = report.machine()
    if not args.render and not partial:
        results.update(machine=here, quick=args.quick)
    elsewhere = results.get("machine", {}).get("cpu") != here["cpu"]
    job = Job(
        sizes=QUICK if args.quick else FULL,
        quick=args.quick,
        entries=_entries(args.rules),
        binariser=_binariser(args.binariser),
        all_examples=args.all_examples,
        log=log,
    )
    started = time.perf_counter()
    for section in names:
        log(f"[{time.perf_counter() - started:6.0f}s] {section}")
        measured = dict(
            date=report.now(),
            command=command,
            code=report.code_version(),
            load=[os.getloadavg()[0]],
            **(dict(cpu=here["cpu"], cores=here["cores"]) if elsewhere else {}),
        )

        def save(figures: dict[str, Any]) -> None:
            # The load now: at the end once the section is done, else so far.
            stamp = dict(measured, load=[*measured["load"], os.getloadavg()[0]])
            if args.rules and args.merge and section in saved:
                results[section] = merge_rows(
                    section, saved[section], figures, stamp, job.entries
                )
            else:
                results[section] = dict(figures, measured=stamp)
            if args.json or args.merge:  # the report stays its JSON rendered
                json_path.write_text(json.dumps(_jsonable(results), indent=1))
                out.write_text(render(results))

        saved = dict(results)
        section_job = dataclasses.replace(job, previous=saved.get(section), save=save)
        save(BY_NAME[section].run(section_job))
    seconds = time.perf_counter() - started
    out.write_text(render(results))
    log(f"wrote {out} in {seconds:.0f}s")
    if args.json or args.merge:
        log(f"wrote {json_path}")
    return 0
