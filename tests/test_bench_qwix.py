"""The `qwix` benchmark section (issue 41 §5) without qwix: the suite never needs
the `bench` extra, so these tests check what the section computes on its own side
and how it reads and reports the comparison, each beside a planted defect:

- the MX scale rules of `block_causes`, against their definitions;
- `block_causes` telling the scale rule from other causes, on NumPy quantisers
  written from the formula, and eqxrules' own `mxfp8()` quantisation differing
  from qwix's rule by the scale rule alone;
- the Linen parameters the qwix side trains, the Equinox MLP's own;
- the eqxrules side: every layer quantised, the Adam step's loss and move;
- the report: its tables well formed, its goals met or missed as the figures say;
- without qwix, `python -m benchmarks` imports, and the section says what to
  install."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import eqxrules
from benchmarks import mxfp8_work as work, qwix_side, xla
from benchmarks.sections import qwix_mxfp8 as section
from eqxrules import recipes

ROOT = pathlib.Path(__file__).resolve().parent.parent
U = 2.0**-24  # float32's unit roundoff


# The scale rules --------------------------------------------------------------


def _amaxes() -> np.ndarray:
    """Every mantissa step of float32 between 1 and 2 that matters here (the
    boundaries 1.75 and 2 and their neighbours), over a range of exponents."""
    m = np.array([1.0, 1.5, 1.75, np.nextafter(1.75, 2.0), 1.8, 1.999, 2.0])
    return np.concatenate([m * 2.0**e for e in range(-20, 21)])


def _least_pow2_at_least(s: np.ndarray, r: np.ndarray) -> bool:
    """`s` is a power of two, at least `r`, and half of it is below `r`."""
    exact = np.exp2(np.round(np.log2(s))) == s
    return bool(np.all(exact & (s >= r) & (s / 2 < r)))


def test_ceil_scales_are_the_least_that_saturate_nothing():
    a = _amaxes()
    assert _least_pow2_at_least(work.block_scales(a, "ceil"), a / 448)
    # Planted: the OCP rule saturates some of these blocks.
    assert not _least_pow2_at_least(work.block_scales(a, "floor"), a / 448)


def test_floor_scales_are_the_ocp_rule():
    a = _amaxes()
    e = np.floor(np.log2(a))
    assert np.array_equal(work.block_scales(a, "floor"), np.exp2(e - 8))
    # The two rules differ exactly where the mantissa of amax is above 1.75.
    differ = work.block_scales(a, "floor") != work.block_scales(a, "ceil")
    assert np.array_equal(differ, a / np.exp2(e) > 1.75)
    with pytest.raises(ValueError, match="`rounding`"):
        work.block_scales(a, "nearest")


# Block by block ---------------------------------------------------------------


def _mx(v: np.ndarray, axis: int, rounding: str, to_format=None) -> np.ndarray:
    """MXFP8 (E4M3) from the formula, in NumPy: blocks of 32 along `axis`, the
    scale by `rounding`, each element `s * e4m3(clip(v / s, -448, 448))`."""
    moved = np.moveaxis(np.asarray(v, np.float64), axis, -1)
    b = moved.reshape(-1, 32)
    amax = np.max(np.abs(b), axis=1, keepdims=True)
    s = work.block_scales(np.where(amax > 0, amax, 1.0), rounding)
    cast = to_format or (lambda u: u.astype(ml_dtypes.float8_e4m3fn))
    q = s * cast(np.clip(b / s, -448, 448)).astype(np.float64)
    return np.moveaxis(q.reshape(moved.shape), -1, axis).astype(np.float32)


@pytest.fixture(scope="module")
def operands() -> dict[str, np.ndarray]:
    x, w, dy = work.product_problem((64, 64, 32))
    return dict(x=np.asarray(x), w=np.asarray(w), dy=np.asarray(dy))


def test_block_causes_tells_the_scale_rule_from_other_causes(operands):
    v = operands["x"]
    ceil = _mx(v, 1, "ceil")
    c = work.block_causes(v, _mx(v, 1, "floor"), ceil, 1, "floor")
    assert c["blocks"] == 128
    # Fixed data (seed 0): some blocks saturate under the OCP rule.
    assert 0 < c["differ"] <= c["rules_differ"] and c["unexplained"] == 0
    # The OCP rule clips a block's largest element by up to 1 - 1.75 / 2 = 12.5%;
    # rounding up to the E4M3 grid errs by at most half its step, 2^-4.
    assert 2**-4 < c["top_error_ours"] <= 0.125
    assert c["top_error_theirs"] <= 2**-4
    same = work.block_causes(v, ceil, ceil, 1, "ceil")
    assert same["differ"] == same["rules_differ"] == same["unexplained"] == 0
    # Planted: elements in another format (E5M2) differ where the rules agree.
    other = _mx(v, 1, "floor", lambda u: u.astype(ml_dtypes.float8_e5m2))
    assert work.block_causes(v, other, ceil, 1, "floor")["unexplained"] > 0
    # Planted: the OCP rule reported as rounding up: its differences unexplained.
    assert work.block_causes(v, _mx(v, 1, "floor"), ceil, 1, "ceil")["unexplained"]


@pytest.mark.slow
def test_mxfp8_differs_from_the_rounded_up_rule_by_its_scale_rule_alone(operands):
    """eqxrules' `mxfp8()` quantises each operand of each product as the formula
    does with its own scale rule: against qwix's rule (rounding up), every block
    that differs is one the two scale rules give different scales, whichever rule
    `mxfp8()` has."""

    def theirs(v, axis):
        return _mx(v, axis, "ceil")

    rows = section.blocks(recipes.mxfp8(), operands, theirs)
    assert len(rows) == len(section.OPERANDS)
    assert all(r["unexplained"] == 0 for r in rows), rows
    if work.scale_rounding(recipes.mxfp8()) == "ceil":
        assert all(r["differ"] == 0 for r in rows), rows
    # Planted: a recipe in E5M2, whose differences are not the scale rule's.
    e5m2 = recipes.MXFP8(format="e5m2", gradient_format="e5m2")
    assert any(r["unexplained"] for r in section.blocks(e5m2, operands, theirs))


# The qwix side's parameters ---------------------------------------------------


def _dense_matches(layer: eqx.nn.Linear, params: dict, x: jax.Array) -> bool:
    """Linen's `x @ kernel + bias` is the layer's value on each example, within
    float32's summation bound on both sides: `2 * k * u * (|x| @ |kernel| + |bias|)`."""
    kernel, bias = params["kernel"], params["bias"]
    if kernel.shape != (layer.in_features, layer.out_features):
        return False
    hi = jax.lax.Precision.HIGHEST
    linen = jnp.dot(x, kernel, precision=hi) + bias
    ours = jax.vmap(layer)(x)
    k = layer.in_features + 1
    bound = 2 * k * U * (jnp.dot(jnp.abs(x), jnp.abs(kernel), precision=hi) + abs(bias))
    return bool(jnp.all(jnp.abs(linen - ours) <= bound))


@pytest.mark.slow  # the quick tier's 4 minutes
def test_flax_params_are_the_equinox_mlps():
    mlp = eqx.nn.MLP(48, 32, 64, 2, key=jax.random.key(3))
    params = qwix_side.flax_params(mlp)["params"]
    x = jax.random.normal(jax.random.key(4), (8, 48))
    for i, layer in enumerate(mlp.layers):
        assert _dense_matches(layer, params[f"Dense_{i}"], x)
        x = jax.vmap(layer)(x)
    for a, b in zip(qwix_side.eqx_order({"params": params}), work.layer_arrays(mlp)):
        assert np.array_equal(a, b)
    # Planted: the weight untransposed, as Equinox stores it.
    square = eqx.nn.Linear(32, 32, key=jax.random.key(5))
    wrong = {"kernel": square.weight, "bias": square.bias}
    assert not _dense_matches(square, wrong, x[:, :32])


# The eqxrules side ------------------------------------------------------------


@pytest.mark.slow
def test_eqxrules_side_quantises_every_layer_and_steps():
    width, depth, batch = 64, 4, 32
    recipe = recipes.mxfp8()
    mlp = work.mlp(width, depth)
    model = eqxrules.quantize(mlp, recipe=recipe)
    assert work.quantised_layers(model, recipe) == depth
    # Planted: the last layer left in float32.
    partly = eqx.tree_at(lambda m: m.layers[-1], model, mlp.layers[-1])
    assert work.quantised_layers(partly, recipe) == depth - 1

    x, t = work.mlp_problem(width, batch)
    params, apply = work.split(model)
    loss = work.mse(apply)

    def moved(learning_rate: float) -> tuple[list[bool], float]:
        step, opt = work.adam_step(loss, learning_rate)
        figs = xla.figures(step, params, opt.init(params), x, t)
        new, _, value = figs["compiled"](params, opt.init(params), x, t)
        old = work.layer_arrays(params)
        return [
            not np.array_equal(a, b) for a, b in zip(work.layer_arrays(new), old)
        ], float(value)

    every, value = moved(1e-3)
    assert all(every)
    # The step's loss is the model's: the mean of batch * width squares, within
    # float32's summation bound (n u, relative) of another program's sum.
    expected = float(jax.jit(loss)(params, x, t))
    assert abs(value - expected) <= batch * width * U * expected
    # Planted: a step of rate 0 moves nothing.
    assert not any(moved(0.0)[0])


# The report -------------------------------------------------------------------


def _figures(flops: float, temp: int, ops: int) -> dict:
    return dict(flops=flops, bytes=1.0, temp=temp, ops=dict(transpose=ops, copy=ops))


def _row(numerics: list[str], wall: float) -> dict:
    return dict(
        figures=dict(
            eqxrules=_figures(1.03e9, 3 * 2**20, 6),
            qwix=_figures(1.0e9, 2 * 2**20, 0),
            float32=_figures(0.9e9, 0, 0),
        ),
        numerics=[
            dict(quantity=q, ours=4e-2, theirs=3e-2, between=2e-2, equal=False)
            for q in numerics
        ],
        wall=dict(median=wall, min=wall - 0.1, max=wall + 0.1, a_s=0.2, b_s=0.25),
        load=2.0,
    )


def _fake(mlp_wall: float) -> dict:
    product = _row(["value", "x gradient", "w gradient"], 0.77)
    product.update(
        shape=[256, 512, 256],
        residuals={
            k: dict(bytes=2**20, arrays=["256x512 float32 (argument)"])
            for k in ("eqxrules", "qwix", "float32")
        },
        blocks=[
            dict(
                operand=o,
                product=p,
                blocks=128,
                differ=20,
                rules_differ=25,
                unexplained=0,
                top_error_ours=0.125,
                top_error_theirs=0.06,
            )
            for o, p, _, _ in section.OPERANDS
        ],
    )
    mlp = _row(["loss", "gradient"], mlp_wall)
    mlp.update(sizes=[1024, 4, 256])
    return dict(
        versions=dict(qwix="0.1.8", flax="0.12.8"),
        rounding="floor",
        product=product,
        mlp=mlp,
        pairs=21,
        target_s=0.5,
    )


def _tables_well_formed(lines: list[str]) -> bool:
    """Every row of every markdown table has its header's number of cells."""
    cells = None
    for line in lines:
        if not line.startswith("|"):
            cells = None
        elif cells is None:
            cells = line.count("|")
        elif line.count("|") != cells:
            return False
    return True


def test_report_states_the_figures_and_the_goals():
    lines = section.render(_fake(mlp_wall=0.80), {})
    text = "\n".join(lines)
    assert _tables_well_formed(lines)
    assert "| MLP step, 4 x 1024, batch 256 | 1.03e+09 | 1e+09 | 1.0300 |" in text
    assert "| 6 / 0 | 6 / 0 |" in text
    assert "Of 768 blocks, 120 differ" in text and "0 differ where the rules" in text
    assert "0.800x, met" in text and "1.0300x, met" in text
    assert "rounds it down, by the OCP specification's rule" in text
    missed = "\n".join(section.render(_fake(mlp_wall=0.86), {}))
    assert "0.860x, **missed**" in missed
    # Planted: a table's first row with a cell too many.
    i = next(i for i, line in enumerate(lines) if line.startswith("| work |"))
    assert not _tables_well_formed([*lines[i : i + 2], lines[i + 2] + " x |"])
    assert section.render(None, {}) == []


# Without qwix ----------------------------------------------------------------


def _without_qwix(code: str) -> subprocess.CompletedProcess:
    # `None` in `sys.modules` makes an import fail as if the package were absent.
    prelude = "import sys; sys.modules['qwix'] = sys.modules['flax'] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code], capture_output=True, text=True, cwd=ROOT
    )


def _names_the_extra(run: subprocess.CompletedProcess) -> bool:
    last = (run.stderr.strip().splitlines() or [""])[-1]
    return (
        run.returncode == 1
        and last.startswith("ImportError: The `qwix` benchmark section")
        and qwix_side.EXTRA in last
    )


@pytest.mark.slow
def test_without_qwix_the_benchmarks_run_and_the_section_names_the_extra(tmp_path):
    assert _without_qwix("import benchmarks.cli").returncode == 0
    out = tmp_path / "RESULTS.md"
    argv = f"['--quick', '--only', 'qwix', '--out', {str(out)!r}]"
    run = _without_qwix(f"from benchmarks.cli import main; main({argv})")
    assert _names_the_extra(run), run.stderr
    # Planted: a bare `import qwix` says nothing of the extra.
    assert not _names_the_extra(_without_qwix("import qwix"))
