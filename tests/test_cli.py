"""`python -m eqxrules`: verify, list, check and exit codes."""

from __future__ import annotations

import io
import json
import pathlib
import subprocess
import sys
import textwrap
from typing import ClassVar

import jax.numpy as jnp
import pytest

import eqxrules
from eqxrules import _cli, _plot
from eqxrules._catalogue import Domain, Entry, JVPRule
from eqxrules._verify import EntryResult


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

            def identity(x):
                return x

            def noisy(x, key):
                return x + jax.random.normal(key, x.shape, x.dtype)

            def noisy_at_3(x):
                return x + jax.random.normal(jax.random.key(3), x.shape, x.dtype)

            import eqxrules
            sign_layer = eqxrules.SteSign()
            exact_scale = eqxrules.ScaledModel(jnp.sin, 2.0)
            skip_scale = eqxrules.ScaledModel(jnp.sin, 2.0, mode="skip_scale")
            sr_grid = eqxrules.SteQuantize(bits=4, rounding="stochastic")
            sr_e2m1 = eqxrules.FloatQuantize(format="e2m1", rounding="stochastic")
            nearest_e2m1 = eqxrules.FloatQuantize(format="e2m1")

            def within_6(x):
                return jnp.where(jnp.abs(x) <= 6, x, 0.0)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rules", raising=False)
    return "my_rules"


@pytest.mark.slow
def test_check_user_rule(capsys, user_module):
    m = user_module
    args = ["--forward", f"{m}:forward", "--derivative", f"{m}:surrogate"]
    code, out = _run(capsys, "check", f"{m}:good", *args, "--shape", "8,4")
    assert code == 0 and out.rstrip().endswith("passed")
    code, out = _run(capsys, "check", f"{m}:bad", *args, "--dtype", "bfloat16")
    assert code == 1 and "check `vjp` failed" in out
    assert "hint" not in out  # a `--derivative` was given: the hint is not for it


def test_check_bad_spec_is_a_clear_error(user_module):
    with pytest.raises(SystemExit, match="PKG.MODULE:NAME"):
        _cli.main(["check", "no_colon"])
    with pytest.raises(SystemExit, match="has no attribute"):
        _cli.main(["check", f"{user_module}:missing"])
    with pytest.raises(SystemExit, match="--shape"):
        _cli.main(["check", f"{user_module}:good", "--shape", "a,b"])
    with pytest.raises(SystemExit, match="cannot check `eqxrules:scaled_call`"):
        _cli.main(["check", "eqxrules:scaled_call"])  # takes a model and an array
    with pytest.raises(SystemExit, match="cannot be built with its defaults"):
        _cli.main(["check", "eqxrules:ScaledModel"])


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


@pytest.mark.parametrize("before", [True, False], ids=["before", "after"])
def test_check_flags_before_or_after(capsys, user_module, before):
    m = user_module
    spec = ["check", f"{m}:good", "--derivative", f"{m}:surrogate", "--shape", "4"]

    def argv(flag):
        return [flag, *spec] if before else [*spec, flag]

    code, out = _run(capsys, *argv("--json"))
    report = json.loads(out)
    assert code == 0 and report["passed"] is True
    assert report["checks"]["vjp"]["status"] == "passed"
    code, out = _run(capsys, *argv("--verbose"))
    assert code == 0 and "check `vjp` passed" in out  # passed checks shown too


@pytest.fixture
def fake_plot(monkeypatch):
    """`plot` replaced by one that writes nothing: for what the command line
    prints, not for the drawing."""

    def fake(names, out):
        return [pathlib.Path(out) / f"{n}.png" for n in names]

    monkeypatch.setattr(_plot, "plot", fake)


def test_plot_help_says_what_verbose_does_and_where_plots_go(capsys):
    """0.2.0's `plot --help` listed `--verbose` "not for plot", and `plot
    --verbose` was an error; nor did it say where the plots went."""
    with pytest.raises(SystemExit) as e:
        _cli.main(["plot", "--help"])
    assert e.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "progress on stderr (verify, plot)" in shown
    assert "not for plot" not in shown
    assert "./plots/NAME.png unless `--out`" in shown
    assert "(default: plots, under the current directory)" in shown


@pytest.mark.parametrize("argv", [["--verbose", "plot"], ["plot", "--verbose"]])
def test_plot_verbose_shows_progress(capsys, fake_plot, tmp_path, argv):
    code = _cli.main([*argv, "ste_sign", "SteRound", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 0
    assert "plotting ste_sign ..." in err and "plotting ste_round ..." in err
    assert f"wrote {tmp_path / 'ste_round.png'} in " in err


def test_plot_says_where_it_wrote(capsys, fake_plot, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = _run(capsys, "plot", "ste_sign")
    assert code == 0 and out.splitlines()[0] == str(pathlib.Path("plots/ste_sign.png"))
    default = "(the default: choose another with `--out DIR`)"
    assert f"Wrote 1 plot to {tmp_path / 'plots'} {default}." in out
    code, out = _run(capsys, "plot", "ste_sign", "detach", "--out", "elsewhere")
    assert f"Wrote 2 plots to {tmp_path / 'elsewhere'}." in out
    assert "the default" not in out


@pytest.mark.parametrize(
    "argv", [["--json", "plot", "ste_sign"], ["plot", "ste_sign", "--json"]]
)
def test_plot_json_before_or_after(capsys, fake_plot, tmp_path, argv):
    code, out = _run(capsys, *argv, "--out", str(tmp_path))
    assert code == 0 and json.loads(out) == [str(tmp_path / "ste_sign.png")]


@pytest.mark.parametrize("count", [1, 2])
def test_verify_counts_rules_in_words(capsys, fake_verify, count):
    """ "Verifying 1 rule", not 0.2.0's "Verifying 1 rules"."""
    code, out = _run(capsys, "verify", *["detach", "ste_round"][:count])
    assert code == 0
    assert f"Verifying {count} rule{'s' if count > 1 else ''} with " in out


def test_check_an_integer_dtype_names_the_flag(user_module):
    """`--dtype int32`: the error names `--dtype` and its value, not `check_rule`'s
    `args`, which the user never wrote."""
    with pytest.raises(SystemExit) as e:
        _cli.main(["check", "jax.numpy:sin", "--dtype", "int32"])
    message = str(e.value)
    assert "`--dtype` (='int32') must be a floating-point or complex dtype" in message
    assert "`args`" not in message


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


@pytest.mark.parametrize("flag", ["--key", "--seed"])
@pytest.mark.parametrize("value", ["-1", "abc", "1.5", str(2**63)])
def test_bad_seed_is_an_argparse_error(capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        _cli.main(["check", "eqxrules:ste_round", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: `{flag}` (={value!r}) must be a non-negative" in err


@pytest.mark.slow
def test_check_stochastic_round_gets_a_key(capsys, user_module):
    args = ["--shape", "8", "--derivative", f"{user_module}:identity"]
    for spec in ("eqxrules:stochastic_round", "eqxrules:StochasticRound"):
        code, out = _run(capsys, "check", spec, *args)
        assert code == 0 and out.rstrip().endswith("passed")
        assert "needs a PRNG key: using jax.random.key(0)" in out
        code, out = _run(capsys, "check", spec, *args, "--key", "7")
        assert code == 0 and "using jax.random.key(0)" not in out


@pytest.mark.slow
@pytest.mark.first_case_quick
@pytest.mark.parametrize(
    "spec, derivative",
    [("sr_grid", "surrogate"), ("sr_e2m1", "within_6")],
)
def test_check_gives_a_stochastic_instance_a_key(capsys, user_module, spec, derivative):
    """An instance whose hyperparameters make it draw (`rounding="stochastic"`),
    though its `primal` takes `key=None`, gets `key(0)` with the note, as a rule
    whose `primal` requires a key does; the same instance rounding to nearest
    gets none."""
    m = user_module
    args = [f"{m}:{spec}", "--shape", "8", "--derivative", f"{m}:{derivative}"]
    code, out = _run(capsys, "check", *args)
    assert code == 0 and out.rstrip().endswith("passed"), out
    assert f"`{m}:{spec}` needs a PRNG key: using jax.random.key(0)" in out
    code, out = _run(capsys, "check", *args, "--key", "5")
    assert code == 0 and "using jax.random.key(0)" not in out
    nearest = [f"{m}:nearest_e2m1", "--derivative", f"{m}:within_6"]
    code, out = _run(capsys, "check", *nearest)
    assert code == 0 and "needs a PRNG key" not in out


@pytest.mark.parametrize("seed, code", [("3", 0), ("4", 1)])
def test_check_passes_the_key_seed_to_the_rule(capsys, user_module, seed, code):
    m = user_module
    refs = ["--forward", f"{m}:noisy_at_3", "--derivative", f"{m}:identity"]
    got, out = _run(capsys, "check", f"{m}:noisy", *refs, "--key", seed)
    assert got == code
    assert ("check `primal` failed" in out) == (code == 1)


def test_key_for_a_rule_without_one_is_an_error(user_module):
    m = user_module
    with pytest.raises(SystemExit, match=r"`--key` \(=1\) was given, but"):
        _cli.main(
            ["check", f"{m}:good", "--derivative", f"{m}:surrogate", "--key", "1"]
        )


@pytest.mark.parametrize(
    "spec",
    [
        "eqxrules:ste_sign",
        "eqxrules:SteSign",
        "eqxrules:stochastic_round",
        "my_rules:sign_layer",
        "my_rules:skip_scale",  # not exact by its `mode`
    ],
)
def test_check_a_surrogate_rule_without_derivative_says_so(user_module, spec):
    with pytest.raises(SystemExit, match="is not exact") as e:
        _cli.main(["check", spec])
    assert "straight-through" in str(e.value) and "--derivative" in str(e.value)


@pytest.mark.slow
def test_check_an_exact_catalogue_rule_uses_finite_differences(capsys, user_module):
    code, out = _run(capsys, "check", f"{user_module}:exact_scale", "--verbose")
    assert code == 0 and "check `finite_differences` passed" in out


def test_failed_finite_differences_hint_at_derivative(capsys, user_module, recwarn):
    code, out = _run(capsys, "check", f"{user_module}:good")
    assert code == 1 and "check `finite_differences` failed" in out
    assert "hint: if `my_rules:good` is a straight-through (surrogate) rule" in out
    assert "`--derivative PKG.MODULE:NAME`" in out
    # The relative error divides by zero where the reference is 0; NumPy's
    # RuntimeWarning used to reach the terminal.
    assert [str(w.message) for w in recwarn] == []


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
