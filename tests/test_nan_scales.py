"""A NaN reaches every scale it enters, however large the tensor: XLA's CPU
reductions drop a NaN from a `max` of 4096 elements or more (found under issue
40), so a scale taken as `jnp.max(|x|)` missed it and a NaN spoiled one element
where the quantisers' statement makes the whole tensor (a per-tensor scale:
`FloatQuantize(scale="amax")`, `NVFP4Quantize`) or the whole block (`MXQuantize`)
NaN. Each value and reference here, eager and jitted, on 8192 elements; planted
beside it: the scale as a plain `jnp.max`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import eqxrules
from eqxrules import recipes
from eqxrules._rules import blocks, floats, nvfp4

X = jnp.ones((128, 64)).at[5, 7].set(jnp.nan)  # 8192 elements, one NaN
CASES = {
    # (quantiser, the NaNs its statement gives)
    "float_quantize amax": (eqxrules.FloatQuantize(scale="amax"), X.size),
    "nvfp4_quantize": (eqxrules.NVFP4Quantize(), X.size),
    "mx_quantize": (eqxrules.MXQuantize(block_size=32), 32),
}


def _nans(f, x=X) -> list[int]:
    return [int(jnp.isnan(g(x)).sum()) for g in (f, jax.jit(f))]


@pytest.mark.first_case_quick
@pytest.mark.parametrize("name", list(CASES))
def test_a_nan_reaches_every_scale_it_enters(name):
    q, want = CASES[name]
    assert _nans(q) == [want, want]
    assert _nans(q.reference_forward) == [want, want]


SPANNING = {
    "float_quantize amax": eqxrules.FloatQuantize(scale="amax", axis_name="b"),
    "nvfp4_quantize": eqxrules.NVFP4Quantize(axis_name="b"),
}


@pytest.mark.parametrize("name", list(SPANNING))
def test_a_nan_in_one_example_reaches_every_examples_scale(name):
    """A per-tensor scale spanning a named `vmap` (`axis_name`): a NaN in one
    example's 8192 elements makes every example's output NaN."""
    xs = jnp.stack([jnp.ones_like(X), X, jnp.ones_like(X)])
    q = SPANNING[name]
    for f in (jax.vmap(q, axis_name="b"), jax.jit(jax.vmap(q, axis_name="b"))):
        assert bool(jnp.isnan(f(xs)).all()), name


def test_a_nan_in_x_spoils_every_output_of_an_fp8_product():
    w = jnp.ones((64, 32))
    y = jax.jit(lambda x: eqxrules.quantized_dot(x, w, recipe=recipes.fp8()))(X)
    assert bool(jnp.isnan(y).all())


@pytest.mark.slow  # the quick tier's 4 minutes
def test_planted_plain_max_is_caught(monkeypatch):
    """On the CPU, whose `max` drops the NaN (a GPU's keeps it: there a plain
    `jnp.max` is no defect, and the plant runs on the CPU all the same, which
    every JAX has)."""
    cpu = jax.devices("cpu")[0]

    def plain(v, axis=None, keepdims=False):
        return jnp.max(jnp.abs(v), axis=axis, keepdims=keepdims, initial=0.0)

    def plain_peak(b, within):
        top = plain(b, axis=within, keepdims=True)
        return top, jnp.isfinite(top)

    monkeypatch.setattr(floats, "amax", plain)
    monkeypatch.setattr(blocks, "_block_peak", plain_peak)
    monkeypatch.setattr(nvfp4, "amax", plain)
    # A fresh instance of each: its jitted call traced again with the patch.
    with jax.default_device(cpu):
        x = jax.device_put(X, cpu)
        missed = [
            name
            for name, (q, want) in CASES.items()
            if _nans(lambda x, q=q: q(x + 0.0), x) != [want, want]
        ]
        xs = jnp.stack([jnp.ones_like(x), x])
        spanned = [
            name
            for name, q in SPANNING.items()
            if bool(
                jnp.isnan(jax.vmap(lambda x, q=q: q(x + 0.0), axis_name="b")(xs)).all()
            )
        ]
    assert missed == list(CASES), missed
    assert spanned == [], spanned
