"""Wall time of the suite's two tiers (`python -m pytest`, the README's command, and
`python -m pytest -m slow`; `.ci/run` runs both), and of `python -m eqxrules` (only with `--suite`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Any

from .. import report
from ..config import ROOT, Job

NAME = "suite"
DEFAULT = False  # minutes: only with `--suite` or `--only suite`
# `python -m eqxrules` first, its figures saved before the tiers run: the suite checks
# that the saved CLI line counts this catalogue's rules (tests/test_readme.py), so a
# run after adding a rule passes its own tests.
COMMANDS = {
    "cli": [sys.executable, "-m", "eqxrules"],
    "pytest": [sys.executable, "-m", "pytest"],
    "slow": [sys.executable, "-m", "pytest", "-m", "slow"],
}
# Added to `XLA_FLAGS` for a command, as `.ci/run` runs it: the slow tier compiles
# with XLA's CPU emitters of before its fusion emitters.
FLAGS = {"slow": "--xla_cpu_use_fusion_emitters=false"}


def _env(name: str) -> dict[str, str]:
    env = dict(os.environ)
    if name in FLAGS:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FLAGS[name]}".strip()
    return env


def run(job: Job) -> dict[str, Any]:
    out = {}
    for name, cmd in COMMANDS.items():
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        proc = subprocess.run(
            cmd, capture_output=True, text=True, cwd=ROOT, env=_env(name)
        )
        seconds = time.perf_counter() - t0
        lines = [line for line in proc.stdout.strip().splitlines() if line.strip()]
        summary = [
            line for line in lines if re.search(r"\d+ (passed|failed|error)", line)
        ]
        tail = summary or lines
        out[name] = dict(
            command=" ".join(
                ([f"XLA_FLAGS={FLAGS[name]}"] if name in FLAGS else [])
                + ["python"]
                + cmd[1:]
            ),
            seconds=seconds,
            returncode=proc.returncode,
            last_line=tail[-1] if tail else proc.stderr.strip()[-200:],
            load_before=load,
        )
        job.log(f"  {name}: {seconds:.1f}s rc={proc.returncode}")
        job.save(out)
    return out


def render(res: dict[str, Any] | None, results: dict[str, Any]) -> list[str]:
    if res is None:
        return []
    lines = report.opening(NAME, res, results, script=report.SCRIPT)
    for name in COMMANDS:
        if name not in res:  # recorded before the command was added
            continue
        r = res[name]
        lines.append(
            f"| `{r['command']}` | {r['seconds']:.1f} | {r['returncode']} | "
            f"{r['last_line']} | {r['load_before']:.1f} |"
        )
    return lines + [""]
