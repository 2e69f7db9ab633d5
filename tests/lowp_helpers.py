"""What the low-precision tests share: the explicit reference for `quantized_dot`'s
three products, the data they run on, and the bound a float32 product is held to.

The reference follows the statement of issue 19, not the implementation: each
operand is quantised by its public quantiser (`eqxrules.mx_quantize`, ...) with its
`axis` set to the dimension the product reduces, after the random Hadamard rotation
written from its definition ($H_{ij} = (-1)^{\\operatorname{popcount}(i \\wedge j)}$,
signs drawn from the key as `quantized_dot` documents); the product is then taken in
float64, where each product of two float32 values is exact.

A float32 dot product of length $K$ differs from the exact one by at most
$\\gamma_K \\sum_k \\lvert a_k b_k \\rvert$, $\\gamma_K = K u / (1 - K u)$,
$u = 2^{-24}$ (Higham, *Accuracy and Stability of Numerical Algorithms*, 3.1),
whatever the order of summation: that, plus the float64 sum's own error, is the
tolerance. It is a proof, not a tuning: any different quantised operand moves a
product far beyond it.
"""

from __future__ import annotations

import dataclasses
import functools as ft
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import eqxrules
from eqxrules import recipes

U32, U64 = 2.0**-24, 2.0**-53
F32 = jnp.float32


def gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def two_orders(magnitudes: Any, n: int) -> np.ndarray:
    """Per output, how far two float32 sums of the same exact terms, in different
    orders, may be apart: 2·gamma_n·S, S the sum of the terms' magnitudes, from
    `magnitudes` (the same product of |operands|, itself within gamma_n of S),
    and the output scale's rounding on each side: 3·gamma_n of `magnitudes`.
    `n` is at least each output's number of terms."""
    return 3 * gamma(n, U32) * np.abs(np.asarray(magnitudes, np.float64))


def along(q: Any, axis: int) -> Any:
    """The public quantiser `q` with its blocks along `axis` (an elementwise one, or
    one with square blocks, as it is)."""
    if q is None or not hasattr(q, "axis") or isinstance(q.axis, tuple):
        return q  # elementwise, or square blocks over both axes of a matrix
    return dataclasses.replace(q, axis=axis)


def sylvester(n: int) -> np.ndarray:
    i = np.arange(n)
    bits = np.vectorize(lambda v: bin(v).count("1"))(i[:, None] & i[None, :])
    return np.where(bits % 2, -1.0, 1.0).astype(np.float32)


def rotate(a: jax.Array, axis: int, signs: jax.Array) -> jax.Array:
    """$R^\\top v = H (s \\odot v) / \\sqrt{n}$ on each block of `n` along `axis`."""
    n = signs.shape[0]
    moved = jnp.moveaxis(a, axis, -1)
    blocks = moved.reshape(*moved.shape[:-1], -1, n) * signs
    out = jnp.matmul(blocks, sylvester(n), precision=jax.lax.Precision.HIGHEST)
    return jnp.moveaxis(
        (out / np.sqrt(n).astype(np.float32)).reshape(moved.shape), -1, axis
    )


def operands(product: recipes.Product, a, a_axis, b, b_axis, key):
    """The two quantised operands of one product, as the statement says."""
    k_a = k_b = None
    if key is not None:
        k_a, k_b, k_signs = jax.random.split(key, 3)
        if product.hadamard is not None:
            signs = jax.random.rademacher(k_signs, (product.hadamard,), F32)
            a, b = rotate(a, a_axis, signs), rotate(b, b_axis, signs)
    qa = a if product.lhs is None else along(product.lhs, a_axis)(a, key=k_a)
    qb = b if product.rhs is None else along(product.rhs, b_axis)(b, key=k_b)
    return qa, qb


def exact(qa, a_axis, qb, b_axis):
    """The product in float64 and its float32 tolerance."""
    a = np.moveaxis(np.asarray(qa, np.float64), a_axis, -1)
    b = np.moveaxis(np.asarray(qb, np.float64), b_axis, 0)
    k = a.shape[-1]
    with np.errstate(invalid="ignore"):
        value = a @ b
        scale = np.abs(a) @ np.abs(b)
    return value, (gamma(k, U32) + gamma(k, U64)) * scale


@ft.partial(jax.jit, static_argnums=0)
def quantised_operands(recipe: recipes.Recipe, x, w, dy, key=None):
    """`{"y": (qa, qb), "dx": ..., "dw": ...}`: each product's quantised operands,
    as stored (`y = qa·qb` reduced along K, `dx` along N, `dw` along M)."""
    p = recipe.products()
    k = x.shape[-1]
    x2 = jnp.asarray(x, F32).reshape(-1, k)
    dy2 = jnp.asarray(dy, F32).reshape(-1, w.shape[1])
    w = jnp.asarray(w, F32)
    keys = [None] * 3 if key is None else list(jax.random.split(key, 3))
    return {
        name: operands(spec, a, a_axis, b, b_axis, kk)
        for name, spec, a, a_axis, b, b_axis, kk in (
            ("y", p.fwd, x2, 1, w, 0, keys[0]),
            ("dx", p.dx, dy2, 1, w, 1, keys[1]),
            ("dw", p.dw, x2, 0, dy2, 0, keys[2]),
        )
    }


AXES = {"y": (1, 0), "dx": (1, 1), "dw": (0, 0)}


def reference(recipe: recipes.Recipe, x, w, dy, key=None):
    """`{"y": (value, bound), "dx": ..., "dw": ...}` for `quantized_dot(x, w)` with
    cotangent `dy`."""
    ops = quantised_operands(recipe, x, w, dy, key)
    return {n: exact(qa, AXES[n][0], qb, AXES[n][1]) for n, (qa, qb) in ops.items()}


def mismatches(actual, value, bound) -> int:
    """How many elements of `actual` are further from `value` than `bound` allows
    (a NaN must be matched by a NaN)."""
    actual = np.asarray(actual, np.float64).reshape(value.shape)
    nan = np.isnan(value)
    with np.errstate(invalid="ignore"):
        far = np.abs(actual - value) > bound
    return int(np.sum(np.where(nan, ~np.isnan(actual), far | np.isnan(actual))))


def _vjp(recipe, x, w, dy, key):
    y, pull = jax.vjp(
        lambda x, w: eqxrules.quantized_dot(x, w, recipe=recipe, key=key), x, w
    )
    return (y, *pull(dy))


_vjp_jit = jax.jit(_vjp, static_argnums=0)


def vjp(recipe, x, w, dy, key=None, *, jit=False):
    """`(y, dx, dw)` of `quantized_dot` with cotangent `dy`, eager or jitted (one
    compiled program per recipe and shapes)."""
    return (_vjp_jit if jit else _vjp)(recipe, x, w, dy, key)


def data(kind: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Test data: `random` (normal), `zeros`, `nan` (random, one NaN), `pow2` (random
    below 1, and ±4 on every 16th diagonal, so every block along either axis has its
    largest magnitude exactly 4), `below_pow2` (the same with the largest value one
    float32 ulp below 4) or `nonfinite` (random, a NaN, a +inf and a -inf: the
    4th element, the middle one and the 5th from the end, in row-major order)."""
    rng = np.random.default_rng(seed)
    if kind == "zeros":
        return np.zeros(shape, np.float32)
    a = rng.standard_normal(shape).astype(np.float32)
    if kind == "nan":
        a.reshape(-1)[3] = np.nan
    elif kind == "nonfinite":
        n = a.size
        a.reshape(-1)[[3, n // 2, n - 5]] = [np.nan, np.inf, -np.inf]
    elif kind in ("pow2", "below_pow2"):
        a = np.clip(a / 4, -0.99, 0.99).astype(np.float32)
        top = np.float32(4.0) if kind == "pow2" else np.nextafter(np.float32(4), 0)
        m = a.reshape(-1, shape[-1])
        i, j = np.indices(m.shape)
        hit = (i + j) % 16 == 0
        m[hit] = np.where(rng.random(hit.sum()) < 0.5, -top, top)
    return a


def product_bounds(qa, a_axis, qb, b_axis):
    """`(lo, hi)`, float32: every value a float32 product of operands drawn between
    the two neighbours given (`qa = (La, Ua)`, `qb = (Lb, Ub)`, elementwise) can
    take: the sum's extremes term by term, widened by Higham's float32 bound on
    the summation and rounded outwards to float32."""
    a = [np.moveaxis(np.asarray(v, np.float64), a_axis, -1) for v in qa]
    b = [np.moveaxis(np.asarray(v, np.float64), b_axis, 0) for v in qb]
    # Each term a_k b_k at its four corners.
    terms = np.stack([ai[:, :, None] * bj[None, :, :] for ai in a for bj in b])
    k = terms.shape[2]
    error = (gamma(k, U32) + gamma(k, U64)) * np.abs(terms).max(0).sum(1)
    lo, hi = terms.min(0).sum(1) - error, terms.max(0).sum(1) + error
    lo32, hi32 = lo.astype(np.float32), hi.astype(np.float32)
    lo32 = np.where(lo32 > lo, np.nextafter(lo32, np.float32(-np.inf)), lo32)
    hi32 = np.where(hi32 < hi, np.nextafter(hi32, np.float32(np.inf)), hi32)
    return lo32, hi32
