"""Settings, fixtures and the names the tests share (`from conftest import
ENTRIES, KEY, ...`): the catalogue, the keys its examples are built and called
with, and a plain loss."""

import os

# Several test processes may share one GPU: take memory as needed, not 75% each.
# (Set before JAX is imported.)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import atexit  # noqa: E402
import functools as ft  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

try:
    import fcntl  # noqa: E402
except ImportError:  # Windows: each worker computes its own
    fcntl = None

# One directory per test session, made by its first process (xdist's controller),
# inherited by its workers and subprocesses through the environment, and removed at
# the end: what the session's processes share (`once_per_session`, the compilation
# cache below), so that no run reads what another wrote.
if "EQXRULES_TEST_SESSION" not in os.environ:
    _SESSION_DIR = tempfile.mkdtemp(prefix="eqxrules-tests-")
    os.environ["EQXRULES_TEST_SESSION"] = _SESSION_DIR
    # At exit, not in `pytest_unconfigure`: a script that imports this module
    # outside pytest removes its directory too.
    atexit.register(shutil.rmtree, _SESSION_DIR, ignore_errors=True)

# The suite is compile-bound, and about a third of its programs are compiled more
# than once: by both xdist workers (each builds the catalogue's examples), by
# several modules, and by the scripts the tests run in subprocesses. JAX's
# persistent compilation cache, in the session's directory, shares them; every
# program is cached, however quick to compile. Set `JAX_COMPILATION_CACHE_DIR` to
# keep one across runs, or to "" for none.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.environ["EQXRULES_TEST_SESSION"], "jax-cache"),
)
if os.environ["JAX_COMPILATION_CACHE_DIR"]:
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def once_per_session(name: str, compute: Callable[[], Any]) -> Any:
    """`compute()`, a JSON value, computed once per test session whichever worker
    asks first; the others wait for it and read it back. (xdist's `loadgroup`
    cannot keep a fixture's tests on one worker under pytest 9.2: it renames
    `Item._nodeid`, which pytest no longer reads.)"""
    path = pathlib.Path(os.environ["EQXRULES_TEST_SESSION"]) / f"{name}.json"
    with open(path.with_suffix(".lock"), "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            path.write_text(json.dumps(compute()))
        return json.loads(path.read_text())


import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import eqxrules  # noqa: E402

# The property suite is jit-compiled on whatever backend JAX finds; keep hypothesis
# deterministic and bounded so the suite stays well inside CI's time.
settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("EQXRULES_MAX_EXAMPLES", "8")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("ci")


KEY = jax.random.key(0)  # builds the examples
CALL_KEY = jax.random.key(2)  # for the calls that take a PRNG key
ENTRIES = eqxrules.catalogue()


@ft.cache
def examples(entry: eqxrules.Entry) -> tuple[eqxrules.Rule, ...]:
    """`entry`'s examples, built once."""
    return tuple(entry.examples(KEY))


def example_cases(entries: Any = ENTRIES) -> list[Any]:
    """`pytest.param(entry, index)` for every example of every entry."""
    return [
        pytest.param(entry, i, id=f"{entry.name}-{i}")
        for entry in entries
        for i in range(len(examples(entry)))
    ]


def sum_loss(out: Any) -> jax.Array:
    """The float32 sum of every floating-point leaf of `out`."""
    leaves = [o for o in jtu.tree_leaves(out) if eqx.is_inexact_array(o)]
    return sum((jnp.sum(o.astype(jnp.float32)) for o in leaves), jnp.zeros(()))


EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _load_example(name: str):
    """Import `examples/NAME.py` as a module, so a test can call its `main(quick=True)`
    and check the figures it returns."""
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"examples_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def load_example():
    return _load_example


# The two tiers. `python -m pytest` (the README's command, and CI's) runs the quick
# tier: `addopts` in pyproject.toml deselects `slow`. `python -m pytest -m slow`
# runs the rest, `-m "slow or not slow"` everything. Besides the `slow` marks beside
# the tests (the bfloat16 and float16 columns, say), this policy marks, in one place:
#
# - every example of a catalogue entry after its first, in any test parametrised by
#   `entry` and `index` (the first example of every entry stays quick);
# - the modules below, whole: those in `CATALOGUE_WIDE` are also marked
#   `catalogue_wide`, and CI runs them (`-m "not slow or catalogue_wide"`) in its
#   second environment, pinned at the minimum versions; those in `SLOW_IN_CI` are
#   also marked `ci_slow`, and CI runs them at the newest versions;
# - the single heavy tests in `SLOW_TESTS`;
# - the parametrised tests below, all but their first case (which stays quick, so
#   that each check and its planted defect run in both tiers).
CATALOGUE_WIDE = {
    "test_matrix.py": "every entry through every transformation",
    "test_sharding.py": "an 8-device subprocess",
    "test_layer_sequential.py": "every rule as a layer of eqx.nn.Sequential",
    "test_layer_dropout.py": "rules around dropout, inference mode",
    "test_layer_quantizer.py": "every quantiser through `quantize`",
}
SLOW_MODULES = {
    "test_guides.py": "every guide also runs in the strict docs build that CI does",
    "test_examples_lowp.py": "trains a transformer in five recipes (about 25 s)",
    "test_examples_straight_through.py": "trains three networks on digits",
    "test_examples_stop_gradient.py": "trains DANN and an LSTM",
    "test_xla_cost.py": "compiles networks for XLA's cost analysis",
    "test_lowp_cost.py": "compiles the recipes' products for XLA's cost analysis",
    **CATALOGUE_WIDE,
}
# The part of the slow tier that `.ci/run` runs too (`-m ci_slow`): the examples'
# training runs, which nothing in the quick tier runs. All of the slow tier does
# not fit in CI's 12 minutes on 2 cores beside the quick tier, the site build and
# the minimum-version run (issue 18 §5: with all of it a fresh-clone `.ci/run` took
# 921 s; with this part, about 10 minutes); the rest (every later example and
# dtype of checks whose first example or float32 column the quick tier runs, the
# exhaustive proofs' larger grids, XLA's cost analysis, the mutation script) is a
# pre-release run.
SLOW_IN_CI = {
    "test_examples_lowp.py": "the low-precision example's --quick run, every row",
    "test_examples_straight_through.py": "the straight-through examples train",
    "test_examples_stop_gradient.py": "the stop-gradient examples train",
}
SLOW_TESTS = {  # heavy single tests; a lighter quick one checks the same part
    "test_stochastic_rounding_use.py": (
        "test_quantize_with_stochastic_quantisers_needs_a_key",
    ),
    "test_stochastic_rounding_grid.py": (
        "test_each_grid_takes_the_path_and_tiers_stated",
    ),
    "test_stochastic_rounding_grid_use.py": (
        "test_bfloat16_inputs_on_a_grid_finer_than_bfloat16_are_themselves",
    ),
    "test_float_formats.py": ("test_blocks_run_along_the_reduction_dimension",),
    "test_unbiased.py": (
        "test_detectable_bias_holds_over_keys",
        "test_calibration",
        "test_calibration_catches_an_overstated_rate",
        "test_bounds_give_the_same_test_as_neighbours",
    ),
    "test_quantized_dot_sr.py": (
        "test_nvfp4_gradient_products_are_unbiased",
        "test_planted_rounding_to_nearest_fails_the_nvfp4_check",
    ),
    "test_quantized_dot.py": ("test_identity_recipe_is_jnp_dot_bit_for_bit",),
    "test_learned.py": ("test_quantize_fits_each_layers_step_and_calibrate_its_input",),
    "test_exact_grid.py": ("test_the_table_path_under_sharding_in_types",),
}
FIRST_CASE_ONLY = {
    "test_layers.py": ("test_quantized_value_and_gradients",),
    "test_cli.py": ("test_check_gives_a_stochastic_instance_a_key",),
    "test_learned.py": ("test_bf16_input_with_f32_step",),
    "test_float_formats.py": ("test_nvfp4_equals_the_numpy_rule",),
    "test_stochastic_rounding_grid.py": (
        "test_every_input_steps_for_the_exact_count_of_bit_patterns",
        "test_planted_defects_fail_the_count",
        "test_at_24_bits_the_decision_sits_at_the_count",
    ),
    "test_stochastic_rounding_grid_use.py": (
        "test_same_key_same_draw_other_key_other_draw",
        "test_the_reference_agrees_and_the_derivative_is_nearest_s",
        "test_levels_stay_beyond_the_range_saturates_nan_stays",
        "test_the_mean_over_keys_is_the_input",
    ),
    "test_stochastic_rounding_use.py": (
        "test_same_key_same_draw_other_key_other_draw",
        "test_nearest_accepts_and_ignores_a_key",
        "test_beyond_max_saturates_nan_stays_and_values_of_the_format_stay",
        "test_the_derivative_is_the_straight_through_one_of_nearest",
    ),
    "test_stochastic_rounding.py": (
        "test_rules_draw_their_bits_from_the_key_as_documented",
        "test_the_mean_over_keys_is_the_input",
    ),
    "test_unbiased.py": (
        "test_correct_rounding_passes",
        "test_planted_defects_are_caught",
        "test_a_3pc_bias_is_detectable_and_caught",
    ),
    "test_unbiased_catalogue.py": (
        "test_every_stochastic_rounding_in_the_catalogue_is_unbiased",
        "test_planted_biased_variants_of_real_rules_fail",
    ),
    "test_quantized_dot.py": (
        "test_products_equal_the_reference",
        "test_vmap_over_examples_is_one_call_on_the_batch",
    ),
    "test_scaled.py": ("test_mode_matches_definition",),
    "test_calibrate.py": ("test_calibrate_is_0_2_0_bit_for_bit",),
    "test_exact_grid.py": (
        "test_ste_quantize_is_exact",
        "test_float32_at_every_threshold_and_level_jitted_and_eager",
    ),
}


def _is_later_example(item: pytest.Item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    index = params.get("index")
    return "entry" in params and isinstance(index, int) and index > 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]):
    seen: set[tuple[str, str]] = set()
    for item in items:
        module = item.path.name
        function = getattr(item, "originalname", item.name)
        first = (module, function) not in seen
        seen.add((module, function))
        later = _is_later_example(item) or item.get_closest_marker("slow") is not None
        if module in CATALOGUE_WIDE and not later:
            item.add_marker(pytest.mark.catalogue_wide)
        if (
            later
            or module in SLOW_MODULES
            or function in SLOW_TESTS.get(module, ())
            or (function in FIRST_CASE_ONLY.get(module, ()) and not first)
        ):
            item.add_marker(pytest.mark.slow)
            if module in SLOW_IN_CI:
                item.add_marker(pytest.mark.ci_slow)
