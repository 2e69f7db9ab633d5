r"""The softmax derivative of `straight_through_onehot` and `gumbel_softmax`
(`categorical.softmax_tangent`) where one category dominates: accurate to its own
scale, so that two float32 evaluations summing in different orders (a GPU's batched
and single programs: `gumbel_softmax` failed the `batching` check on the H100 by
1.4e-6, `benchmarks/GPU.md`) agree within the checker's tolerance.

**The bound.** With $y = \operatorname{softmax}(z/\tau)$, the derivative's component
$i$ is $w_i = y_i \sum_j y_j (t_i - t_j) / \tau$; its scale is
$S_i = y_i \sum_j y_j |t_i - t_j| / \tau$. Evaluated as `softmax_tangent` does
($s = t - t_m$ for the largest $y_m$, then $y \odot (s - \langle y, s\rangle)$, then
the sum at $m$), with $y_m \ge 1/2$ (then $|t_i - t_m| \le 2 \sum_j y_j|t_i - t_j|$):
float32's softmax carries at most $(n + 3)u$ per $y_j$, the shift $u$, the sum
$\gamma_n$, the products and the last subtraction $u$ each, and the sum at $m$
$\gamma_n \sum_i |u_i| \le 4\gamma_n S_m$; together at most $(11n + 20)u\,S_i$
($u = 2^{-24}$), in each direction (the form is its own transpose). The plain
$y \odot (t - \langle y, t\rangle)$ has error of order $u\,y_m |t_m|$ at $m$, about
$|t_m| / (S_m (1 - y_m))$ times its scale's $u$: with $y_m$ above 0.999 it is far
outside the bound (the planted defect).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxrules
from eqxrules._rules import categorical

U = 2.0**-24
KEY = jax.random.key(5)


def _dominated(n: int, seed: int, axis: int) -> np.ndarray:
    """Logits, 8 rows of `n` categories along `axis`, each row with one category
    ahead of the others by 8 to 12 (its softmax weight above 0.999)."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((8, n))
    z[np.arange(8), rng.integers(0, n, 8)] += rng.uniform(8, 12, 8)
    z = z.astype(np.float32)
    return z if axis in (-1, 1) else np.ascontiguousarray(z.T)


def _cases():
    rules = [
        (
            "straight_through_onehot",
            lambda axis: (eqxrules.StraightThroughOneHot(axis), 1.0, None),
        ),
        (
            "gumbel_hard",
            lambda axis: (eqxrules.GumbelSoftmax(1.0, True, axis), 1.0, KEY),
        ),
        (
            "gumbel_soft",
            lambda axis: (eqxrules.GumbelSoftmax(0.5, False, axis), 0.5, KEY),
        ),
    ]
    return [
        pytest.param(make, axis, n, id=f"{name}-axis{axis}-n{n}")
        for name, make in rules
        for axis in (-1, 0)
        for n in (4, 33)
    ]


def _truth(z32: np.ndarray, t: np.ndarray, axis: int, tau: float):
    """`(w, S)`: the derivative in float64 from the float32 logits, and its scale."""
    z = z32.astype(np.float64) / tau
    y = np.exp(z - z.max(axis=axis, keepdims=True))
    y /= y.sum(axis=axis, keepdims=True)
    t = t.astype(np.float64)
    w = y * (t - np.sum(y * t, axis=axis, keepdims=True)) / tau
    # S_i = y_i sum_j y_j |t_i - t_j| / tau, the categories moved last.
    ym, tm = np.moveaxis(y, axis, -1), np.moveaxis(t, axis, -1)
    pairs = np.abs(tm[..., :, None] - tm[..., None, :])  # [..., i, j]
    scale = ym * np.sum(ym[..., None, :] * pairs, axis=-1) / tau
    return w, np.moveaxis(scale, -1, axis)


def _off(rule, tau, key, logits, t, ct) -> dict[str, float]:
    """Each direction's largest error over its bound, `(11n + 20) u S_i`."""
    axis = rule.axis
    n = logits.shape[axis]
    z32 = logits
    if key is not None:  # the rule's own perturbed logits, rounded once
        z32 = (logits + np.asarray(jax.random.gumbel(key, logits.shape))).astype(
            np.float32
        )
    call = (lambda x: rule(x, key=key)) if key is not None else rule
    jvp = np.asarray(jax.jit(lambda x, v: jax.jvp(call, (x,), (v,))[1])(logits, t))
    vjp = np.asarray(jax.jit(lambda x, c: jax.vjp(call, x)[1](c)[0])(logits, ct))
    bound = (11 * n + 20) * U
    out = {}
    for name, got, direction in (("jvp", jvp, t), ("vjp", vjp, ct)):
        w, scale = _truth(z32, direction, axis, tau)
        out[name] = float(np.max(np.abs(got - w) / (bound * scale)))
    return out


@pytest.mark.first_case_quick
@pytest.mark.parametrize("make, axis, n", _cases())
def test_softmax_derivative_is_accurate_where_one_category_dominates(make, axis, n):
    rule, tau, key = make(axis)
    rng = np.random.default_rng(n)
    logits = _dominated(n, n + 7, axis)
    t = rng.standard_normal(logits.shape).astype(np.float32) * 3
    ct = rng.standard_normal(logits.shape).astype(np.float32) * 3
    off = _off(rule, tau, key, logits, t, ct)
    assert off["jvp"] <= 1 and off["vjp"] <= 1, off


def _plain(z, t, axis, tau=1.0):
    """Planted: the plain form, y * (t - <y, t>), as the softmax's autodiff gives."""
    if t is None:
        return None
    y = jax.nn.softmax(z.astype(jnp.float32) / tau, axis=axis)
    dt = t.astype(jnp.float32)
    return (y * (dt - jnp.sum(y * dt, axis=axis, keepdims=True)) / tau).astype(t.dtype)


def test_planted_plain_softmax_derivative_fails_the_bound(monkeypatch):
    monkeypatch.setattr(categorical, "softmax_tangent", _plain)
    rng = np.random.default_rng(1)
    for rule, tau, key in (
        (eqxrules.StraightThroughOneHot(), 1.0, None),
        (eqxrules.GumbelSoftmax(0.5, False), 0.5, KEY),
    ):
        logits = _dominated(4, 11, -1)
        t = rng.standard_normal(logits.shape).astype(np.float32) * 3
        off = _off(rule, tau, key, logits, t, t)
        assert off["jvp"] > 1 and off["vjp"] > 1, off
