"""The README's generated tables cannot drift from the code, nor its and the
benchmark report's figures from the runs that measured them."""

import copy
import dataclasses
import importlib.util
import inspect
import json
import math
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

import eqxrules
from eqxrules import _cli
from eqxrules.testing import check_rule

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _script(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(f"readme_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _between(name: str) -> str:
    match = re.search(f"<!-- {name}:begin -->\n(.*?)<!-- {name}:end -->", README, re.S)
    assert match, f"README has no {name} markers"
    return match.group(1).strip()


def test_catalogue_table_matches_catalogue():
    """Regenerate with `python -m eqxrules list --markdown`."""
    assert _between("catalogue") == _cli.catalogue_markdown()


def test_example_rule_is_the_catalogue_rule():
    """The "Declaring a rule" example is `QuadraticSign`'s source, whole: at most
    40 lines. Regenerate with `python scripts/update_readme.py`."""
    source = inspect.getsource(eqxrules.QuadraticSign)
    assert _between("rule-example") == f"```python\n{source}```"
    assert len(source.splitlines()) <= 40


def test_checks_table_matches_check_rule_docstring():
    doc = check_rule.__doc__ or ""
    rows = [line.strip() for line in doc.splitlines() if line.strip().startswith("|")]
    assert rows
    assert _between("checks") == "\n".join(rows)


def test_quick_start_has_exactly_two_commands():
    quick = README.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```")[0]
    commands = [line for line in quick.splitlines() if line.strip()]
    assert len(commands) == 2
    assert "python -m eqxrules" in commands[0]
    assert "pytest" in commands[1] and "[test,examples]" in commands[1]


def test_thirty_second_example_runs():
    code = README.split("## In 30 seconds", 1)[1].split("```python", 1)[1]
    namespace: dict = {}
    exec(code.split("```", 1)[0], namespace)
    assert namespace["report"].passed


# `examples/qat_digits.py`'s figures: both README tables come from one recorded run.


def _qat_figures() -> dict:
    return json.loads((ROOT / "examples" / "qat_digits.json").read_text())


def test_qat_table_is_the_recorded_run():
    """Regenerate with `python scripts/update_readme.py [--figures]`."""
    update = _script(ROOT / "scripts" / "update_readme.py")
    assert _between("qat-table") == update.qat_table(_qat_figures())


def test_examples_row_of_qat_digits_is_the_recorded_run():
    update = _script(ROOT / "scripts" / "update_readme.py")
    rows = [ln for ln in README.splitlines() if ln.startswith("| `qat_digits.py` |")]
    assert rows == [update.qat_example_row(_qat_figures())]


@pytest.mark.slow
def test_the_recorded_run_is_a_full_run_of_every_row(load_example):
    # A row added to the example, or a quick run recorded, makes the figures stale.
    update = _script(ROOT / "scripts" / "update_readme.py")
    example = load_example("qat_digits")
    figures = _qat_figures()
    assert [r["name"] for r in figures["rows"]] == [row.name for row in example.ROWS]
    for r, row in zip(figures["rows"], example.ROWS):
        assert len(r["trained"]) == 3, row.name
        assert (r["post_training"] is not None) == row.ptq, row.name
        assert row.name in update.QAT_LABELS


def test_the_two_readme_tables_agree():
    update = _script(ROOT / "scripts" / "update_readme.py")
    assert update.qat_disagreements(README) == []


def test_disagreement_check_catches_the_0_2_0_readme():
    # Planted defect: 0.2.0's README, whose QAT table said 97.3% for 4-bit LSQ and
    # whose examples row said 97.1%.
    update = _script(ROOT / "scripts" / "update_readme.py")
    table = README.split("<!-- qat-table:begin -->\n", 1)[1].split("\n<!--", 1)[0]
    lsq4 = next(ln for ln in table.splitlines() if ln.startswith("| LSQ, 4-bit"))
    old = README.replace(
        lsq4,
        "| LSQ, 4-bit weights (per channel) and inputs | — | 97.3% (96.9%, 97.8%) |",
    )
    row = next(ln for ln in old.splitlines() if ln.startswith("| `qat_digits.py` |"))
    old = old.replace(row, re.sub(r"LSQ W4A4 [\d.]+%", "LSQ W4A4 97.1%", row))
    (problem,) = update.qat_disagreements(old)
    assert "LSQ W4A4 97.1%" in problem and "LSQ W4A4 97.3%" in problem


# `examples/lowp_training.py`'s figures: its table and its examples row come from
# one recorded run.


def _lowp_figures() -> dict:
    return json.loads((ROOT / "examples" / "lowp_training.json").read_text())


def test_lowp_table_is_the_recorded_run():
    """Regenerate with `python scripts/update_readme.py [--figures=lowp]`."""
    update = _script(ROOT / "scripts" / "update_readme.py")
    assert _between("lowp-table") == update.lowp_table(_lowp_figures())


def test_examples_row_of_lowp_training_is_the_recorded_run():
    update = _script(ROOT / "scripts" / "update_readme.py")
    rows = [ln for ln in README.splitlines() if ln.startswith("| `lowp_training.py` |")]
    assert rows == [update.lowp_example_row(_lowp_figures())]


def full_run_problems(figures: dict, example, values: str) -> list[str]:
    """Where a recorded run of an example with `ROWS` and `FULL` settings is not a
    full run of today's example: other rows or settings, or a row with another
    number of seeds' figures (`values`, the per-seed figures of each row)."""
    problems = []
    if [r["name"] for r in figures["rows"]] != [row.name for row in example.ROWS]:
        problems.append("rows: not the example's `ROWS`")
    full = json.loads(json.dumps(dataclasses.asdict(example.FULL)))
    if figures["settings"] != full:
        problems.append(f"settings: {figures['settings']}, not `FULL`'s {full}")
    for r, row in zip(figures["rows"], example.ROWS):
        if len(r[values]) != len(example.FULL.seeds):
            problems.append(f"{row.name}: {len(r[values])} seeds")
    return problems


def lowp_record_problems(figures: dict, example) -> list[str]:
    """Where the recorded run is not a full run of today's example: other rows,
    recipes, targets or settings, another number of seeds, a row the README has
    no words for, or a summary that does not follow from the seeds' losses."""
    update = _script(ROOT / "scripts" / "update_readme.py")
    problems = full_run_problems(figures, example, "validation")
    reference = figures["rows"][0]["validation"]
    reference_mean = sum(reference) / len(reference)
    for r, row in zip(figures["rows"], example.ROWS):
        v = r["validation"]
        mean = sum(v) / len(v)
        gap = 100 * (mean / reference_mean - 1)
        if r["recipe"] != (None if row.recipe is None else repr(row.recipe)):
            problems.append(f"{row.name}: recipe {r['recipe']}")
        if r.get("attention") != (
            None if row.attention is None else repr(row.attention)
        ):
            problems.append(f"{row.name}: attention {r.get('attention')}")
        if r["target_percent"] != row.target:
            problems.append(f"{row.name}: target {r['target_percent']}")
        if not (
            math.isclose(r["mean"], mean, rel_tol=1e-12)
            and (r["min"], r["max"]) == (min(v), max(v))
            and math.isclose(r["gap_percent"], gap, rel_tol=1e-9, abs_tol=1e-12)
        ):
            problems.append(f"{row.name}: mean, min, max or gap not of {v}")
        if row.name not in update.LOWP_LABELS:
            problems.append(f"{row.name}: no label in scripts/update_readme.py")
    return problems


def test_the_lowp_record_is_a_full_run_of_every_row(load_example):
    # A row or a setting changed in the example, or a quick run recorded, makes
    # the figures stale.
    example = load_example("lowp_training")
    assert lowp_record_problems(_lowp_figures(), example) == []


def test_lowp_record_check_catches_a_quick_run_and_an_edited_mean(load_example):
    # Planted defects: a quick run's record (one seed, the quick settings), and a
    # mean edited by hand.
    example = load_example("lowp_training")
    quick = copy.deepcopy(_lowp_figures())
    quick["settings"] = json.loads(json.dumps(dataclasses.asdict(example.QUICK)))
    for r in quick["rows"]:
        r["validation"] = r["validation"][:1]
    problems = lowp_record_problems(quick, example)
    assert any(p.startswith("settings:") for p in problems), problems
    assert any(p == "fp8: 1 seeds" for p in problems), problems
    edited = copy.deepcopy(_lowp_figures())
    edited["rows"][2]["mean"] -= 0.01
    (problem,) = lowp_record_problems(edited, example)
    assert problem.startswith("mxfp8: mean, min, max or gap not of")


# `examples/lowp_cnn_digits.py`'s figures: its examples row comes from its
# recorded run.


def _cnn_figures() -> dict:
    return json.loads((ROOT / "examples" / "lowp_cnn_digits.json").read_text())


def test_examples_row_of_lowp_cnn_digits_is_the_recorded_run():
    """Regenerate with `python scripts/update_readme.py [--figures=cnn]`."""
    update = _script(ROOT / "scripts" / "update_readme.py")
    rows = [
        ln for ln in README.splitlines() if ln.startswith("| `lowp_cnn_digits.py` |")
    ]
    assert rows == [update.cnn_example_row(_cnn_figures())]


def accuracy_summary_problems(r: dict) -> list[str]:
    """Where a recorded row's mean, lowest and highest test accuracy do not follow
    from its seeds' accuracies."""
    a = r["accuracies"]
    mean = math.isclose(r["mean"], sum(a) / len(a), rel_tol=1e-12)
    if mean and (r["min"], r["max"]) == (min(a), max(a)):
        return []
    return [f"{r['name']}: mean, min or max not of {a}"]


def cnn_record_problems(figures: dict, example) -> list[str]:
    """Where the recorded run is not a full run of today's CNN example: other rows,
    settings or layer recipes, another number of seeds, or a summary that does not
    follow from the seeds' accuracies."""
    problems = full_run_problems(figures, example, "accuracies")
    for r, row in zip(figures["rows"], example.ROWS):
        named = {p: example.recipe_name(row.recipe(p)) for p in example.LAYERS}
        if r["recipes"] != named:
            problems.append(f"{row.name}: recipes {r['recipes']}, not {named}")
        problems += accuracy_summary_problems(r)
    return problems


def test_the_cnn_record_is_a_full_run_of_every_row(load_example):
    # A row, a layer's recipe or a setting changed in the example, or a quick run
    # recorded, makes the figures stale.
    example = load_example("lowp_cnn_digits")
    assert cnn_record_problems(_cnn_figures(), example) == []


def test_cnn_record_check_catches_a_quick_run_a_recipe_and_an_edited_mean(
    load_example,
):
    # Planted defects: a quick run's record (one seed, the quick settings), a
    # layer recorded with another recipe than the example gives it, and a mean
    # edited by hand.
    example = load_example("lowp_cnn_digits")
    quick = copy.deepcopy(_cnn_figures())
    quick["settings"] = json.loads(json.dumps(dataclasses.asdict(example.QUICK)))
    for r in quick["rows"]:
        r["accuracies"] = r["accuracies"][:1]
        r["mean"] = r["min"] = r["max"] = r["accuracies"][0]
    problems = cnn_record_problems(quick, example)
    assert any(p.startswith("settings:") for p in problems), problems
    assert [p for p in problems if p.endswith(" seeds")] == [
        f"{row.name}: 1 seeds" for row in example.ROWS
    ]
    edited = copy.deepcopy(_cnn_figures())
    edited["rows"][3]["recipes"]["conv2"] = "nvfp4"
    edited["rows"][2]["mean"] += 0.001
    problems = cnn_record_problems(edited, example)
    assert len(problems) == 2, problems
    assert problems[0].startswith("mxfp8: mean, min or max not of")
    assert problems[1].startswith("nvfp4: recipes {")


# `examples/lowp_moe_digits.py`'s figures: its examples row comes from its
# recorded run.


def _moe_figures() -> dict:
    return json.loads((ROOT / "examples" / "lowp_moe_digits.json").read_text())


def test_examples_row_of_lowp_moe_digits_is_the_recorded_run():
    """Regenerate with `python scripts/update_readme.py [--figures=moe]`."""
    update = _script(ROOT / "scripts" / "update_readme.py")
    rows = [
        ln for ln in README.splitlines() if ln.startswith("| `lowp_moe_digits.py` |")
    ]
    assert rows == [update.moe_example_row(_moe_figures())]


def moe_record_problems(figures: dict, example) -> list[str]:
    """Where the recorded run is not a full run of today's MoE example: other rows,
    settings, recipes, experts, top-k or balance weight, another number of seeds,
    a summary that does not follow from the seeds' accuracies, or a seed's expert
    loads that are not one share per expert summing to 1."""
    problems = full_run_problems(figures, example, "accuracies")
    layer = (figures["experts"], figures["top_k"], figures["balance"])
    if layer != (example.EXPERTS, example.TOP_K, example.BALANCE):
        problems.append(f"experts, top_k, balance: {layer}")
    for r, row in zip(figures["rows"], example.ROWS):
        if r["recipe"] != example.recipe_name(row.recipe):
            problems.append(f"{row.name}: recipe {r['recipe']}")
        problems += accuracy_summary_problems(r)
        for loads in r["loads"]:
            if len(loads) != example.EXPERTS or not math.isclose(sum(loads), 1):
                problems.append(f"{row.name}: loads {loads}")
        if len(r["loads"]) != len(r["accuracies"]):
            problems.append(f"{row.name}: {len(r['loads'])} seeds' loads")
    return problems


def test_the_moe_record_is_a_full_run_of_every_row(load_example):
    # A row, a recipe, the layer or a setting changed in the example, or a quick
    # run recorded, makes the figures stale.
    example = load_example("lowp_moe_digits")
    assert moe_record_problems(_moe_figures(), example) == []


def test_moe_record_check_catches_a_quick_run_a_recipe_a_mean_and_the_layer(
    load_example,
):
    # Planted defects: a quick run's record (one seed, the quick settings), a row
    # recorded with another recipe than the example gives it, a mean edited by
    # hand, another balance weight, and a seed's loads missing an expert.
    example = load_example("lowp_moe_digits")
    quick = copy.deepcopy(_moe_figures())
    quick["settings"] = json.loads(json.dumps(dataclasses.asdict(example.QUICK)))
    for r in quick["rows"]:
        r["accuracies"], r["loads"] = r["accuracies"][:1], r["loads"][:1]
        r["mean"] = r["min"] = r["max"] = r["accuracies"][0]
    problems = moe_record_problems(quick, example)
    assert any(p.startswith("settings:") for p in problems), problems
    assert [p for p in problems if p.endswith(" seeds")] == [
        f"{row.name}: 1 seeds" for row in example.ROWS
    ]
    edited = copy.deepcopy(_moe_figures())
    edited["rows"][1]["recipe"] = "mxfp8()"
    edited["rows"][2]["mean"] += 0.001
    edited["balance"] = 0.1
    edited["rows"][0]["loads"][2] = edited["rows"][0]["loads"][2][:3]
    problems = moe_record_problems(edited, example)
    assert len(problems) == 4, problems
    assert problems[0] == "experts, top_k, balance: (4, 2, 0.1)"
    assert problems[1].startswith("float32: loads [")
    assert problems[2] == "fp8: recipe mxfp8()"
    assert problems[3].startswith("mxfp8: mean, min or max not of")


# `benchmarks/RESULTS.md`: rendered from RESULTS.json, which measured this catalogue.


def _results() -> dict:
    return json.loads((ROOT / "benchmarks" / "RESULTS.json").read_text())


def test_benchmark_report_is_its_json_rendered():
    """Re-render with `python -m benchmarks --render`."""
    from benchmarks.cli import render

    assert (ROOT / "benchmarks" / "RESULTS.md").read_text() == render(_results())


def catalogue_disagreements(results: dict) -> list[str]:
    """Where the benchmark figures were measured on another catalogue than today's."""
    names = [e.name for e in eqxrules.catalogue()]
    problems = []
    for section, figures in results.items():
        rows = figures.get("rows") if isinstance(figures, dict) else None
        if isinstance(rows, list) and rows and "entry" in rows[0]:
            measured = {row["entry"] for row in rows}
            if measured != set(names):
                problems.append(
                    f"{section}: measured {len(measured)} rules, not the catalogue's "
                    f"{len(names)} (differ: {sorted(measured ^ set(names))}; run "
                    f"`python -m benchmarks --only {section} --merge --all-examples "
                    f"--rules {','.join(sorted(set(names) - measured)) or '...'}` for "
                    "the rules it lacks, or without `--rules` for all)"
                )
    cli = results["suite"]["cli"]["last_line"]
    m = re.match(r"(\d+)/(\d+) rules passed", cli)
    if m is None or int(m.group(2)) != len(names):
        problems.append(
            f"suite: `python -m eqxrules` said {cli!r}; the catalogue has "
            f"{len(names)} rules (run `python -m benchmarks --suite --only suite "
            "--merge` again)"
        )
    return problems


def test_benchmark_figures_are_of_this_catalogue():
    assert catalogue_disagreements(_results()) == []


def test_catalogue_check_catches_a_report_of_another_catalogue():
    # Planted defect: 0.2.0's suite section ("23/23 rules passed") and an overhead
    # section missing a rule.
    results = _results()
    results["suite"]["cli"]["last_line"] = (
        "23/23 rules passed (43 checked examples, 29.3s): passed"
    )
    results["overhead"]["rows"] = [
        row for row in results["overhead"]["rows"] if row["entry"] != "ste_sign"
    ]
    problems = catalogue_disagreements(results)
    assert any(p.startswith("overhead:") and "ste_sign" in p for p in problems)
    assert any(p.startswith("suite:") and "'23/23 rules passed" in p for p in problems)


def test_a_rule_added_is_measured_without_re_measuring_the_others():
    """`python -m benchmarks --merge --only overhead --rules NAME`: the saved rows
    of the other rules are kept, the named rule's replaced, in catalogue order; the
    section keeps its stamp and the report names the rows measured again. Planted
    defects: a section that is not one row per rule is refused, and a section
    missing a rule still fails the catalogue check."""
    from benchmarks.cli import merge_rows, render

    results = _results()
    saved = copy.deepcopy(results["overhead"])
    first = next(e for e in eqxrules.catalogue() if e.name == saved["rows"][0]["entry"])
    new_rows = [
        dict(r, notes="again") for r in saved["rows"] if r["entry"] == first.name
    ]
    stamp = dict(saved["measured"], date="2026-11-27 04:00 UTC", code="abc1234")
    merged = merge_rows("overhead", saved, {"rows": new_rows}, stamp, [first])
    assert merged["measured"] == saved["measured"]
    assert [r["entry"] for r in merged["rows"]] == [r["entry"] for r in saved["rows"]]
    assert [r for r in merged["rows"] if r.get("notes") == "again"] == new_rows
    assert merged["remeasured"][-1]["rules"] == [first.name]
    assert merged["remeasured"][-1]["cores"] == os.cpu_count()
    results["overhead"] = merged
    assert f"The rows of `{first.name}` were measured again 2026-11-27" in render(
        results
    )
    # A rule missing from the saved rows (a new rule) is added in catalogue order.
    missing = dict(saved, rows=[r for r in saved["rows"] if r["entry"] != first.name])
    assert catalogue_disagreements({**results, "overhead": missing})
    merged = merge_rows("overhead", missing, {"rows": new_rows}, stamp, [first])
    assert merged["rows"][: len(new_rows)] == new_rows
    assert catalogue_disagreements({**results, "overhead": merged}) == []
    with pytest.raises(SystemExit, match="not one row per rule"):
        merge_rows("unbiased", results["unbiased"], results["unbiased"], stamp, [first])


def test_check_unbiased_example_runs_and_catches_a_10pc_bias():
    """The "Stochastic rounding" example: a correct E2M1 rounding passes (false-fail
    rate 1e-6) and one rounding up 10% of the gap too often fails (it is more than
    8 times the detectable bias at each of 62 elements, each catching it with
    probability at least 1/2)."""
    block = README.split("eqxrules.testing.check_unbiased` tests it", 1)[1]
    code = block.split("```python", 1)[1].split("```", 1)[0]
    namespace: dict = dict(eqxrules=eqxrules, jax=jax, jnp=jnp)
    exec(code, namespace)
    report, caught = namespace["report"], namespace["caught"]
    assert report.passed and report.detectable < 0.1 / 8
    assert not caught.passed and "an unbiased rounding keeps" in caught.detail
