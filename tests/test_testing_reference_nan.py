"""`check_rule(..., where_reference_nan="any")`: where a reference is NaN the rule
is not judged, where it is finite the rule must be finite and match (what
`verify_rule` asks at its degenerate slices); and a closed-over PRNG key no
longer stops a compiled program from being reused, nor makes one be reused for
another key."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxrules.testing import RuleCheckError, _programs, check_rule

X = jnp.array([jnp.inf, 1.0, -2.0, 0.5])


def _rule(slope):
    """Identity value, derivative `t · slope(x)`."""

    @jax.custom_jvp
    def f(x):
        return x

    f.defjvp(lambda p, t: (p[0], t[0] * slope(p[0])))
    return f


def _reference(x):
    # The derivative exp(-x^2) · 0 · x: 0 everywhere, NaN at inf (0 · inf).
    return x + 0.0 * x * jnp.exp(-(x**2))


def test_finite_where_the_reference_is_nan_is_unchecked_with_any():
    # At inf the reference's derivative is NaN; the rule gives the limit, 1.
    rule = _rule(lambda x: jnp.ones_like(x))
    with pytest.raises(RuleCheckError, match="finite where the reference is NaN"):
        check_rule(rule, X, forward=lambda x: x, derivative=_reference)
    report = check_rule(
        rule, X, forward=lambda x: x, derivative=_reference, where_reference_nan="any"
    )
    assert report.passed


def test_nan_where_the_reference_is_finite_still_fails_with_any():
    # Planted: the slope is NaN at inf where the reference's is finite (1).
    rule = _rule(lambda x: jnp.where(jnp.abs(x) < 10, 1.0, 0.0 * x))
    with pytest.raises(RuleCheckError) as e:
        check_rule(rule, X, derivative=lambda x: x, where_reference_nan="any")
    assert "NaN where the reference is finite" in e.value.report["jvp"].detail
    # And a finite value that differs from a finite reference still fails.
    wrong = _rule(lambda x: 2.0 * jnp.ones_like(x))
    with pytest.raises(RuleCheckError, match="beyond tolerance"):
        check_rule(wrong, X, derivative=_reference, where_reference_nan="any")


@pytest.mark.slow
def test_a_zero_cotangent_may_give_nan_only_where_the_reference_does():
    # cbrt's derivative is inf at 0: 0 · inf = NaN for rule and reference alike.
    @jax.custom_jvp
    def cbrt(x):
        return jnp.cbrt(x)

    cbrt.defjvp(lambda p, t: (jnp.cbrt(p[0]), t[0] / (3 * jnp.cbrt(p[0]) ** 2)))
    x = jnp.array([0.0, 1.0, -8.0])
    default = check_rule(cbrt, x, derivative=jnp.cbrt, raise_on_failure=False)
    # (`transpose`'s two inner products are infinite: it compared nothing.)
    assert default.failed == ["transpose", "zero_cotangent"]
    report = check_rule(
        cbrt, x, derivative=jnp.cbrt, where_reference_nan="any", skip=("transpose",)
    )
    assert report["zero_cotangent"].status == "passed"
    # Planted: NaN from a zero cotangent where the reference's is 0.
    nan_at_zero = _rule(lambda x: 1.0 / jnp.where(x == 0, 0.0, 1.0) * 0.0 + 1.0)
    with pytest.raises(RuleCheckError) as e:
        check_rule(nan_at_zero, x, derivative=lambda x: x, where_reference_nan="any")
    assert "zero_cotangent" in e.value.report.failed


def test_bad_where_reference_nan():
    with pytest.raises(TypeError, match=r"`where_reference_nan` must be a str"):
        check_rule(jnp.sin, X, where_reference_nan=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`where_reference_nan` \(='all'\)"):
        check_rule(jnp.sin, X, where_reference_nan="all")


def _keyed(key):
    """A stochastic rule closing over a typed PRNG key."""

    @jax.custom_jvp
    def f(x):
        return x + jax.random.uniform(key, x.shape)

    f.defjvp(lambda p, t: (f(p[0]), t[0]))
    return f


def _forward(key):
    noise = np.asarray(jax.random.uniform(key, (4,)))  # eager, on the host
    return lambda x: x + noise


@pytest.mark.slow
def test_a_closed_over_key_is_part_of_the_program(monkeypatch):
    x = jnp.array([0.5, -1.0, 2.0, 0.25])
    k1, k2 = jax.random.key(1), jax.random.key(2)
    monkeypatch.setattr(_programs, "_cache", collections.OrderedDict())
    check_rule(_keyed(k1), x, forward=_forward(k1), derivative=lambda x: x)
    # The rule's programs, the key among their constants, are kept for reuse (0.3
    # kept none: it could not read a key's bits, so compiled them at every call).
    kept = [str(jaxpr) for _, jaxpr in _programs._cache.values()]
    assert any("key<" in text for text in kept), kept
    # Another key: another program, whose value is checked afresh.
    check_rule(_keyed(k2), x, forward=_forward(k2), derivative=lambda x: x)
    # Planted: a digest blind to the key's bits reuses k2's program for key 3.
    digest = _programs._digest

    def blind(c):
        if jax.dtypes.issubdtype(getattr(c, "dtype", None), jax.dtypes.prng_key):
            return ("key", str(c.dtype))
        return digest(c)

    monkeypatch.setattr(_programs, "_digest", blind)
    k3 = jax.random.key(3)
    # (No `forward`: its constants, key 3's noise, would tell the programs apart.)
    check_rule(_keyed(k2), x, checks=("jit",))
    with pytest.raises(RuleCheckError, match="check `jit` failed"):
        check_rule(_keyed(k3), x, checks=("jit",))
