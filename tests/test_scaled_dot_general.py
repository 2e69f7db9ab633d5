r"""`quantized_dot_general` with `recipes.MXFP8(scale_rounding="ceil")` against JAX's
own MXFP8 product, `jax.nn.scaled_dot_general` (issue 41 §4), on the CPU.

`jax.nn.scaled_dot_general` lowers on the CPU from JAX 0.11 (checked at 0.11.0,
0.11.2 and 0.12.0.1; at 0.10.2 it raises `NotImplementedError: MLIR translation
rule for primitive 'scaled_matmul' not found for platform cpu`), which needs Python
3.12. So the comparisons are marked `newest`: `addopts` leaves them out, and
`.ci/run`'s Python 3.12 run, at the newest JAX, selects them (`-m "not slow"`;
checked here). Run at an older JAX they fail, saying why (`tests/conftest.py`):
they are never skipped.

**The bound.** Both sides quantise $x$ and $w$ in blocks of 32 along $K$, E4M3
elements times power-of-two scales, and multiply in float32. Each term $a_k b_k$ of
an output is then exact in float32 (two significands of 4 bits; the scales powers
of two, far from overflow and underflow on these data), so the only rounding of
either side is its float32 summation, at most $\gamma_K \sum_k |a_k b_k|$ whatever
its order (Higham, *Accuracy and Stability of Numerical Algorithms*, 3.1;
$\gamma_K = Ku/(1-Ku)$, $u = 2^{-24}$; applying the scales per block before or
after the sum changes nothing, as they are powers of two). Where both quantise
alike, the two outputs are within $2\gamma_K \sum_k |a_k b_k|$ of each other,
element by element, and each within $\gamma_K \sum_k |a_k b_k|$ (plus float64's
own, $\gamma_K$ at $u = 2^{-53}$) of the float64 product of the operands quantised
in NumPy by the rounded-up rule (`block_references.pow2`). With $K = 256$ that is
about $3\cdot10^{-5}$ of $\sum_k |a_k b_k|$. A block scaled by the other rule (the
OCP floor rule) moves its products by whole E4M3 steps, far beyond it: measured on
64x256 by 256x32, 0.8% to 4.7% of the largest output, where the bound is about
1e-4 of it (the planted defect, below). Measured too: ours and JAX's are equal bit
for bit there, at JAX 0.12.0.1.
"""

from __future__ import annotations

import pathlib
import shlex

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tomllib
from block_references import pow2
from lowp_helpers import U32, U64, gamma
from test_package import _marker_expression

import eqxrules
from eqxrules import recipes

DIMS = (((1,), (0,)), ((), ()))


def _theirs(x, w):
    configs = [jax.nn.get_scaled_dot_general_config("mxfp8")] * 3
    return jax.nn.scaled_dot_general(x, w, DIMS, configs=configs)


def _data(kind: str, shape: tuple[int, int], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    if kind == "heavy-tailed":  # magnitudes over many binades within each block
        x = x * np.exp2(np.round(4 * rng.standard_normal(shape)))
    return x.astype(np.float32)


def _case(kind: str, seed: int, m: int = 64, k: int = 256, n: int = 32):
    x, w = _data(kind, (m, k), seed), _data(kind, (k, n), seed + 100)
    qx = pow2(x, "e4m3", 32, 1, "ceil").astype(np.float64)
    qw = pow2(w, "e4m3", 32, 0, "ceil").astype(np.float64)
    magnitude = np.abs(qx) @ np.abs(qw)
    one_side = (gamma(k, U32) + gamma(k, U64)) * magnitude
    return x, w, qx @ qw, one_side, 2 * gamma(k, U32) * magnitude


def _ours(x, w, rounding: str) -> np.ndarray:
    recipe = recipes.MXFP8(scale_rounding=rounding)
    f = jax.jit(lambda a, b: eqxrules.quantized_dot_general(a, b, DIMS, recipe=recipe))
    return np.asarray(f(jnp.asarray(x), jnp.asarray(w)), np.float64)


def _far(actual, expected, bound) -> int:
    """How many elements of `actual` lie further than `bound` from `expected`."""
    return int(np.sum(np.abs(actual - expected) > bound))


CASES = [("normal", 0), ("normal", 1), ("heavy-tailed", 2)]


@pytest.mark.newest(jax="0.11")
@pytest.mark.parametrize("kind,seed", CASES)
def test_scaled_dot_general_is_the_rounded_up_rule(kind, seed):
    """JAX's MXFP8 product is the float32 product of operands quantised by the
    rounded-up scale rule, within float32 summation: what ours is compared with
    below is the rule, not an accident of JAX's."""
    x, w, exact, one_side, _ = _case(kind, seed)
    theirs = np.asarray(jax.jit(_theirs)(jnp.asarray(x), jnp.asarray(w)), np.float64)
    assert _far(theirs, exact, one_side) == 0


@pytest.mark.newest(jax="0.11")
@pytest.mark.parametrize("kind,seed", CASES)
def test_mxfp8_ceil_agrees_with_scaled_dot_general(kind, seed):
    x, w, exact, one_side, both = _case(kind, seed)
    theirs = np.asarray(jax.jit(_theirs)(jnp.asarray(x), jnp.asarray(w)), np.float64)
    ours = _ours(x, w, "ceil")
    assert _far(ours, exact, one_side) == 0
    assert _far(ours, theirs, both) == 0
    # The mxfp8() training recipe rounds its scales up: the same product.
    default = eqxrules.quantized_dot(
        jnp.asarray(x), jnp.asarray(w), recipe=recipes.mxfp8()
    )
    assert _far(np.asarray(default, np.float64), theirs, both) == 0


@pytest.mark.newest(jax="0.11")
def test_planted_floor_rule_disagrees_with_scaled_dot_general():
    """Planted: the OCP floor rule, `MXFP8(scale_rounding="floor")`, fails the
    check above on every case, by whole E4M3 steps: measured, most outputs (79 to
    91%) outside the bound, the largest difference 250 to 450 times it."""
    for kind, seed in CASES:
        x, w, _, _, both = _case(kind, seed)
        theirs = np.asarray(
            jax.jit(_theirs)(jnp.asarray(x), jnp.asarray(w)), np.float64
        )
        floor = _ours(x, w, "floor")
        assert _far(floor, theirs, both) > floor.size // 2
        assert np.max(np.abs(floor - theirs)) > 100 * np.max(both)


# -- the run that selects these ---------------------------------------------------

ROOT = pathlib.Path(__file__).resolve().parent.parent
OPTIONS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
    "ini_options"
]
MARKERS = [m.split(":")[0] for m in OPTIONS["markers"]]


def _selects(expression: str, **marks: bool) -> bool:
    """Whether a pytest `-m` expression selects a test carrying `marks` alone."""
    scope = dict.fromkeys(MARKERS, False) | marks
    return bool(eval(expression or "True", {"__builtins__": {}}, scope))


def _newest_lane(run: str) -> list[str]:
    """The `-m` expressions of `.ci/run`'s pytest runs in the newest-version
    environment (after `. .venv-newest/bin/activate`, up to its `deactivate`)."""
    default = _marker_expression(shlex.split(OPTIONS["addopts"]), "")
    lane = run[run.index(". .venv-newest/bin/activate") :]
    lane = lane[: lane.index("deactivate")]
    expressions = []
    for line in lane.splitlines():
        if line.strip().startswith("tests python -m pytest"):
            command = line.strip()[len("tests ") :].split("||")[0]
            expression = _marker_expression(shlex.split(command)[3:], default or "")
            if expression is not None:
                expressions.append(expression)
    return expressions


def test_the_newest_jax_run_selects_these_and_the_default_does_not():
    """The comparisons run where JAX lowers `scaled_dot_general` on the CPU: the
    README's command (`addopts`) leaves `newest` out, `.ci/run`'s Python 3.12 run
    selects it. Planted: that run as the README's plain command selects nothing
    marked `newest`."""
    default = _marker_expression(shlex.split(OPTIONS["addopts"]), "")
    assert default is not None and not _selects(default, newest=True)
    assert _selects(default)  # the quick tier itself
    run = (ROOT / ".ci" / "run").read_text()
    assert any(_selects(e, newest=True) for e in _newest_lane(run))
    step = 'tests python -m pytest -m "not slow" || newest_rc=$?'
    assert step in run
    planted = run.replace(step, "tests python -m pytest || newest_rc=$?")
    assert not any(_selects(e, newest=True) for e in _newest_lane(planted))
