"""One command for a lent GPU (issue 41 §4): everything this project checks on an
accelerator, in under 8 minutes on an H100 by its budgets (the catalogue at most
300 s beside the tests' 270 s, then about two minutes), findings written to a
folder.

    python3 benchmarks/gpu.py --out DIR [--quick] [--only SECTION ...]

From the repository root, with JAX, Equinox, pytest, pytest-xdist and hypothesis
installed (a lent machine has them; nothing is fetched). It sets
`XLA_PYTHON_CLIENT_PREALLOCATE=false` and puts the checkout first on the path.
It runs, in order (`SECTIONS`; `catalogue` and `tests` at the same time, as
they wait on processes; the rest alone, so that timings are not disturbed):

- `environment`: versions and the device;
- `arithmetic`: the device's float32 functions, division, subnormals and default
    matrix precision against NumPy's float64 (`gpu_checks.arithmetic`);
- `catalogue`: `python -m eqxrules --json`, every rule verified on the device;
- `tests`: the low-precision test files (`TEST_FILES`), each in its own pytest
    process with its own timeout, several at once;
- `scaled_dot_general`: `quantized_dot_general` with
    `recipes.MXFP8(scale_rounding="ceil")` against `jax.nn.scaled_dot_general`;
- `training`: one SGD step of `fp8()`, `mxfp8()`, bfloat16 and float32 products
    at width 4096, timed.

It writes `DIR/gpu.json` (everything) and `DIR/gpu.md` (a summary per section), and
prints the summary. A section ends `passed`, `failed` (what it found says so: a rule
or a test failed, a product disagreed), `unavailable` (cannot run on this backend at
this JAX; the reason is recorded) or `error` (the section itself raised: its
traceback is recorded, and the later sections still run). The exit status is 0 only
if none failed or raised. With `--quick` (for the CPU; the slow tier runs it so that
it cannot rot) every section runs at small sizes: the two rules that failed on the
H100, one test file, a 64x256 @ 256x32 product, width 256.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The low-precision tests: the quantisers, the three products and their recipes,
# residuals, batching and the ragged product (their quick tier); first those that
# failed on the H100 (benchmarks/GPU.md), so that a tight budget runs them.
TEST_FILES = [
    "test_backend_references.py",
    "test_quantized_dot.py",
    "test_stochastic_rounding_rules.py",
    "test_recipe_formats.py",
    "test_calibrate.py",
    "test_exact_products.py",
    "test_quantized_dot_sr.py",
    "test_quantized_products.py",
    "test_field_recipes.py",
    "test_fine_grained.py",
    "test_residuals.py",
    "test_batching.py",
    "test_ragged_dot.py",
    "test_ragged_batch.py",
    "test_encoded.py",
    "test_recipes.py",
    "test_mx_top_of_range.py",
    "test_nan_scales.py",
    "test_token_leaks.py",
    "test_quantize_convs.py",
    "test_float_formats.py",
    "test_softmax_derivative.py",
]
QUICK_TEST_FILES = ["test_exact_products.py"]
# The rules that failed `python -m eqxrules` on the H100 (benchmarks/GPU.md).
QUICK_RULES = ["swish_sign", "gumbel_softmax"]
TAIL = 4000  # characters of a process's output kept


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return env


def command(argv: Sequence[str], timeout: float) -> dict[str, Any]:
    """Run `argv` from the checkout's root: its exit code (`None` if it ran past
    `timeout` seconds and was killed), seconds, and the end of its output."""
    env = _env()
    start = time.perf_counter()
    try:
        done = subprocess.run(
            list(argv),
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        code = None
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    return {
        "argv": list(argv),
        "returncode": code,
        "timed_out": code is None,
        "seconds": round(time.perf_counter() - start, 1),
        "stdout": out,
        "stderr_tail": err[-TAIL:],
    }


# -- the sections ---------------------------------------------------------------


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """The versions and the device the findings are of."""
    import equinox as eqx
    import jax
    import numpy as np

    import eqxrules

    devices = jax.devices()
    return {
        "status": "passed",
        "python": platform.python_version(),
        "jax": jax.__version__,
        "equinox": eqx.__version__,
        "numpy": np.__version__,
        "eqxrules": eqxrules.__version__,
        "backend": jax.default_backend(),
        "devices": [f"{d.platform}: {d.device_kind}" for d in devices],
        "commit": _commit(),
    }


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def catalogue(args: argparse.Namespace) -> dict[str, Any]:
    """`python -m eqxrules --json` (with `--quick`, the rules of `QUICK_RULES`):
    every rule, and for each that failed its failures."""
    names = QUICK_RULES if args.quick else []
    run = command(
        [sys.executable, "-m", "eqxrules", "verify", *names, "--json"],
        args.catalogue_timeout,
    )
    stdout = run.pop("stdout")
    try:
        rules = json.loads(stdout)
    except json.JSONDecodeError:
        rules = None
    run["stdout_tail"] = stdout[-TAIL:]
    if rules is None:
        return {"status": "failed", "why": "no JSON from the command", **run}
    failed = {r["name"]: r["failures"] for r in rules if not r["passed"]}
    ok = run["returncode"] == 0 and not failed
    if ok:
        del run["stdout_tail"]
    return {
        "status": "passed" if ok else "failed",
        "rules": len(rules),
        "passed": len(rules) - len(failed),
        "failed": failed,
        **run,
    }


def _pytest(name: str, timeout: float) -> dict[str, Any]:
    run = command(
        [sys.executable, "-m", "pytest", f"tests/{name}", "-n", "0", "-rfE"],
        timeout,
    )
    stdout = run.pop("stdout")
    lines = [line for line in stdout.splitlines() if line.strip()]
    run["summary"] = lines[-1] if lines else ""
    run["failures"] = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    if run["returncode"] != 0:
        run["stdout_tail"] = stdout[-TAIL:]
    return run


def tests(args: argparse.Namespace) -> dict[str, Any]:
    """The low-precision test files' quick tier, each file its own pytest process
    (`-n 0`) with its own timeout, `--jobs` at once, within `--tests-budget`
    seconds in all: a file not started in time is recorded as not run, and the
    section fails."""
    files = QUICK_TEST_FILES if args.quick else TEST_FILES
    end = time.perf_counter() + args.tests_budget

    def one(name: str) -> dict[str, Any]:
        left = end - time.perf_counter()
        if left < 10:
            return {"returncode": None, "not_run": "the budget was spent"}
        return _pytest(name, min(args.test_timeout, left))

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        runs = dict(zip(files, pool.map(one, files)))
    bad = [f for f, r in runs.items() if r["returncode"] != 0]
    not_run = [f for f, r in runs.items() if "not_run" in r]
    return {
        "status": "failed" if bad else "passed",
        "failed_files": [f for f in bad if f not in not_run],
        "not_run": not_run,
        "files": runs,
    }


def _in_process(name: str) -> Callable[[argparse.Namespace], dict[str, Any]]:
    def section(args: argparse.Namespace) -> dict[str, Any]:
        from benchmarks import gpu_checks

        return getattr(gpu_checks, name)(args.quick)

    section.__doc__ = f"`gpu_checks.{name}`."
    return section


SECTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "environment": environment,
    "arithmetic": _in_process("arithmetic"),
    "catalogue": catalogue,
    "tests": tests,
    "scaled_dot_general": _in_process("scaled_dot_general"),
    "training": _in_process("training"),
}


# Sections run at the same time: each waits on its own processes.
TOGETHER = ("catalogue", "tests")


def _one(name: str, section: Callable, args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        found = dict(section(args))
    except Exception as e:  # noqa: BLE001 - recorded, never dropped
        found = {
            "status": "error",
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()[-TAIL:],
        }
    found.setdefault("status", "error")
    found["seconds"] = round(time.perf_counter() - start, 1)
    print(f"gpu.py: {name}: {found['status']} ({found['seconds']} s)", flush=True)
    return found


def run_sections(
    sections: dict[str, Callable[[argparse.Namespace], dict[str, Any]]],
    args: argparse.Namespace,
    together: Sequence[str] = TOGETHER,
) -> dict[str, dict[str, Any]]:
    """Each section's findings, in order; one that raises is recorded as `error`
    with its traceback, and the next still runs. The sections named in `together`
    run at the same time, when the first of them is due (they run processes, so
    the in-process sections' timings are not disturbed)."""
    results: dict[str, dict[str, Any]] = {}
    for name, section in sections.items():
        if name in results:
            continue
        group = [n for n in sections if n in together] if name in together else [name]
        print(f"gpu.py: {', '.join(group)} ...", flush=True)
        with concurrent.futures.ThreadPoolExecutor(len(group)) as pool:
            futures = {n: pool.submit(_one, n, sections[n], args) for n in group}
        for n in group:
            results[n] = futures[n].result()
    return {n: results[n] for n in sections}


# -- the report -----------------------------------------------------------------


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _lines(name: str, found: dict[str, Any]) -> list[str]:
    """A section's findings in markdown: its status, then its scalars, then its
    tables (a list of rows, or a mapping of rows)."""
    out = [f"## {name}: {found['status']} ({found['seconds']} s)", ""]
    for key, value in found.items():
        if key in ("status", "seconds") or isinstance(value, (dict, list)):
            continue
        out.append(f"- {key}: {_cell(value)}")
    for key, value in found.items():
        rows = list(value.values()) if isinstance(value, dict) else value
        if not isinstance(value, (dict, list)) or not rows:
            continue
        if all(isinstance(r, dict) for r in rows):
            labels = list(value) if isinstance(value, dict) else range(len(rows))
            columns = [
                c
                for c in dict.fromkeys(c for r in rows for c in r)
                if not any(isinstance(r.get(c), (dict, list)) for r in rows)
                and c not in ("argv", "stdout_tail", "stderr_tail", "traceback")
            ]
            out += ["", f"{key}:", "", "| | " + " | ".join(columns) + " |"]
            out.append("|---" * (len(columns) + 1) + "|")
            for label, r in zip(labels, rows):
                cells = [_cell(r.get(c, "")) for c in columns]
                out.append(f"| {label} | " + " | ".join(cells) + " |")
            # A row's lists (a test file's failures) below the table.
            out += [""] + [
                f"- {label} {c}: {json.dumps(v)[:2000]}"
                for label, r in zip(labels, rows)
                for c, v in r.items()
                if isinstance(v, list) and v and c != "argv"
            ]
        else:
            out.append(f"- {key}: {json.dumps(value)[:2000]}")
    if "traceback" in found:
        out += ["", "```", found["traceback"].rstrip(), "```"]
    return [*out, ""]


def markdown(results: dict[str, dict[str, Any]]) -> str:
    head = ["# eqxrules on this device: `benchmarks/gpu.py`", ""]
    head += [f"- {n}: {r['status']}" for n, r in results.items()]
    return "\n".join(
        [*head, "", *(x for n, r in results.items() for x in _lines(n, r))]
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python3 benchmarks/gpu.py",
        description="Run what eqxrules checks on an accelerator; write the findings "
        "to OUT/gpu.json and OUT/gpu.md.",
    )
    p.add_argument("--out", required=True, type=pathlib.Path, help="a folder")
    p.add_argument("--quick", action="store_true", help="small sizes, for the CPU")
    p.add_argument("--only", nargs="+", choices=list(SECTIONS), help="these sections")
    p.add_argument(
        "--jobs", type=int, default=min(6, max(1, (os.cpu_count() or 2) // 2))
    )
    p.add_argument("--catalogue-timeout", type=float, default=300.0)
    p.add_argument("--test-timeout", type=float, default=180.0)
    p.add_argument("--tests-budget", type=float, default=270.0)
    return p


def main(
    argv: Sequence[str] | None = None,
    sections: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] | None = None,
) -> int:
    args = _parser().parse_args(argv)
    chosen = dict(sections if sections is not None else SECTIONS)
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only}
    results = run_sections(chosen, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(json.dumps(results, indent=2, default=str))
    text = markdown(results)
    (args.out / "gpu.md").write_text(text)
    print()
    print("\n".join(text.splitlines()[: 2 + len(results)]))
    bad = [n for n, r in results.items() if r["status"] in ("failed", "error")]
    print(
        f"\ngpu.py: {len(results) - len(bad)} of {len(results)} sections passed "
        f"or were unavailable; findings in {args.out}/gpu.md and gpu.json"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
