"""`benchmarks/gpu.py`, the one command a lent GPU runs (issue 41 §4): run here on
the CPU in quick mode (slow tier), so that it cannot rot before a GPU runs it, and
its report checked section by section; beside it, planted defects: a section that
raises, or one that finds a failure, is reported as such, never dropped."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import gpu

SECTIONS = [
    "environment",
    "arithmetic",
    "catalogue",
    "tests",
    "scaled_dot_general",
    "training",
]


def test_the_script_has_the_issues_sections():
    assert list(gpu.SECTIONS) == SECTIONS


@pytest.mark.slow
def test_quick_mode_runs_every_section_on_the_cpu(tmp_path):
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", "--quick", "--out", str(tmp_path)],
        cwd=gpu.ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads((tmp_path / "gpu.json").read_text())
    text = (tmp_path / "gpu.md").read_text()
    assert list(found) == SECTIONS
    for name, section in found.items():
        assert f"## {name}: {section['status']}" in text
        assert section["status"] in ("passed", "unavailable"), (name, section)
    env = found["environment"]
    assert env["backend"] == "cpu" and env["jax"]
    arithmetic = found["arithmetic"]
    assert set(arithmetic["functions"]) >= {"exp", "tanh", "log1p", "cosh"}
    assert {"flushes_inputs", "flushes_results"} <= set(arithmetic["subnormals"])
    point = arithmetic["swish_sign_at_the_h100_failure"]
    assert point["rule_cpu"] == pytest.approx(point["truth"], rel=1e-5)
    catalogue = found["catalogue"]
    assert catalogue["rules"] == catalogue["passed"] == len(gpu.QUICK_RULES)
    assert list(found["tests"]["files"]) == gpu.QUICK_TEST_FILES
    assert "passed" in found["tests"]["files"][gpu.QUICK_TEST_FILES[0]]["summary"]
    sdg = found["scaled_dot_general"]
    if sdg["status"] == "unavailable":  # JAX before 0.11 on the CPU
        import jax

        assert jax.__version__.startswith("0.10") and "scaled" in sdg["reason"]
    else:
        assert all(r["ceil_within_bound_of_theirs"] for r in sdg["products"])
        assert not any(r["floor_within_bound_of_theirs"] for r in sdg["products"])
    steps = found["training"]["steps"]
    assert set(steps) == {"bfloat16", "fp8", "mxfp8", "float32"}
    for row in steps.values():
        assert row["ms"] > 0 and row["flops"] > 0 and row["temp"] >= 0
        assert row["loss"] == pytest.approx(steps["float32"]["loss"], rel=0.05)


def _ok(args):
    return {"status": "passed", "value": 1.5}


def _raises(args):
    raise RuntimeError("planted: this section raises")


def _fails(args):
    return {"status": "failed", "rows": [{"case": "a", "off": 0.25}]}


@pytest.mark.parametrize(
    "planted, status, said",
    [(_raises, "error", "planted: this section raises"), (_fails, "failed", "0.25")],
    ids=["raises", "finds-a-failure"],
)
def test_planted_section_is_reported_not_dropped(
    tmp_path, capsys, planted, status, said
):
    """A section that raises is recorded as `error` with its traceback, one that
    finds a failure as `failed`; the sections after it still run, the report
    names it, and the exit status is 1."""
    sections = {"first": _ok, "planted": planted, "after": _ok}
    code = gpu.main(["--out", str(tmp_path)], sections=sections)
    assert code == 1
    found = json.loads((tmp_path / "gpu.json").read_text())
    assert list(found) == ["first", "planted", "after"]
    assert found["planted"]["status"] == status
    assert found["after"]["status"] == "passed"
    text = (tmp_path / "gpu.md").read_text()
    assert f"## planted: {status}" in text and said in text
    if status == "error":
        assert "RuntimeError" in found["planted"]["traceback"]
    out = capsys.readouterr().out
    assert f"planted: {status}" in out
    assert "2 of 3 sections passed" in out


def test_every_section_passing_exits_0(tmp_path):
    code = gpu.main(["--out", str(tmp_path)], sections={"a": _ok, "b": _ok})
    assert code == 0
    assert "- a: passed" in (tmp_path / "gpu.md").read_text()
