"""`python -m eqxrules`: verify, list, the flags and exit codes (`check`:
`test_cli_check.py`; `plot`: `test_cli_plot.py`)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from typing import ClassVar

import jax
import jax.numpy as jnp
import pytest

import eqxrules
from eqxrules import _cli
from eqxrules._catalogue import Domain, Entry, JVPRule
from eqxrules._verify import EntryResult


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = _cli.main(list(argv))
    return code, capsys.readouterr().out


def test_verify_prints_backend_table_and_passes(capsys):
    code, out = _run(capsys, "verify", "ste_round", "gradient_reversal")
    assert code == 0
    # Whatever backend JAX found: the suite runs on a GPU too (benchmarks/gpu.py).
    assert f"on backend {jax.default_backend()!r}: " in out
    assert "ste_round" in out and "gradient_reversal" in out
    header = next(line for line in out.splitlines() if line.startswith("rule"))
    for column in ("primal", "jvp", "vjp", "transp", "fd", "vmap", "jit", "dtype"):
        assert column in header
    assert "2/2 rules passed" in out


def test_verify_json(capsys):
    code, out = _run(capsys, "verify", "clip_gradient", "--json")
    assert code == 0
    (obj,) = json.loads(out)
    assert obj["name"] == "clip_gradient" and obj["passed"] is True
    assert obj["checks"]["jvp"] == "unsupported"  # reverse-only, declared so


class _Broken(JVPRule):
    """A rule whose derivative is twice its reference's."""

    summary: ClassVar[str] = "broken on purpose"
    domain: ClassVar[Domain] = Domain(shape=(3,))

    def primal(self, x):
        return x

    def tangent(self, args, t_args, t_self, out):
        return None if t_args[0] is None else 2 * t_args[0]

    def reference_forward(self, x):
        return x

    def reference_derivative(self, x):
        return x


def test_verify_exits_1_and_names_the_failure(capsys, monkeypatch):
    broken = Entry(
        name="broken",
        module=_Broken,
        function=lambda x: _Broken()(x),
        summary=_Broken.summary,
        forward_mode=True,
        exact=False,
        elementwise=True,
        domain=_Broken.domain,
        reference_vjp=False,
    )
    monkeypatch.setattr(_cli, "catalogue", lambda: (broken,))
    code, out = _run(capsys, "verify")
    assert code == 1
    assert "broken FAILED" in out and "check `jvp` failed" in out
    code, out = _run(capsys, "--json")
    assert code == 1 and json.loads(out)[0]["passed"] is False


def test_list_and_markdown(capsys):
    code, out = _run(capsys, "list")
    assert code == 0
    for e in eqxrules.catalogue():
        assert e.name in out and e.module.__name__ in out
    code, out = _run(capsys, "list", "--markdown")
    assert out.count("\n") == len(eqxrules.catalogue()) + 2


def test_unknown_rule_is_a_clear_error(capsys):
    with pytest.raises(SystemExit, match="unknown rule"):
        _cli.main(["verify", "no_such_rule"])


def test_module_entry_point_runs():
    """`python -m eqxrules` itself (the __main__ module), on one cheap rule."""
    proc = subprocess.run(
        [sys.executable, "-m", "eqxrules", "verify", "detach"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "1/1 rules passed" in proc.stdout


def test_float_input_is_not_required_to_be_array():
    assert eqxrules.ste_round(jnp.float32(1.4)) == 1.0


@pytest.fixture
def fake_verify(monkeypatch):
    """`verify` replaced by an instant pass: for what the command line prints and
    when, not for the checks themselves."""
    monkeypatch.setattr(_cli, "verify", lambda entry: EntryResult(entry, [], 0.01))


def _names(out: str) -> list[str]:
    return [obj["name"] for obj in json.loads(out)]


@pytest.mark.parametrize(
    "argv",
    [
        ["--json"],
        ["--json", "verify", "detach"],
        ["verify", "--json", "detach"],
        ["verify", "detach", "--json"],
    ],
)
def test_json_before_or_after_verify(capsys, fake_verify, argv):
    # Before the command, argparse used to reset `--json` to the subcommand's
    # default: the flag was silently ignored.
    code, out = _run(capsys, *argv)
    want = ["detach"] if "detach" in argv else [e.name for e in eqxrules.catalogue()]
    assert code == 0 and _names(out) == want


@pytest.mark.parametrize(
    "argv",
    [
        ["--verbose"],
        ["--verbose", "verify", "detach"],
        ["verify", "--verbose", "detach"],
        ["verify", "detach", "--verbose"],
    ],
)
def test_verbose_before_or_after_verify(capsys, fake_verify, argv):
    assert _cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "verifying detach ..." in err and "detach: 0 examples checked" in err


@pytest.mark.parametrize("before", [True, False], ids=["before", "after"])
def test_list_flags_before_or_after(capsys, before):
    def argv(flag):
        return [flag, "list"] if before else ["list", flag]

    code, out = _run(capsys, *argv("--json"))
    entries = json.loads(out)
    assert code == 0 and [e["name"] for e in entries] == [
        e.name for e in eqxrules.catalogue()
    ]
    assert entries[0]["exact"] is True and entries[0]["module"] == "ScaledModel"
    code, out = _run(capsys, *argv("--verbose"))
    assert code == 0 and out.splitlines()[0].split()[-1] == "summary"
    for e in eqxrules.catalogue():
        assert e.summary in out


def test_list_markdown_and_json_together_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        _cli.main(["--json", "list", "--markdown"])
    assert e.value.code == 2
    assert (
        "`--markdown` and `--json` cannot be used together" in capsys.readouterr().err
    )


@pytest.mark.parametrize("count", [1, 2])
def test_verify_counts_rules_in_words(capsys, fake_verify, count):
    """ "Verifying 1 rule", not 0.2.0's "Verifying 1 rules"."""
    code, out = _run(capsys, "verify", *["detach", "ste_round"][:count])
    assert code == 0
    assert f"Verifying {count} rule{'s' if count > 1 else ''} with " in out


class _Terminal(io.StringIO):
    """A stdout that remembers what had been flushed by the last `flush()`."""

    flushed = ""

    def flush(self):
        self.flushed = self.getvalue()


_THREE = ["ste_sign", "detach", "clip_gradient"]


def _rows(text: str) -> list[str]:
    return [w[0] for w in map(str.split, text.splitlines()) if w and w[0] in _THREE]


def test_verify_prints_each_rule_as_it_is_verified(monkeypatch):
    terminal, flushed_at_each_call = _Terminal(), []

    def fake(entry):
        flushed_at_each_call.append(terminal.flushed)
        return EntryResult(entry, [], 0.01)

    monkeypatch.setattr(_cli, "verify", fake)
    monkeypatch.setattr(sys, "stdout", terminal)
    assert _cli.main(["verify", *_THREE]) == 0
    # Each rule's row was written and flushed before the next rule began.
    assert [_rows(s) for s in flushed_at_each_call] == [[], _THREE[:1], _THREE[:2]]
    assert "on backend" in flushed_at_each_call[0]  # the header came first
    assert _rows(terminal.flushed) == _THREE and "3/3 rules passed" in terminal.flushed


def test_verify_json_is_quiet_until_the_json(monkeypatch):
    terminal, written_at_each_call = _Terminal(), []

    def fake(entry):
        written_at_each_call.append(terminal.getvalue())
        return EntryResult(entry, [], 0.01)

    monkeypatch.setattr(_cli, "verify", fake)
    monkeypatch.setattr(sys, "stdout", terminal)
    assert _cli.main(["verify", "--json", *_THREE]) == 0
    assert written_at_each_call == ["", "", ""]
    assert _names(terminal.getvalue()) == _THREE


@pytest.mark.slow
def test_module_entry_point_stops_quietly_on_a_closed_pipe():
    """`python -m eqxrules list | head -1`: the reader leaves first."""
    with subprocess.Popen(
        [sys.executable, "-m", "eqxrules", "list"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # before the command writes (importing JAX takes longer)
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == 1
    assert err == ""
