"""Regenerate what is derived from the catalogue and committed: the README's
catalogue table, its checks (from `check_rule`'s docstring) and its example rule
(the source of `QuadraticSign`), and the rules' type stub
(`scripts/update_stubs.py`). `tests/test_readme.py` and `tests/test_package.py`
fail until this has been run after a rule or a check changes:
`python scripts/update_readme.py`.

The README's figures of `examples/qat_digits.py`, its QAT table and its row of the
examples table, are generated from one recorded run, `examples/qat_digits.json`:
`python scripts/update_readme.py --figures` runs the example in full mode (about
three minutes: run it on a quiet machine) to record it again first."""

import inspect
import json
import os
import pathlib
import re
import subprocess
import sys

import eqxrules
from eqxrules import _cli
from eqxrules.testing import check_rule

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
QAT_EXAMPLE = ROOT / "examples" / "qat_digits.py"
QAT_FIGURES = QAT_EXAMPLE.with_suffix(".json")

# The README's words for each row of the example's `ROWS` (a new row needs one:
# tests/test_readme.py checks).
QAT_LABELS = {
    "float32": "float32",
    "LSQ W4A4": "LSQ, 4-bit weights (per channel) and inputs",
    "LSQ W2A2": "LSQ, 2-bit",
    "fixed-range SteQuantize W4A4": "fixed-range `SteQuantize`, 4-bit (weights on "
    "[-1, 1], inputs on [0, 1])",
    "fixed-range SteQuantize W2A2": "fixed-range `SteQuantize`, 2-bit",
    "LSQ W2 + PACT A2": "LSQ 2-bit weights + PACT 2-bit inputs",
    "MXFP8 W8A8": "MXFP8 (e4m3, blocks of 32) weights and inputs",
    "MXFP4 W4 + MXFP8 A8": "MXFP4 (e2m1, blocks of 32) weights, MXFP8 inputs",
    "NVFP4 W4": "NVFP4 weights (blocks of 16), float inputs",
}
_QAT_HEADER = (
    "| configuration (`ROWS` in the example) | post-training (float32 model "
    "quantised, no training) | trained (QAT) |\n|---|---|---|"
)
_QAT_ROW = "| `qat_digits.py` |"


def _replace(text: str, name: str, body: str) -> str:
    pattern = f"<!-- {name}:begin -->\n.*?<!-- {name}:end -->"
    block = f"<!-- {name}:begin -->\n{body}\n<!-- {name}:end -->"
    return re.sub(pattern, lambda _: block, text, flags=re.S)


def example_rule() -> str:
    """The README's example of a whole rule: a real one of the catalogue."""
    return f"```python\n{inspect.getsource(eqxrules.QuadraticSign)}```"


def _cell(accuracies: list[float] | None) -> str:
    """Mean of the seeds (lowest, highest), as the example prints it."""
    if not accuracies:
        return "—"
    mean = f"{sum(accuracies) / len(accuracies):.1%}"
    if len(accuracies) == 1:
        return mean
    return f"{mean} ({min(accuracies):.1%}, {max(accuracies):.1%})"


def qat_table(figures: dict) -> str:
    """The README's QAT table, from a recorded run of `examples/qat_digits.py`."""
    rows = [
        f"| {QAT_LABELS[r['name']]} | {_cell(r['post_training'])} | "
        f"{_cell(r['trained'])} |"
        for r in figures["rows"]
    ]
    return "\n".join([_QAT_HEADER, *rows])


def _table_means(table: str) -> dict[str, tuple[str, str]]:
    """`{row name: (post-training mean, trained mean)}` read back from a QAT table."""
    names = {label: name for name, label in QAT_LABELS.items()}
    out = {}
    for line in table.splitlines()[2:]:
        label, post, trained = (c.strip() for c in line.strip("| ").split(" | "))
        out[names.get(label, label)] = (post.split(" ")[0], trained.split(" ")[0])
    return out


def qat_headline(table: str, seeds: int) -> str:
    """The examples table's figures for `qat_digits.py`, read from the QAT table
    (so the two cannot disagree)."""
    m = _table_means(table)
    return (
        f"float32 {m['float32'][1]}; LSQ W4A4 {m['LSQ W4A4'][1]}, "
        f"W2A2 {m['LSQ W2A2'][1]}; NVFP4 W4 {m['NVFP4 W4'][0]} post-training, "
        f"{m['NVFP4 W4'][1]} trained ({seeds} seeds)"
    )


def qat_example_row(figures: dict) -> str:
    """The examples table's row for `qat_digits.py`, from a recorded run."""
    seeds = len(figures["rows"][0]["trained"])
    return (
        f"{_QAT_ROW} quantisation-aware training (LSQ, PACT, fixed-range, "
        f"MXFP8/MXFP4, NVFP4) against float32 | {figures['seconds']:.0f} s | "
        f"{qat_headline(qat_table(figures), seeds)} |"
    )


def qat_disagreements(readme: str) -> list[str]:
    """Where the README's examples row says other figures than its QAT table."""
    table = re.search(
        r"<!-- qat-table:begin -->\n(.*?)\n<!-- qat-table:end -->", readme, re.S
    )
    row = next((ln for ln in readme.splitlines() if ln.startswith(_QAT_ROW)), None)
    if table is None or row is None:
        return ["the README has no QAT table or no `qat_digits.py` row"]
    seeds = re.search(r"\((\d+) seeds\) \|$", row)
    expected = qat_headline(table.group(1), int(seeds.group(1)) if seeds else 0)
    headline = row.rsplit(" | ", 1)[1].removesuffix(" |")
    return [] if headline == expected else [f"row: {headline!r}; table: {expected!r}"]


def record_qat_figures() -> None:
    """Run `examples/qat_digits.py` in full mode, writing `examples/qat_digits.json`."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run(
        [sys.executable, str(QAT_EXAMPLE), "--record"], check=True, env=env, cwd=ROOT
    )


def main() -> None:
    doc = check_rule.__doc__ or ""
    checks = "\n".join(
        line.strip() for line in doc.splitlines() if line.strip().startswith("|")
    )
    text = README.read_text()
    text = _replace(text, "catalogue", _cli.catalogue_markdown())
    text = _replace(text, "checks", checks)
    text = _replace(text, "rule-example", example_rule())
    figures = json.loads(QAT_FIGURES.read_text())
    text = _replace(text, "qat-table", qat_table(figures))
    text = "\n".join(
        qat_example_row(figures) if line.startswith(_QAT_ROW) else line
        for line in text.split("\n")
    )
    README.write_text(text)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import update_stubs

    update_stubs.STUB.write_text(update_stubs.stub())


if __name__ == "__main__":
    if "--figures" in sys.argv:
        record_qat_figures()
    main()
