"""Writing the report: the prose templates, number formats, and what the report says
about where and when it was measured.

The prose of each section lives in `templates/<section>.md`, cut into named blocks:
a block starts at a line `<!-- name -->` and runs to the next such line, and its
`{placeholders}` are filled with `str.format`. A section's `render` strings blocks
together with the rows of its tables, which it formats itself."""

from __future__ import annotations

import datetime
import functools as ft
import os
import pathlib
import platform
import re
import subprocess
from typing import Any

import equinox as eqx
import jax

from .config import ROOT

SCRIPT = "python -m benchmarks"
"""How the report tells a reader to run a section again."""

TEMPLATES = pathlib.Path(__file__).resolve().parent / "templates"


@ft.cache
def _blocks(template: str) -> dict[str, str]:
    text = (TEMPLATES / f"{template}.md").read_text()
    parts = re.split(r"^<!-- (\w+) -->\n", text, flags=re.M)
    # parts[0] is what comes before the first marker: nothing of the report.
    return {
        name: body.removesuffix("\n") for name, body in zip(parts[1::2], parts[2::2])
    }


def fill(template: str, block: str, **fields: Any) -> list[str]:
    """The lines of block `block` of `templates/<template>.md`, filled in."""
    return _blocks(template)[block].format(**fields).split("\n")


def measured(res: dict[str, Any]) -> str:
    """When, on what commit and by what command a section was measured, as a
    paragraph (ending in a blank line) to open the section with; empty if unknown."""
    m = res.get("measured")
    if not m:
        return ""
    (line,) = fill(
        "report",
        "measured",
        m=m,
        commit=f" on commit `{m['code']}`" if "code" in m else "",
        machine=f", on {m['cpu']} ({m['cores']} cores)" if "cpu" in m else "",
        before=m["load"][0],
        after=m["load"][1],
    )
    for r in res.get("remeasured", []):
        (again,) = fill(
            "report",
            "remeasured",
            m=r,
            rules=", ".join(f"`{name}`" for name in r["rules"]),
            commit=f" on commit `{r['code']}`" if "code" in r else "",
            before=r["load"][0],
            after=r["load"][1],
        )
        line += " " + again
    return line + "\n\n"


def opening(
    template: str,
    res: dict[str, Any],
    results: dict[str, Any],
    block: str = "intro",
    /,
    **fields: Any,
) -> list[str]:
    """A section's opening block, with `{measured}` and `{command}` filled in."""
    return fill(
        template,
        block,
        measured=measured(res),
        command=command(results, template),
        **fields,
    )


def command(results: dict[str, Any], section: str) -> str:
    """The command that measures `section` again, in backticks."""
    q = " --quick" if results.get("quick") else ""
    return f"`{SCRIPT}{q} --only {section}`"


def ratio(a: float, b: float) -> str:
    if b == 0:
        return "1.000" if a == 0 else "inf"
    return f"{a / b:.4f}"


def spread(w: dict[str, float] | None) -> str:
    """`median [min, max]` of a ratio summary, `-` if there is none."""
    if not w:
        return "-"
    return f"{w['median']:.3f} [{w['min']:.2f}, {w['max']:.2f}]"


def mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def code_version() -> str:
    """The commit measured, with `+changes` if the working tree differs from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    d = jax.devices()[0]
    return dict(
        cpu=cpu,
        cores=os.cpu_count(),
        device_kind=d.device_kind,
        platform=d.platform,
        devices=len(jax.devices()),
        jax=jax.__version__,
        jaxlib=getattr(__import__("jaxlib"), "__version__", "?"),
        equinox=eqx.__version__,
        python=platform.python_version(),
        date=now(),
        load_start=os.getloadavg(),
    )


def header(results: dict[str, Any], sections: list[str]) -> list[str]:
    """The report's title, where and how it was measured, and what the baselines are."""
    commands = dict.fromkeys(
        results[s]["measured"]["command"] for s in sections if s in results
    )
    return [
        *fill("report", "title", script=SCRIPT),
        *(fill("report", "quick") if results.get("quick") else []),
        *fill(
            "report",
            "about",
            commands=", ".join(f"`{c}`" for c in commands),
            m=results["machine"],
        ),
    ]
