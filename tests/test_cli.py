"""`python -m eqxrules`: verify, list, check and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import ClassVar

import jax.numpy as jnp
import pytest

import eqxrules
from eqxrules import _cli
from eqxrules._catalogue import Domain, Entry, JVPRule


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = _cli.main(list(argv))
    return code, capsys.readouterr().out


def test_verify_prints_backend_table_and_passes(capsys):
    code, out = _run(capsys, "verify", "ste_round", "gradient_reversal")
    assert code == 0
    assert "on backend 'cpu'" in out
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


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rules.py").write_text(
        textwrap.dedent(
            """
            import jax, jax.numpy as jnp

            @jax.custom_jvp
            def good(x):
                return jnp.where(x >= 0, 1.0, -1.0).astype(x.dtype)

            @good.defjvp
            def _good_jvp(p, t):
                (x,), (tx,) = p, t
                return good(x), tx * (jnp.abs(x) <= 1).astype(x.dtype)

            @jax.custom_jvp
            def bad(x):
                return good(x)

            @bad.defjvp
            def _bad_jvp(p, t):
                (x,), (tx,) = p, t
                return bad(x), tx * (jnp.abs(x) < 0.5).astype(x.dtype)

            def forward(x):
                return jnp.where(x >= 0, 1.0, -1.0).astype(x.dtype)

            def surrogate(x):
                return jnp.where(jnp.abs(x) <= 1, x, 0.0)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rules"


def test_check_user_rule(capsys, user_module):
    m = user_module
    args = ["--forward", f"{m}:forward", "--derivative", f"{m}:surrogate"]
    code, out = _run(capsys, "check", f"{m}:good", *args, "--shape", "8,4")
    assert code == 0 and out.rstrip().endswith("passed")
    code, out = _run(capsys, "check", f"{m}:bad", *args, "--dtype", "bfloat16")
    assert code == 1 and "check `vjp` failed" in out


def test_check_bad_spec_is_a_clear_error(user_module):
    with pytest.raises(SystemExit, match="PKG.MODULE:NAME"):
        _cli.main(["check", "no_colon"])
    with pytest.raises(SystemExit, match="has no attribute"):
        _cli.main(["check", f"{user_module}:missing"])
    with pytest.raises(SystemExit, match="--shape"):
        _cli.main(["check", f"{user_module}:good", "--shape", "a,b"])


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
