"""`tests/mutation.py` works: its table matches the sources, and a planted defect is
caught."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent


def _mutation_module():
    spec = importlib.util.spec_from_file_location("mutation", HERE / "mutation.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_mutation_applies_to_the_current_sources():
    """Each edit's target text is in its file exactly once (a stale table would
    report errors, not catches); appended patches name a class of that file; every
    required kind is planted."""
    mutation = _mutation_module()
    for m in mutation.MUTATIONS:
        text = (ROOT / m.path).read_text()
        if m.old:
            assert text.count(m.old) == 1, m.name
        else:
            cls = m.new.split("original = ")[1].split(".")[0]
            assert f"\nclass {cls}(" in text, m.name
    kinds = {m.kind for m in mutation.MUTATIONS}
    assert {
        "boundary",
        "parameter tangent",
        "scale",
        "dtype",
        "grid",
        "select",
        "step derivative",
    } <= kinds


@pytest.mark.slow
def test_mutation_script_catches_a_planted_boundary_flip():
    """With its control run: the unmutated copy passes every stage (a stage that
    selects no test, pytest's exit 5, would make it an error, as the tier split once
    did unnoticed), then the mutant fails one."""
    proc = subprocess.run(
        [
            sys.executable,
            str(HERE / "mutation.py"),
            "--only",
            "boundary-dorefa-one",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["control"]["status"] == "survived", report["control"]
    assert report["caught"] == report["planted"] == 1
    result = report["mutations"]["boundary-dorefa-one"]
    assert result["status"] == "caught" and "dorefa_quantize" in result["detail"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lsq-step-sign-upper-clip", "lsq-missing-grad-scale"])
def test_mutation_script_catches_a_planted_step_derivative_defect(name):
    """A learned step's derivative is checked through the checker's parameter path:
    a wrong sign at the upper clip, or a forgotten gradient scale, fails it."""
    proc = subprocess.run(
        [sys.executable, str(HERE / "mutation.py"), "--only", name, "--no-control"]
        + ["--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["caught"] == report["planted"] == 1
    assert report["mutations"][name]["status"] == "caught"
