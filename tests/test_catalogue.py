"""One parametrised test over every catalogue entry (the lineax pattern), and the
declaration mechanism that builds the catalogue.

Capabilities are data on the entry (`forward_mode`, `is_exact()`, `elementwise`,
each example's `input_domain()`): nothing here names a rule, so adding one needs no
edit to this file."""

from __future__ import annotations

import dataclasses
import functools as ft
import inspect
import subprocess
import sys
import textwrap
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from conftest import ENTRIES, KEY, call, example_cases, examples
from hypothesis import given, strategies as st

import eqxrules
from eqxrules._hyper import declarations
from eqxrules._registry import missing_parts
from eqxrules._verify import verify
from eqxrules.testing import strategies

CASES = example_cases()


def _example(entry, index):
    return examples(entry)[index]


def _cast(tree, dtype):
    return jtu.tree_map(
        lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, tree
    )


def test_catalogue_is_not_empty_and_names_are_unique():
    names = [e.name for e in ENTRIES]
    assert names and len(names) == len(set(names))
    for e in ENTRIES:
        assert getattr(eqxrules, e.name) is e.function
        assert getattr(eqxrules, e.module.__name__) is e.module
        assert {e.name, e.module.__name__} <= set(eqxrules.__all__)


def _public_rule_classes(cls=eqxrules.Rule):
    for sub in cls.__subclasses__():
        # Equinox < 0.12 also makes an "initable" copy of each Module class, with its
        # name and module: only the class its module defines under that name counts.
        defined = getattr(sys.modules[sub.__module__], sub.__name__, None) is sub
        if sub.__module__.startswith("eqxrules.") and not sub.__name__.startswith("_"):
            if defined:
                yield sub
        yield from _public_rule_classes(sub)


def test_every_public_rule_class_is_in_the_catalogue():
    """Defining a rule in `eqxrules._rules` registers it: none can drop out of the
    catalogue, the tests, the CLI or the README."""
    catalogued = {e.module for e in ENTRIES}
    bases = {
        eqxrules.JVPRule,
        eqxrules.VJPRule,
        eqxrules.PytreeRule,
        eqxrules.ElementwiseRule,
        eqxrules.BlockQuantizer,
    }
    missing = [
        c.__name__ for c in _public_rule_classes() if c not in bases | catalogued
    ]
    assert not missing, f"public Rule subclasses missing from catalogue(): {missing}"


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_declaration_is_complete(entry):
    """Docstring, `summary`, value, derivative, references, declared fields and a
    functional form: a missing part is named."""
    missing = missing_parts(entry.module)
    assert not missing, f"`{entry.module.__name__}` is missing: " + "; ".join(missing)


class _Forgetful(eqxrules.JVPRule):
    width: float = eqx.field(static=True, default=1.0)

    def primal(self, x):
        return x


def test_a_forgotten_part_is_named():
    """The planted defect: a rule with no docstring, summary, derivative,
    references or field declaration, defined outside `eqxrules._rules`, so not in
    the catalogue either."""
    missing = "\n".join(missing_parts(_Forgetful))
    for part in (
        "class docstring",
        "`summary`",
        "`tangent`",
        "`reference_forward`",
        "`reference_derivative` or `reference_vjp`",
        "field `width` with `hyperparameter(...)`",
        "registration",
    ):
        assert part in missing, (part, missing)
    assert _Forgetful not in {e.module for e in eqxrules.catalogue()}


@pytest.mark.slow
def test_a_user_rule_joins_the_catalogue_only_when_asked():
    """A `Rule` subclass defined outside eqxrules is not registered, nor is it when
    its functional form is declared with `eqxrules.functional`; with
    `register=True` it joins (after the library's rules). In a subprocess, so this
    session's catalogue stays the library's."""
    code = textwrap.dedent(
        """
        import eqxrules

        class Twice(eqxrules.JVPRule):
            "Twice the value."
            summary = "2x"
            def primal(self, x):
                return 2 * x
            def tangent(self, args, t_args, t_self, out):
                return None if t_args[0] is None else 2 * t_args[0]
            def reference_forward(self, x):
                return 2 * x
            def reference_derivative(self, x):
                return 2 * x

        before = [e.name for e in eqxrules.catalogue()]
        assert Twice not in [e.module for e in eqxrules.catalogue()]

        @eqxrules.functional(Twice)
        def twice(x):
            return Twice()(x)

        assert [e.name for e in eqxrules.catalogue()] == before
        assert twice(2.0) == 4.0

        class Thrice(Twice):
            "Thrice the value."
            summary = "3x"
            def primal(self, x):
                return 3 * x

        @eqxrules.functional(Thrice, register=True)
        def thrice(x):
            return Thrice()(x)

        after = [e.name for e in eqxrules.catalogue()]
        assert after == before + ["thrice"], after
        assert "thrice" not in eqxrules.__all__
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_functional_form_states_no_default_of_its_own(entry):
    """Defaults are stated once, on the fields: every static hyperparameter is a
    parameter of the functional form with the field's default (or none),
    keyword-only unless declared `positional=True`, and its docstring is the rule's `summary`."""
    params = inspect.signature(entry.function).parameters
    for f in dataclasses.fields(entry.module):  # type: ignore[arg-type]
        if not f.metadata.get("static", False):
            continue
        assert f.name in params, (entry.name, f.name)
        p = params[f.name]
        by_position = declarations(entry.module)[f.name].positional
        kind = p.POSITIONAL_OR_KEYWORD if by_position else p.KEYWORD_ONLY
        assert p.kind is kind, (entry.name, f.name, p.kind)
        default = p.empty if f.default is dataclasses.MISSING else f.default
        assert p.default == default, (entry.name, f.name, p.default, default)
    assert entry.summary and entry.summary in (entry.function.__doc__ or "")
    assert f"[`{entry.module.__name__}`][]" in (entry.function.__doc__ or "")


def test_kinks_follow_the_hyperparameters():
    """Each instance knows where its derivative jumps; the entry's domain holds
    the kinks of all its examples."""
    assert set(eqxrules.SteSign(clip_value=0.5).kinks()) == {-0.5, 0.0, 0.5}
    assert set(eqxrules.SteSign(clip_value=None).kinks()) == {0.0}
    domain = eqxrules.SteQuantize(bits=1, lo=0.0, hi=2.0).input_domain()
    assert set(domain.kinks) == {0.0, 1.0, 2.0}  # the ends and the tie between
    for entry in ENTRIES:
        union = {k for rule in examples(entry) for k in rule.kinks()}
        assert set(entry.domain.kinks) == union, entry.name


class _MySign(eqxrules.SteSign):
    summary: ClassVar[str] = "not a catalogue rule"


def test_a_subclass_of_a_rule_elsewhere_is_not_registered():
    assert _MySign not in {e.module for e in eqxrules.catalogue()}
    assert _MySign(clip_value=0.5)(jnp.array([0.3])).tolist() == [1.0]


@pytest.mark.parametrize("entry,index", example_cases())
def test_entry_passes_check_rule(entry, index):
    """The whole battery of `check_rule` on each example, at inputs holding all its
    kinks (so boundary behaviour is compared with the reference) and at its
    degenerate inputs, plus finite differences off the kinks for an exact example:
    what `python -m eqxrules` runs, one example per case (the first of each entry in
    the quick tier)."""
    result = verify(entry, indices=[index])
    assert len(result.examples) == 1
    assert all(label.startswith(f"example {index} ") for label in result.labels)
    assert result.passed, "\n".join(result.failures())
    for report in result.reports:
        expected = "passed" if entry.forward_mode else "unsupported"
        # (At an extreme input outside the references' domain a check is skipped,
        # and `result.skipped` says so.)
        outside = "outside the rule's domain"
        for name, want in (("jvp", expected), ("vjp", "passed")):
            got = report[name]
            assert got.status == want or outside in got.detail, (name, got)
    if result.examples[0].is_exact():
        assert result.status("finite_differences") == "passed"


@ft.cache
def _jitted_pair(entry, index):
    """Rule and reference (value and VJP) for one example, jitted once so hypothesis
    can draw many inputs cheaply."""
    rule = _example(entry, index)

    def both(x, ct):
        fn, (m, *xs), refs = entry.check_arguments(rule, x, jax.random.key(2))
        # With respect to every floating-point input (a mask is held as it is).
        d, fixed = eqx.partition(xs, eqx.is_inexact_array)

        def at(f):
            return lambda d: f(m, *eqx.combine(d, fixed))

        out, pullback = jax.vjp(at(fn), d)
        ref_out = refs["forward"](m, *xs)
        if "derivative" in refs:
            _, ref_pullback = jax.vjp(at(refs["derivative"]), d)
            (ref_ct,) = ref_pullback(ct)
        else:
            ref_ct = eqx.filter(
                refs["reference_vjp"](ct, m, *xs)[1:], eqx.is_inexact_array
            )
        return out, pullback(ct)[0], ref_out, ref_ct

    return jax.jit(both), rule


@pytest.mark.catalogue_wide
@pytest.mark.first_entry_quick
@pytest.mark.parametrize("entry,index", CASES)
@given(data=st.data())
def test_entry_matches_reference_on_random_inputs(entry, index, data):
    """Property: value and VJP equal the references on hypothesis-drawn inputs, with
    the kinks themselves mixed in (boundaries are where STEs go wrong)."""
    both, rule = _jitted_pair(entry, index)
    domain = rule.input_domain()
    x = data.draw(strategies.inputs(domain, off_kinks=False, with_kinks=True))
    out_shape = jax.eval_shape(lambda x: call(rule, x, **rule.call_kwargs(KEY)), x)
    seed = data.draw(st.integers(0, 2**16))
    ct = jtu.tree_map(
        lambda s: jax.random.normal(jax.random.key(seed), s.shape, s.dtype), out_shape
    )
    out, grad, ref_out, ref_grad = both(x, ct)
    for a, b in zip(jtu.tree_leaves((out, grad)), jtu.tree_leaves((ref_out, ref_grad))):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=_leaf_atol(b))


def _leaf_atol(b: np.ndarray) -> float:
    """1e-6, or 1e-5 of the leaf's largest finite magnitude if that is more: a
    derivative that cancels (`safe_normalize`'s `(t - y<y, t>) / |x|`, of order
    `1/|x|`) is exact only to the rounding of its largest terms, so an entry that
    cancels to near 0 is compared with the leaf's scale, not its own (issue 27:
    "rtol 1e-5 of the largest entry")."""
    finite = np.abs(b[np.isfinite(b)]).astype(np.float64)
    return max(1e-6, 1e-5 * float(np.max(finite, initial=0.0)))


def test_leaf_atol_still_catches_a_wrong_entry():
    """The leaf's scale forgives rounding of its largest terms in an entry that
    cancels (safe_normalize's: 0 for 3e-5 beside 726), not an error of 1e-4 of
    it (planted)."""
    ref = np.array([-316.72116, 726.51013, 3.006135e-05], np.float32)
    rounded, wrong = ref.copy(), ref.copy()
    rounded[2], wrong[2] = 0.0, 0.08
    np.testing.assert_allclose(rounded, ref, rtol=1e-5, atol=_leaf_atol(ref))
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(wrong, ref, rtol=1e-5, atol=_leaf_atol(ref))


# The low-precision columns run with the slow tier (as the matrix's do).
@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(jnp.bfloat16, marks=pytest.mark.slow),
        pytest.param(jnp.float16, marks=pytest.mark.slow),
        jnp.float32,
    ],
)
@pytest.mark.parametrize("entry,index", CASES)
def test_entry_keeps_dtype(entry, index, dtype):
    """Value and gradient keep the input dtype: bf16 stays bf16."""
    rule = _cast(_example(entry, index), dtype)
    x = rule.input_domain().sample(jax.random.key(1), dtype, off_kinks=False)
    kwargs = rule.call_kwargs(KEY)

    @eqx.filter_jit
    def value_and_grads(rule, x):
        def loss(rule_and_x):
            out = call(rule_and_x[0], rule_and_x[1], **kwargs)
            return sum(jnp.sum(o.astype(jnp.float32)) for o in jtu.tree_leaves(out))

        return call(rule, x, **kwargs), eqx.filter_grad(loss)((rule, x))

    out, (g_rule, g_x) = value_and_grads(rule, x)
    for o in jtu.tree_leaves(out):
        if eqx.is_inexact_array(o):
            assert o.dtype == dtype, entry.name
    for g in jtu.tree_leaves(g_x):  # every floating-point input's (not a mask's)
        assert g.dtype == dtype
    for g in jtu.tree_leaves(eqx.filter(g_rule, eqx.is_inexact_array)):
        assert g.dtype == dtype


@pytest.mark.parametrize(
    "entry", [e for e in ENTRIES if e.elementwise], ids=lambda e: e.name
)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_elementwise_entry_rejects_integer_input(entry, dtype):
    rule = _example(entry, 0)
    with pytest.raises(TypeError, match=f"`{entry.name}`.*floating-point"):
        rule(jnp.zeros(rule.input_domain().shape, dtype), **rule.call_kwargs(KEY))


@pytest.mark.parametrize(
    "entry", [e for e in ENTRIES if not e.forward_mode], ids=lambda e: e.name
)
@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "vmap_jacfwd"])
def test_reverse_only_entry_names_itself_under_forward_mode(entry, transform):
    rule = _example(entry, 0)
    kwargs = rule.call_kwargs(KEY)
    x = rule.input_domain().sample(jax.random.key(1))

    def f(x):
        return sum(jnp.sum(o) for o in jtu.tree_leaves(rule(x, **kwargs)))

    run = {
        "jvp": lambda: jax.jvp(f, (x,), (x,)),
        "jacfwd": lambda: jax.jacfwd(f)(x),
        "vmap_jacfwd": lambda: jax.vmap(jax.jacfwd(f))(jnp.stack([x, x])),
    }[transform]
    with pytest.raises(TypeError, match=f"`{entry.name}` supports reverse mode only"):
        run()


@pytest.mark.first_case_quick
@pytest.mark.parametrize(
    "entry", [e for e in ENTRIES if not e.forward_mode], ids=lambda e: e.name
)
def test_reverse_only_entry_hessian_is_reverse_over_reverse(entry):
    """`hessian` (forward over reverse) differentiates the rule's backward pass with
    plain autodiff, as `jacrev∘jacrev` does: the two must agree, and neither may
    raise (no tracer inspection, so this holds on every JAX version)."""
    rule = _example(entry, 0)
    kwargs = rule.call_kwargs(KEY)
    x = rule.input_domain().sample(jax.random.key(1))

    def f(x):
        return sum(jnp.sum(jnp.sin(o) * o) for o in jtu.tree_leaves(rule(x, **kwargs)))

    np.testing.assert_allclose(
        jax.hessian(f)(x), jax.jacrev(jax.jacrev(f))(x), rtol=1e-5, atol=1e-6
    )


# Exact values, and masks that select -------------------------------------------

ELEMENTWISE_CASES = example_cases([e for e in ENTRIES if e.elementwise])


def _value_mismatches(rule, dtype) -> int:
    """How many of the 65,536 bit patterns of `dtype` get a value more than one ulp
    (relative) from `reference_forward`'s; NaN must meet NaN."""
    x = jnp.asarray(np.arange(2**16, dtype=np.uint16).view(dtype))
    kw = rule.call_kwargs(KEY)
    a = np.asarray(jax.jit(lambda x: rule(x, **kw))(x), np.float32)
    b = np.asarray(jax.jit(lambda x: rule.reference_forward(x, **kw))(x), np.float32)
    eps = float(jnp.finfo(dtype).eps)
    with np.errstate(invalid="ignore"):
        ok = (a == b) | (np.abs(a - b) <= eps * np.abs(b)) | (np.isnan(a) & np.isnan(b))
    return int(np.sum(~ok))


@pytest.mark.catalogue_wide
@pytest.mark.first_entry_quick
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("entry,index", ELEMENTWISE_CASES)
def test_elementwise_value_matches_reference_on_every_bit_pattern(entry, index, dtype):
    """Exhaustively, over every bfloat16 and float16 input (NaN, inf, subnormals and
    every boundary included), not only at the kinks: where rounding onto a grid goes
    wrong (the 0.1.0 grid formula put 13,056 negative bfloat16 inputs on +1/255)."""
    assert _value_mismatches(_example(entry, index), dtype) == 0


class _OldGrid(eqxrules.SteQuantize):
    """The planted defect: the 0.1.0 grid formula, `x - lo` first."""

    def primal(self, x):
        n = 2**self.bits - 1
        w = x.astype(jnp.float32)
        k = jnp.round(
            (jnp.clip(w, self.lo, self.hi) - self.lo) * (n / (self.hi - self.lo))
        )
        return (self.lo + (self.hi - self.lo) * (k / n)).astype(x.dtype)


def test_the_bit_pattern_check_catches_the_old_grid_formula():
    assert _value_mismatches(_OldGrid(), jnp.bfloat16) > 10_000


# Where a derivative is 0 it stays exactly 0 beside non-finite values (masks select,
# never multiply): tests/test_nonfinite.py.


class _SlopeOnly(eqxrules.JVPRule):
    """The planted defect: a `JVPRule` giving its derivative as `slope`, which only
    `ElementwiseRule` reads (0.2.0 raised an empty `NotImplementedError` at call)."""

    def primal(self, x):
        return jnp.sign(x)

    def slope(self, x):
        return jnp.abs(x) <= 1


def test_a_slope_without_elementwise_rule_is_named():
    with pytest.raises(NotImplementedError, match="`_SlopeOnly` defines no `tangent`"):
        jax.grad(lambda x: _SlopeOnly()(x).sum())(jnp.ones(3))
    with pytest.raises(NotImplementedError, match="subclass it instead"):
        jax.jvp(_SlopeOnly(), (jnp.ones(3),), (jnp.ones(3),))
    assert any("`ElementwiseRule`" in m for m in missing_parts(_SlopeOnly))


class _Slope(eqxrules.ElementwiseRule):
    r"""$q = \operatorname{sign}(x)$, $\dot q = t\,[|x| \le 1]$: a rule of one's
    own on the public base, its derivative given by `slope` alone."""

    summary: ClassVar[str] = "sign(x); derivative `t·[|x| <= 1]`"

    def primal(self, x):
        return jnp.sign(x) + (x == 0)

    def slope(self, x):
        return jnp.abs(x) <= 1

    def reference_forward(self, x):
        return jnp.where(x < 0, -1.0, 1.0).astype(x.dtype)

    def reference_derivative(self, x):
        return jnp.where(jnp.abs(x) <= 1, x, 0.0)


def test_elementwise_rule_is_a_public_base_whose_slope_is_the_derivative():
    assert missing_parts(_Slope) == ["registration (define it in `eqxrules._rules`)"]
    g = jax.grad(lambda x: _Slope()(x).sum())(jnp.array([-2.0, -1.0, 0.5, 3.0]))
    np.testing.assert_array_equal(g, [0.0, 1.0, 1.0, 0.0])
