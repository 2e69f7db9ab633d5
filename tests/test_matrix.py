"""The transformation matrix: every catalogue entry through every situation it
supports (issue 5), at every dtype that situation runs in.

One parametrised test over `catalogue() × situation × dtype`. Which situations an
entry gets, and with which of its examples, is read from its data when the module is
collected (`forward_mode`, `elementwise`, `pytree_input`, `is_exact()`,
`higher_order()`, `reference_vjp`, `input_domain()`, `call_kwargs`): nothing here names a
rule, nothing is skipped at run time, and a new rule is covered by declaring it.

What `tests/test_catalogue.py` already proves is not repeated: the `check_rule`
battery, the hypothesis comparison with the references, the bf16/f16/f32 dtype of
value and gradient under `filter_jit`, the `TypeError` of an elementwise rule on an
integer input, and the reverse-only error under `jvp`/`jacfwd`/`hessian`. Sharding
is in `tests/test_sharding.py`, misuse in `tests/test_misuse.py`. The bfloat16 and
float16 columns are marked `slow`.

Most situations compare a transformed rule with the same rule plainly jitted (value
and gradient, compiled once per example and reused); the second-order, dtype and
pytree situations compare with the rule's own references. Compilation is what costs
here, so each situation compiles one program computing everything it compares, host
arrays are built with numpy (an eager JAX operation on a new shape is a compilation
too), and the harness's programs are compiled without LLVM optimisation.

The harness and the situations live in `tests/matrix/`: `harness.py` (helpers,
`Case`, the registry), `transforms.py`, `modes.py` and `inputs.py` (the situations,
by kind); this file builds the matrix from them and runs it.
"""

from __future__ import annotations

from typing import Any

import jax
import pytest
from conftest import ENTRIES
from matrix import inputs, modes, transforms  # noqa: F401  (each registers its situations)
from matrix.harness import (
    BF16,
    F16,
    SITUATIONS,
    Case,
    _checking_leaks,
    _every,
    _examples,
    _first,
)

import eqxrules
from eqxrules._registry import entry_of

# The slow tier: every entry through every transformation. Each entry's first example
# also runs at the minimum versions in CI (tests/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.catalogue_wide]

# The low-precision columns compile one more program per entry each, and
# `test_catalogue.py` already checks their dtypes: they run with the slow tests.
SLOW_DTYPES = (BF16, F16)


def _matrix() -> list[Any]:
    return [
        pytest.param(
            entry,
            index,
            s.name,
            dtype,
            id=f"{entry.name}-{index}-{s.name}-{dtype}",
            marks=[pytest.mark.slow] if dtype in SLOW_DTYPES else [],
        )
        for entry in ENTRIES
        for s in SITUATIONS.values()
        for index in s.examples(entry)
        for dtype in s.dtypes
    ]


MATRIX = _matrix()


def test_every_entry_gets_the_situations_its_data_implies():
    """The matrix is built from data: every entry is in every situation that
    applies to all entries, in exactly one of `forward_mode` and `reverse_only`,
    and in the situations its flags imply."""
    cells = {(p.values[0].name, p.values[2]) for p in MATRIX}
    universal = [s.name for s in SITUATIONS.values() if s.examples in (_first, _every)]
    for entry in ENTRIES:
        mine = {name for e, name in cells if e == entry.name}
        assert set(universal) <= mine, entry.name
        assert mine & {"forward_mode", "reverse_only"} == {
            "forward_mode" if entry.forward_mode else "reverse_only"
        }
        assert ("integer_input" in mine) == entry.elementwise
        assert ("pytree_input" in mine) == entry.module.pytree_input
        several = isinstance(entry.domain, eqxrules.Inputs)
        assert ("integer_inputs" in mine) == several
        higher = any(r.higher_order() for r in _examples(entry))
        assert ("second_order" in mine) == higher


def test_the_leak_check_still_finds_a_leak():
    """`_checking_leaks` freezes the old heap for speed; a tracer stored in a
    container from before is still reported."""
    leaked: list[Any] = []
    with pytest.raises(Exception, match="Leaked"):
        with _checking_leaks():
            jax.make_jaxpr(lambda x: leaked.append(x) or x)(1.0)


@pytest.mark.parametrize("entry,index,situation,dtype", MATRIX)
def test_matrix(entry, index, situation, dtype):
    SITUATIONS[situation].run(Case(entry, index), dtype)


# Planted defects for the situations of rules of several inputs: each must fail.


class _UncheckedDivide(eqxrules.SafeDivide):
    """Planted: checks neither input, so an integer `b` is silently converted."""

    def _check_call(self, args):
        pass


class _DropsB(eqxrules.SafeDivide):
    """Planted: `b`'s tangent is dropped whenever `a` has one too."""

    def tangent(self, args, t_args, t_self, out, **kwargs):
        t_a, t_b = t_args
        dropped = (t_a, None) if t_a is not None else (t_a, t_b)
        return super().tangent(args, dropped, t_self, out, **kwargs)


@pytest.mark.parametrize(
    "rule,situation",
    [(_UncheckedDivide, "integer_inputs"), (_DropsB, "symbolic_zeros")],
)
def test_the_situations_of_several_inputs_catch_planted_defects(rule, situation):
    case = Case(entry_of(rule), 0)
    # A failed assertion, or pytest's "DID NOT RAISE" (not an `Exception`).
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        SITUATIONS[situation].run(case, "float32")
    # The real rule passes the same situation.
    SITUATIONS[situation].run(Case(entry_of(eqxrules.SafeDivide), 0), "float32")
