"""`python -m eqxrules check|verify PKG.MODULE:NAME` on a rule class of the user's
own (issue 25 §4), and `--version`.

Before: `check mymod:MyRule` called the class with the input array as its
hyperparameter (every check failed with "`bits` (=JitTracer(float32[8,4])) must be
an integer", the modes shown as `rev`), and `verify mymod:MyRule` said "unknown
rule(s)"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import pytest

import eqxrules
from eqxrules import _cli

USER_MODULE = '''
from typing import ClassVar

import jax.numpy as jnp

import eqxrules
from eqxrules.checks import at_least, at_most, integer


class MyRule(eqxrules.ElementwiseRule):
    """Round onto `bits` bits in [-1, 1]; the derivative passes `t` inside."""

    bits: int = eqxrules.hyperparameter(4, integer, at_least(2), at_most(8))
    summary: ClassVar[str] = "round onto a grid in [-1, 1]; derivative t inside"

    def kinks(self):
        return (-1.0, 1.0)

    def primal(self, x):
        n = 2 ** (self.bits - 1)
        return jnp.round(jnp.clip(x, -1, 1) * n) / n

    def slope(self, x):
        return jnp.abs(x) <= 1

    def reference_forward(self, x):
        n = 2 ** (self.bits - 1)
        return jnp.round(jnp.minimum(jnp.maximum(x, -1), 1) * n) / n

    def reference_derivative(self, x):
        return jnp.where(jnp.abs(x) <= 1, x, 0.0)

    @classmethod
    def examples(cls, key):
        return [cls(), cls(bits=2)]


class Twice(MyRule):
    """`MyRule` with a derivative twice its reference's."""

    def slope(self, x):
        return jnp.where(jnp.abs(x) <= 1, 2.0, 0.0).astype(x.dtype)


class Undeclared(MyRule):
    """`MyRule` with a field not declared with `hyperparameter`."""

    offset: float = 0.0


class Reverse(eqxrules.VJPRule):
    """Identity with the cotangent halved: reverse mode only."""

    summary: ClassVar[str] = "identity; cotangent halved"

    def primal(self, x):
        return x

    def bwd(self, residuals, cotangent, args):
        return (cotangent / 2,)

    def reference_forward(self, x):
        return x

    def reference_derivative(self, x):
        return x / 2


class Claims(Reverse):
    """A reverse-only rule that declares forward mode."""

    forward_mode: ClassVar[bool] = True


class NeedsArgs(Reverse):
    """`Reverse` with a `scale` that has no default."""

    scale: float = eqxrules.hyperparameter(eqxrules.checks.positive)


my_rule = MyRule(bits=3)


def surrogate(x):
    return jnp.where(jnp.abs(x) <= 1, x, 0.0)


def half(x):
    return x / 2
'''


@pytest.fixture
def user(tmp_path, monkeypatch):
    (tmp_path / "my_user_rules.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_user_rules", raising=False)
    return "my_user_rules"


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = _cli.main(list(argv))
    return code, capsys.readouterr().out


def _row(out: str, name: str) -> list[str]:
    return next(line.split() for line in out.splitlines() if line.startswith(name))


def test_check_builds_a_user_class_with_its_defaults(capsys, user):
    spec = f"{user}:MyRule"
    code, out = _run(capsys, "check", spec, "--derivative", f"{user}:surrogate")
    assert "must be an integer" not in out
    assert code == 0 and out.rstrip().endswith("passed"), out
    assert _row(out, spec)[1] == "fwd+rev"  # a JVPRule: both modes


def test_check_a_user_instance_and_a_reverse_only_class(capsys, user):
    code, out = _run(
        capsys, "check", f"{user}:my_rule", "--derivative", f"{user}:surrogate"
    )
    assert code == 0 and _row(out, f"{user}:my_rule")[1] == "fwd+rev"
    code, out = _run(
        capsys, "--json", "check", f"{user}:Reverse", "--derivative", f"{user}:half"
    )
    report = json.loads(out)
    assert code == 0 and report["passed"] and report["modes"] == ["rev"]
    assert report["checks"]["jvp"]["status"] == "unsupported"


def test_check_a_declared_mode_the_rule_lacks_fails(capsys, user):
    """Planted: a reverse-only rule declaring forward mode. The modes shown are the
    declaration's, so the checker's finding must be compared with them."""
    spec = f"{user}:Claims"
    code, out = _run(capsys, "check", spec, "--derivative", f"{user}:half")
    assert code == 1 and out.rstrip().endswith("FAILED")
    assert "forward mode: declared True (as a JVPRule)" in out
    assert "the rule does not support it" in out


def test_check_a_user_class_uses_its_own_references(capsys, user):
    """A class and an instance are checked against their own references, with no
    `--derivative` (0.3 refused a rule that is not exact without one)."""
    code, out = _run(capsys, "check", f"{user}:MyRule")
    assert code == 0 and out.rstrip().endswith("passed"), out
    code, out = _run(capsys, "check", f"{user}:my_rule")
    assert code == 0, out
    code, out = _run(capsys, "check", f"{user}:Twice")  # planted: 2x the reference
    assert code == 1 and "check `vjp` failed" in out
    with pytest.raises(SystemExit, match="cannot be built with its defaults"):
        _cli.main(["check", f"{user}:NeedsArgs", "--derivative", f"{user}:surrogate"])


def test_verify_a_user_class(capsys, user):
    spec = f"{user}:MyRule"
    code, out = _run(capsys, "verify", spec, "detach")
    assert code == 0 and "2/2 rules passed" in out, out
    row = _row(out, spec)
    assert row[1] == "fwd+rev" and "FAIL" not in row
    code, out = _run(capsys, "verify", spec, "--json")
    (obj,) = json.loads(out)
    assert code == 0 and obj["passed"] is True
    assert obj["name"] == spec and obj["module"] == "MyRule"
    assert obj["examples"] == 2  # each example at its kinks (not exact: no fd)


def test_verify_a_user_class_runs_verify_rules_battery(capsys, user):
    """Planted: a derivative twice its reference's (caught by `check_rule`), and an
    undeclared field (caught only by `verify_rule`'s declaration check)."""
    code, out = _run(capsys, "verify", f"{user}:Twice", f"{user}:Undeclared")
    assert code == 1 and "0/2 rules passed" in out
    assert f"{user}:Twice FAILED" in out and "check `jvp` failed" in out
    assert f"{user}:Undeclared FAILED" in out
    assert "a declaration of field `offset` with `hyperparameter(...)`" in out


def test_verify_a_reverse_only_user_class(capsys, user):
    code, out = _run(capsys, "verify", f"{user}:Reverse")
    assert code == 0 and _row(out, f"{user}:Reverse")[1] == "rev"


def test_verify_what_is_not_a_rule_class_is_a_clear_error(capsys, user):
    with pytest.raises(SystemExit) as e:
        _cli.main(["verify", f"{user}:my_rule"])
    assert "is an instance of `MyRule`: point at its class" in str(e.value)
    assert f"({user}:MyRule)" in str(e.value)
    with pytest.raises(SystemExit, match="is not a rule class"):
        _cli.main(["verify", f"{user}:surrogate"])
    with pytest.raises(SystemExit, match="has no attribute 'Nope'"):
        _cli.main(["verify", f"{user}:Nope"])
    with pytest.raises(SystemExit, match=r"a rule of your own: PKG\.MODULE:NAME"):
        _cli.main(["verify", "no_such_rule"])


def test_verify_a_library_class_by_its_path(capsys):
    code, out = _run(capsys, "verify", "eqxrules:Detach")
    assert code == 0 and _row(out, "detach")[1] == "fwd+rev"


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        _cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == (
        f"eqxrules {eqxrules.__version__} (jax {jax.__version__}, "
        f"equinox {eqx.__version__})\n"
    )


@pytest.mark.slow
def test_verify_a_user_class_from_the_shell(tmp_path):
    """The issue's own command, through `python -m eqxrules`."""
    (tmp_path / "mymod.py").write_text(textwrap.dedent(USER_MODULE))
    path = os.pathsep.join([str(tmp_path), os.getcwd()])
    proc = subprocess.run(
        [sys.executable, "-m", "eqxrules", "verify", "mymod:MyRule"],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1/1 rules passed" in proc.stdout
