"""The checker's core (`eqxrules/testing/_core.py`): one compiled program for the
rule's and the references' value and derivatives, shared by the checks; and where
it cannot serve (a reference written in NumPy, a part that raises), each part on
its own, as if there were no core."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxrules.testing import _core, _programs, check_rule

X = jnp.array([[0.5, -1.25, 2.0], [0.25, -0.75, 1.5]])


def _rule(shift: float):
    """A fresh rule (its own program): `sin`, its JVP the surrogate `cos + shift`."""

    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return jnp.sin(x), (jnp.cos(x) + shift) * t

    # The derivative reference: a function whose own derivative is the surrogate.
    return f, (lambda x: jnp.sin(x) + shift * x)


def _programs_compiled(monkeypatch, shift: float, **kw) -> int:
    monkeypatch.setattr(_programs, "_cache", collections.OrderedDict())
    f, derivative = _rule(shift)
    check_rule(f, X, forward=jnp.sin, derivative=derivative, order=2, **kw)
    return len(_programs._cache)


def test_the_checks_share_one_program(monkeypatch):
    # With the core: it (value, first and second derivatives of the rule and of
    # its references) and `vmap` of both modes; 10 programs before it.
    with_core = _programs_compiled(monkeypatch, 0.125)
    assert with_core <= 2, with_core
    # Planted: no core, each part its own program, as before it.
    monkeypatch.setattr(_core, "build", lambda p: None)
    without = _programs_compiled(monkeypatch, 0.25)
    assert without >= with_core + 6, (with_core, without)


def test_a_reference_in_numpy_is_evaluated_eagerly():
    f, _ = _rule(0.0)

    def forward(x):  # NumPy, on concrete values: not traceable
        return np.sin(np.asarray(x))

    report = check_rule(f, X, forward=forward, derivative=jnp.sin)
    assert report["primal"].status == "passed"

    def wrong(x):  # ... and still checked: off at one element
        y = np.sin(np.asarray(x)).copy()
        y[1, 2] += 1e-2
        return y

    report = check_rule(f, X, forward=wrong, derivative=jnp.sin, raise_on_failure=False)
    assert report.failed == ["primal"], report
    assert report["primal"].index == (1, 2)


@pytest.mark.parametrize("part", ["jvp", "vjp"])
def test_a_part_that_raises_fails_only_its_checks(part):
    @jax.custom_vjp
    def g(x):
        return jnp.sin(x)

    def fwd(x):
        return jnp.sin(x), x

    def bwd(x, ct):
        if part == "vjp":
            raise ValueError("bwd broken")
        return (jnp.cos(x) * ct,)

    g.defvjp(fwd, bwd)
    report = check_rule(
        g, X, forward=jnp.sin, derivative=jnp.sin, raise_on_failure=False
    )
    assert report["primal"].status == "passed"
    if part == "vjp":
        assert "vjp" in report.failed and isinstance(
            report["vjp"].exception, ValueError
        )
    else:  # a custom_vjp has no forward mode: reverse mode passes all the same
        assert report.passed, report
        assert report["jvp"].status == "unsupported"


def test_the_problem_and_the_core_import_one_way():
    """`_problem` builds its parts from `_core`; the core reads the problem through
    a `Protocol`, never importing it, not even for type checking (issue 40 §5:
    the one loop in the package, `_problem` <-> `_core`)."""
    import pathlib

    from test_imports import find_cycle, import_graph

    root = pathlib.Path(__file__).resolve().parent.parent / "eqxrules"
    graph = import_graph(root, module_level=False)  # deferred and TYPE_CHECKING too
    assert "eqxrules.testing._core" in graph["eqxrules.testing._problem"]
    assert "eqxrules.testing._problem" not in graph["eqxrules.testing._core"]
    assert find_cycle(graph) is None
    # Planted: the 0.3 import back, under `TYPE_CHECKING`, is a loop.
    graph["eqxrules.testing._core"].add("eqxrules.testing._problem")
    assert find_cycle(graph) is not None
