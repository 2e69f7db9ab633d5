"""`python -m eqxrules check`: a function, a rule instance or a rule class, on
random inputs. A rule is checked as `verify` checks an example: its own
references, its declared domain, all its inputs (issue 40 §2: 0.3 drew every
input from a standard normal, `SafeSqrt` and `SafeArccos` failed on inputs outside
their domain, `SafeDivide` with "takes 2 positional argument(s)" and a
straight-through hint, and a class with a wrong reference derivative passed)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

import eqxrules
from eqxrules import _cli, _cli_check


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = _cli.main(list(argv))
    return code, capsys.readouterr().out


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

            @jax.custom_jvp
            def wrong_sin(x):
                return jnp.sin(x)

            wrong_sin.defjvp(lambda p, t: (jnp.sin(p[0]), 2 * jnp.cos(p[0]) * t[0]))

            def add(a, b):
                return a + b

            from typing import ClassVar

            class HardTanhSign(eqxrules.ElementwiseRule):
                '''sign(x), derivative t on |x| <= 1.'''

                summary: ClassVar[str] = "sign(x); derivative t·[|x| <= 1]"

                def kinks(self):
                    return (-1.0, 0.0, 1.0)

                def primal(self, x):
                    return jnp.where(x >= 0, 1.0, -1.0).astype(x.dtype)

                def slope(self, x):
                    return jnp.abs(x) <= 1

                def reference_forward(self, x):
                    return jnp.where(x < 0, -1.0, 1.0).astype(x.dtype)

                def reference_derivative(self, x):
                    return jnp.where(jnp.abs(x) <= 1, x, 0.0)

            class WrongReference(HardTanhSign):
                '''Planted: its reference derivative is twice the rule's.'''

                def reference_derivative(self, x):
                    return 2 * jnp.where(jnp.abs(x) <= 1, x, 0.0)

            class Matrix(eqxrules.JVPRule):
                '''y = A x: an argument named `A` and one named `x`.'''

                summary: ClassVar[str] = "A x"
                elementwise: ClassVar[bool] = False
                exact: ClassVar[bool] = True
                domain: ClassVar = eqxrules.Inputs(
                    A=eqxrules.Domain(shape=(3, 4)), x=eqxrules.Domain(shape=(4,))
                )

                def primal(self, A, x):
                    return A @ x

                def tangent(self, args, t_args, t_self, out):
                    (A, x), (tA, tx) = args, t_args
                    terms = [t for t in (None if tA is None else tA @ x,
                                         None if tx is None else A @ tx) if t is not None]
                    return sum(terms[1:], terms[0]) if terms else None

                def reference_forward(self, A, x):
                    return jnp.einsum("ij,j->i", A, x)

                def reference_derivative(self, A, x):
                    return jnp.einsum("ij,j->i", A, x)
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


def test_check_an_integer_dtype_names_the_flag(user_module):
    """`--dtype int32`: the error names `--dtype` and its value, not `check_rule`'s
    `args`, which the user never wrote."""
    with pytest.raises(SystemExit) as e:
        _cli.main(["check", "jax.numpy:sin", "--dtype", "int32"])
    message = str(e.value)
    assert "`--dtype` (='int32') must be a floating-point or complex dtype" in message
    assert "`args`" not in message


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


@pytest.mark.parametrize("spec", ["eqxrules:SafeSqrt", "eqxrules:SafeArccos"])
def test_check_draws_inputs_from_the_declared_domain(capsys, spec):
    """Planted as it was: 0.3's standard-normal inputs put negative `x` under a
    square root. From the declared domain, the rule passes (and its second
    order, which it declares)."""
    code, out = _run(capsys, "--verbose", "check", spec)
    assert code == 0 and out.rstrip().endswith("passed"), out
    assert "check `second_order` passed" in out


def test_inputs_that_ignore_the_domain_fail_a_correct_rule(capsys, monkeypatch):
    """The planted defect: 0.3's inputs, drawn from [-2, 2] whatever the rule
    declares. The same check then fails `SafeSqrt`, which is correct."""

    def ignored(args, rule, shape):
        return eqxrules.Domain(shape=rule.input_domain().shape)

    monkeypatch.setattr(_cli_check, "_domain", ignored)
    code, out = _run(capsys, "check", "eqxrules:SafeSqrt")
    assert code == 1 and out.rstrip().endswith("FAILED")


def test_check_a_rule_of_several_inputs(capsys, user_module):
    code, out = _run(capsys, "--verbose", "check", "eqxrules:SafeDivide")
    assert code == 0 and out.rstrip().endswith("passed"), out
    assert "takes 2 positional" not in out and "hint" not in out
    assert "check `held_fixed` passed" in out  # `a` and `b`, each alone
    code, out = _run(capsys, "check", "eqxrules:safe_divide")  # its function
    assert code == 0, out
    # Shapes that do not broadcast, each input named as `primal` names it.
    code, out = _run(capsys, "--json", "check", f"{user_module}:Matrix")
    assert code == 0 and json.loads(out)["passed"], out
    with pytest.raises(SystemExit, match=r"`--shape` \(='3'\) is one input's shape"):
        _cli.main(["check", "eqxrules:SafeDivide", "--shape", "3"])


def test_check_a_rule_class_uses_its_own_references(capsys, user_module):
    code, out = _run(capsys, "check", f"{user_module}:HardTanhSign")
    assert code == 0 and out.rstrip().endswith("passed"), out
    code, out = _run(capsys, "check", f"{user_module}:WrongReference")
    assert code == 1 and "check `vjp` failed" in out and "check `jvp` failed" in out
    # `--derivative` replaces the class's own.
    args = ["--derivative", f"{user_module}:surrogate"]
    code, out = _run(capsys, "check", f"{user_module}:WrongReference", *args)
    assert code == 0, out


@pytest.mark.parametrize(
    "spec",
    [
        "eqxrules:ste_sign",
        "eqxrules:SteSign",
        "my_rules:sign_layer",
        "my_rules:skip_scale",
    ],
)
def test_check_a_catalogue_surrogate_rule_needs_no_derivative(
    capsys, user_module, spec
):
    """A straight-through rule is checked against its own surrogate (0.3 refused
    it without `--derivative`)."""
    code, out = _run(capsys, "check", spec)
    assert code == 0 and out.rstrip().endswith("passed"), out


def test_check_an_exact_catalogue_rule_uses_finite_differences(capsys, user_module):
    code, out = _run(capsys, "check", f"{user_module}:exact_scale", "--verbose")
    assert code == 0 and "check `finite_differences` passed" in out


def test_failed_finite_differences_hint_at_derivative(capsys, user_module, recwarn):
    code, out = _run(capsys, "check", f"{user_module}:good")
    assert code == 1 and "check `finite_differences` failed" in out
    assert "hint: `my_rules:good`'s value is constant around the input" in out
    assert "`--derivative PKG.MODULE:NAME`" in out
    # The relative error divides by zero where the reference is 0; NumPy's
    # RuntimeWarning used to reach the terminal.
    assert [str(w.message) for w in recwarn] == []


def test_a_true_derivative_simply_wrong_gets_no_straight_through_hint(
    capsys, user_module
):
    """Planted: `sin` with a JVP twice too large. Its value moves, so the hint
    about straight-through rules (0.3 printed it here) does not apply."""
    code, out = _run(capsys, "check", f"{user_module}:wrong_sin")
    assert code == 1 and "check `finite_differences` failed" in out
    assert "hint" not in out


def test_a_function_of_two_inputs_is_a_clear_error(user_module):
    with pytest.raises(SystemExit) as e:
        _cli.main(["check", f"{user_module}:add"])
    message = str(e.value)
    assert "`fn` must take the arguments given after it" in message
    assert "same arguments as `fn`" not in message  # 0.3: "`fn` ... as `fn`"
    assert "(a, b)" in message and "`eqxrules.Inputs`" in message
