"""Regenerate what is derived from the catalogue and committed: the README's
catalogue table, its checks (from `check_rule`'s docstring) and its example rule
(the source of `QuadraticSign`), and the rules' type stub
(`scripts/update_stubs.py`). `tests/test_readme.py` and `tests/test_package.py`
fail until this has been run after a rule or a check changes:
`python scripts/update_readme.py`.

The README's figures of `examples/qat_digits.py`, its QAT table and its row of the
examples table, are generated from one recorded run, `examples/qat_digits.json`;
so are those of `examples/lowp_training.py`, its low-precision training table and
its row, from `examples/lowp_training.json`; and the rows of
`examples/lowp_cnn_digits.py` and `examples/lowp_moe_digits.py`, from their
JSON beside them. `python scripts/update_readme.py --figures` runs the four
examples in full mode (about four, 45, two and two minutes: run them on a quiet
machine) to record them again first; `--figures=NAME` runs one (`EXAMPLES`
names them: `qat`, `lowp`, `cnn`, `moe`)."""

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

LOWP_EXAMPLE = ROOT / "examples" / "lowp_training.py"

# The README's words for each row of the low-precision example's `ROWS` (a new row
# needs one: tests/test_readme.py checks).
LOWP_LABELS = {
    "float32": "float32 (nothing quantised)",
    "fp8": "`fp8()`: E4M3 `x` and `w`, E5M2 gradients, a float32 scale per tensor",
    "mxfp8": "`mxfp8()`: E4M3 in blocks of 32 with E8M0 scales",
    "nvfp4": "`nvfp4()`: FP4 in blocks of 16 (weights 16×16), SR on gradients, "
    "RHT on the weight-gradient product",
    "nvfp4 without SR and RHT": "`nvfp4()` without SR and RHT "
    '(`gradient_rounding="nearest", hadamard=None`)',
    "nvfp4 forward only": "`nvfp4()`'s forward product alone, its gradient products "
    "in float32 (`Custom(fwd=...)`)",
    "nvfp4 gradients only": "`nvfp4()`'s two gradient products alone (SR and RHT "
    "included), its forward product in float32 (`Custom(dx=..., dw=...)`)",
    "nvfp4, 1x16 weight blocks": "`nvfp4()` with 1×16 weight blocks along each "
    "product's reduced dimension (`NVFP4(square_weight_blocks=False)`)",
    "nvfp4, last block in mxfp8": "`nvfp4()`, the last block's four linear layers "
    "in `mxfp8()` (a recipe per layer, by its path)",
    "mxfp8, attention products too": "`mxfp8()`, and the attention's `q·kᵀ` and "
    "`p·v` in `mxfp8()` too (`quantized_einsum`)",
    "mxfp8, OCP floor scales": "`mxfp8()` with the OCP rule's scales, "
    '2^(floor(log2 amax) − 8), which saturate (`MXFP8(scale_rounding="floor")`)',
    "fp8_blockwise, blocks of 32": "DeepSeek-V3's fine-grained FP8: E4M3, float32 "
    "scales per 1×32 tile and 32×32 weight block (`FP8Blockwise(block_size=32)`: "
    "its 128 is wider than this model)",
    "fp8_rowwise": "`fp8_rowwise()`: E4M3, a power-of-two scale per row of what "
    "each product contracts",
    "mxfp4": "`mxfp4()`: E2M1 in blocks of 32 with E8M0 scales rounded up, SR on "
    "gradients, RHT on the weight-gradient product",
    "nvfp4 with 4/6": "`nvfp4()` with Four Over Six, each block scaled to 4 or 6 "
    "(`NVFP4(four_over_six=True)`)",
}
_LOWP_HEADER = (
    "| recipe (`ROWS` in the example) | validation loss, nats per character | "
    "vs float32 | target (issues 19, 26) |\n|---|---|---|---|"
)
_LOWP_ROW = "| `lowp_training.py` |"

CNN_EXAMPLE = ROOT / "examples" / "lowp_cnn_digits.py"
_CNN_ROW = "| `lowp_cnn_digits.py` |"

MOE_EXAMPLE = ROOT / "examples" / "lowp_moe_digits.py"
_MOE_ROW = "| `lowp_moe_digits.py` |"


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


def _loss_cell(losses: list[float]) -> str:
    """Mean of the seeds (lowest, highest), as the example prints it."""
    mean = f"{sum(losses) / len(losses):.4f}"
    if len(losses) == 1:
        return mean
    return f"{mean} ({min(losses):.4f}, {max(losses):.4f})"


def _gap(row: dict) -> str:
    return "—" if row["name"] == "float32" else f"{row['gap_percent']:+.2f}%"


def _target(row: dict) -> str:
    target = row["target_percent"]
    if target is None:
        return "— (as measured)" if row["name"] != "float32" else "—"
    verdict = "met" if row["gap_percent"] <= target else "**missed**"
    return f"within {target:g}%: {verdict}"


def _missed(row: dict) -> str:
    """A note after a row's gap where it misses its target: a gap rounded to one
    decimal could hide a miss (+0.53% against 0.5%)."""
    target = row["target_percent"]
    if target is None or row["gap_percent"] <= target:
        return ""
    return f" (**missed** its {target:g}% target)"


def lowp_table(figures: dict) -> str:
    """The README's low-precision training table, with the run it comes from, from
    a recorded run of `examples/lowp_training.py`."""
    rows = [
        f"| {LOWP_LABELS[r['name']]} | {_loss_cell(r['validation'])} | {_gap(r)} | "
        f"{_target(r)} |"
        for r in figures["rows"]
    ]
    s, c = figures["settings"], figures["corpus"]
    load = figures["load_average"]
    run = (
        f"Mean of {len(s['seeds'])} seeds (lowest, highest); the gap is that of the "
        f"means. {s['steps']} steps of {s['batch']} windows of {s['context']} bytes "
        f"each; width {s['width']}, {s['depth']} blocks, {s['heads']} heads, MLP "
        f"{s['hidden']}. Data: the {len(c['files'])} files of Python "
        f"{c['python']}'s standard library, {c['bytes']:,} bytes "
        f"({c['validation_bytes']:,} for validation). Recorded by "
        f"`{figures['command']}` on {figures['date']}: {figures['seconds']:.0f} s "
        f"on {figures['cpus']} CPU cores (load average {load[0]:g} before, "
        f"{load[1]:g} after), jax {figures['versions']['jax']}."
    )
    return "\n".join([_LOWP_HEADER, *rows, "", run])


def lowp_example_row(figures: dict) -> str:
    """The examples table's row for `lowp_training.py`, from a recorded run."""
    rows = {r["name"]: r for r in figures["rows"]}
    gaps = ", ".join(
        f"{name} {_gap(rows[name])}{_missed(rows[name])}" for name in list(rows)[1:]
    )
    return (
        f"{_LOWP_ROW} a transformer language model trained with FP8, MXFP8, NVFP4 "
        "and the field's recipes (blockwise and row-wise FP8, MXFP4, NVFP4 with "
        "4/6; `quantize(model, recipe=...)`, `Keyed`) against float32 | "
        f"{figures['seconds']:.0f} s | float32 {rows['float32']['mean']:.3f} nats "
        f"per character; {gaps} ({len(figures['settings']['seeds'])} seeds) |"
    )


def _accuracies(figures: dict) -> str:
    """Each row's mean test accuracy and the number of seeds, from a recorded run
    of an example whose rows keep their `mean` (`lowp_cnn_digits.py`,
    `lowp_moe_digits.py`)."""
    means = ", ".join(f"{r['name']} {r['mean']:.1%}" for r in figures["rows"])
    return f"test accuracy {means} ({len(figures['settings']['seeds'])} seeds"


def cnn_example_row(figures: dict) -> str:
    """The examples table's row for `lowp_cnn_digits.py`, from a recorded run: each
    row's mean test accuracy, and the recipe of the layers no block divides."""
    rows = figures["rows"]
    edges = {r["recipes"][p] for r in rows[1:] for p in ("conv1", "classifier")}
    return (
        f"{_CNN_ROW} a small CNN trained with FP8, MXFP8 and NVFP4 recipes, one per "
        "layer by its path (`quantize(cnn, recipe=lambda path: ...)`, "
        f"`QuantizedConv`, `Keyed`) against float32 | {figures['seconds']:.0f} s | "
        f"{_accuracies(figures)}; first conv and classifier "
        f"{' or '.join(sorted(edges))}) |"
    )


def moe_example_row(figures: dict) -> str:
    """The examples table's row for `lowp_moe_digits.py`, from a recorded run: each
    row's mean test accuracy, and the range of the experts' shares of the test
    set's routing slots over every row, seed and expert."""
    shares = [v for r in figures["rows"] for seed in r["loads"] for v in seed]
    return (
        f"{_MOE_ROW} a mixture-of-experts layer (top-{figures['top_k']} routing over "
        f"{figures['experts']} experts, a load-balancing loss) whose experts' "
        "products take FP8 and MXFP8 recipes (`quantized_ragged_dot`, group sizes "
        f"traced) against float32 | {figures['seconds']:.0f} s | "
        f"{_accuracies(figures)}; {figures['test_images']} test images, each "
        f"expert {min(shares):.0%} to {max(shares):.0%} of their routing slots) |"
    )


def _record(example: pathlib.Path) -> None:
    """Run `example` in full mode with `--record`, writing its JSON beside it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run(
        [sys.executable, str(example), "--record"], check=True, env=env, cwd=ROOT
    )


# Each example whose README row is generated: its `--figures=NAME`, its script
# (its record is the JSON beside it), its row's first cell, and the row from the
# record.
EXAMPLES = {
    "qat": (QAT_EXAMPLE, _QAT_ROW, qat_example_row),
    "lowp": (LOWP_EXAMPLE, _LOWP_ROW, lowp_example_row),
    "cnn": (CNN_EXAMPLE, _CNN_ROW, cnn_example_row),
    "moe": (MOE_EXAMPLE, _MOE_ROW, moe_example_row),
}


def main() -> None:
    doc = check_rule.__doc__ or ""
    checks = "\n".join(
        line.strip() for line in doc.splitlines() if line.strip().startswith("|")
    )
    text = README.read_text()
    text = _replace(text, "catalogue", _cli.catalogue_markdown())
    text = _replace(text, "checks", checks)
    text = _replace(text, "rule-example", example_rule())
    records = {
        name: json.loads(script.with_suffix(".json").read_text())
        for name, (script, _, _) in EXAMPLES.items()
    }
    text = _replace(text, "qat-table", qat_table(records["qat"]))
    text = _replace(text, "lowp-table", lowp_table(records["lowp"]))
    rows = {start: row(records[name]) for name, (_, start, row) in EXAMPLES.items()}
    text = "\n".join(
        next((row for start, row in rows.items() if line.startswith(start)), line)
        for line in text.split("\n")
    )
    README.write_text(text)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import update_stubs

    update_stubs.STUB.write_text(update_stubs.stub())


if __name__ == "__main__":
    for name, (example, _, _) in EXAMPLES.items():
        if "--figures" in sys.argv or f"--figures={name}" in sys.argv:
            _record(example)
    main()
