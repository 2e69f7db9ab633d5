"""Tangent spaces and scaled cotangents (issue 39 §1), each with a planted defect
beside its correct twin:

- tangents were always dense and non-symmetric, so a matrix function on the
  symmetric positive definite matrices (a `sqrtm` by eigendecomposition) was
  checked along directions its input never moves in, and the correct rule and a
  wrong one got identical verdicts;
- cotangents were always standard normal, so a gradient clipped at
  `max_norm = 100` never clipped, and a wrong threshold passed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import eqxrules
from eqxrules.testing import RuleCheckError, check_rule


def _symmetric(t):
    return (t + t.T) / 2


def _sqrtm(transposed_solve: bool):
    """`sqrtm` of an SPD matrix by `eigh`, its VJP the solution `X` of the Sylvester
    equation `S X + X S = C` in the eigenbasis. Planted: `transposed_solve`
    divides by the wrong pair of eigenvalues' root sums (`X` transposed)."""

    @jax.custom_vjp
    def sqrtm(a):
        w, v = jnp.linalg.eigh(a)
        return (v * jnp.sqrt(w)) @ v.T

    def fwd(a):
        w, v = jnp.linalg.eigh(a)
        return sqrtm(a), (w, v)

    def bwd(res, ct):
        w, v = res
        r = jnp.sqrt(w)
        c = v.T @ ct @ v
        x = c / (r[:, None] + r[None, :])
        if transposed_solve:
            x = x * (r[:, None] / r[None, :])  # right only where they are equal
        return (v @ x @ v.T,)

    sqrtm.defvjp(fwd, bwd)
    return sqrtm


def _reference(a):
    w, v = jnp.linalg.eigh(_symmetric(a))
    return (v * jnp.sqrt(w)) @ v.T


# Eigenvalues 0.5, 1.25 and 2: a derivative through `eigh` divides by their
# differences, and in float32 is within the default tolerance when they are apart.
_Q, _ = jnp.linalg.qr(jax.random.normal(jax.random.key(0), (3, 3)))
A = _symmetric((_Q * jnp.array([0.5, 1.25, 2.0])) @ _Q.T)


@pytest.mark.slow  # the quick tier's 4 minutes
def test_a_matrix_function_on_spd_inputs_is_checked_along_symmetric_tangents():
    kw = dict(forward=_reference, derivative=_reference, tangent_space=_symmetric)
    report = check_rule(_sqrtm(False), A, **kw)
    assert report.passed and report["vjp"].status == "passed"
    with pytest.raises(RuleCheckError) as e:
        check_rule(_sqrtm(True), A, **kw)
    assert "vjp" in e.value.failed
    # Without the tangent space the correct rule fails too (its cotangent of a
    # dense, non-symmetric direction is defined only up to the antisymmetric
    # part): the two are not told apart.
    dense = check_rule(_sqrtm(False), A, forward=_reference, derivative=_reference,
                       raise_on_failure=False)  # fmt: skip
    assert "vjp" in dense.failed


def _clip_norm(max_norm: float, clips_at: float, to: float | None = None):
    """The identity, its cotangent rescaled to norm `to` (default `max_norm`)
    where its norm exceeds `clips_at` (planted: `clips_at` or `to` other than
    `max_norm`)."""

    @jax.custom_vjp
    def f(x):
        return x

    def bwd(_, ct):
        norm = jnp.linalg.norm(ct)
        target = max_norm if to is None else to
        return (jnp.where(norm > clips_at, ct * target / norm, ct),)

    f.defvjp(lambda x: (x, None), bwd)
    return f


def _reference_vjp(max_norm: float):
    def reference(ct, x):
        return (ct * jnp.minimum(1.0, max_norm / jnp.linalg.norm(ct)),)

    return reference


X12 = jnp.linspace(-1.0, 1.0, 12)  # its random cotangents have norm about 3.5


def test_scaled_cotangents_reach_a_clipping_level():
    kw = dict(reference_vjp=_reference_vjp(100.0), checks=("vjp",))
    check_rule(_clip_norm(100.0, 100.0), X12, **kw)
    # Planted: clipped to twice the level. 0.3's standard-normal cotangent never
    # reached the level at all, so it passed; times 1e3 it is caught.
    wrong = _clip_norm(100.0, 100.0, to=200.0)
    check_rule(wrong, X12, **kw, cotangent_scales=(1.0,))
    with pytest.raises(RuleCheckError) as e:
        check_rule(wrong, X12, **kw)
    assert "with the cotangent times 1000" in e.value.report["vjp"].detail


def test_a_threshold_in_the_wrong_place_is_seen_from_either_side():
    """Planted: the norm compared with 1.2x the level. Times 1e3 both clip (at
    different norms, to the same one); only a cotangent between the two, as
    `cotangent_thresholds` (from a rule's `cotangent_thresholds()` in `verify`)
    asks, tells them apart."""
    kw = dict(reference_vjp=_reference_vjp(100.0), checks=("vjp",))
    check_rule(_clip_norm(100.0, 120.0), X12, **kw)
    with pytest.raises(RuleCheckError):
        check_rule(_clip_norm(100.0, 120.0), X12, **kw, cotangent_thresholds=(100.0,))
    check_rule(_clip_norm(100.0, 100.0), X12, **kw, cotangent_thresholds=(100.0,))


def test_an_elementwise_threshold_is_crossed_on_both_sides():
    """Planted: a cotangent clipped at 6e4 instead of 5e4, beyond what 1e3 times
    a standard normal reaches."""

    def clip(at):
        @jax.custom_vjp
        def f(x):
            return x

        f.defvjp(lambda x: (x, None), lambda _, ct: (jnp.clip(ct, -0.3, at),))
        return f

    def reference(ct, x):
        return (jnp.minimum(jnp.maximum(ct, -0.3), 5e4),)

    kw = dict(reference_vjp=reference, checks=("vjp",))
    check_rule(clip(5e4), X12, **kw, cotangent_thresholds=(-0.3, 5e4))
    check_rule(clip(6e4), X12, **kw)
    with pytest.raises(RuleCheckError):
        check_rule(clip(6e4), X12, **kw, cotangent_thresholds=(-0.3, 5e4))


def test_the_catalogues_clipping_rules_declare_their_thresholds():
    assert eqxrules.ClipGradientNorm(1e5).cotangent_thresholds() == (1e5,)
    assert eqxrules.ClipGradient(-0.3, 1.0).cotangent_thresholds() == (-0.3, 1.0)
    assert eqxrules.SteSign().cotangent_thresholds() == ()


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(cotangent_scales=2.0), TypeError, ["`cotangent_scales`", "float"]),
        (dict(cotangent_scales=("2",)), TypeError, ["`cotangent_scales`", "'2'"]),
        (dict(cotangent_scales=(0.0,)), ValueError, ["finite positive", "0.0"]),
        (dict(cotangent_scales=(jnp.inf,)), ValueError, ["finite positive"]),
        (dict(cotangent_thresholds=1.0), TypeError, ["`cotangent_thresholds`"]),
        (dict(cotangent_thresholds=1.0), TypeError, ["`cotangent_thresholds`"]),
        (dict(tangent_space=3), TypeError, ["`tangent_space`", "int"]),
        (dict(tangent_space=(None, None)), ValueError, ["2 projection(s)", "1 arg"]),
    ],
)
def test_bad_scales_or_spaces_are_clear_errors(kwargs, error, words):
    with pytest.raises(error) as e:
        check_rule(jnp.sin, jnp.ones(3), **kwargs)
    assert str(e.value).startswith("`check_rule`:")
    for word in words:
        assert word in str(e.value)
