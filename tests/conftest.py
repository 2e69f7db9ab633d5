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

# `rule(*x)` for the `eqxrules.Args` of a rule of several inputs, else `rule(x)`.
from eqxrules._domain import call as call  # noqa: E402

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
    and check the figures it returns. Its directory is on `sys.path`, as when
    Python runs it as a script, so that it imports a module beside it."""
    if str(EXAMPLES) not in sys.path:
        sys.path.append(str(EXAMPLES))
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


@pytest.fixture
def fresh_products(monkeypatch):
    """`monkeypatch`, with the quantised core's products (`core.product`, one
    cached `jit` per product, and the residuals' `_keep` and `_weight_gradient`)
    traced again in the test, so that a patched helper of the core is traced, and
    again after it, so that no patched trace outlives it."""
    from eqxrules._lowp import core, residuals

    caches = (core.product, residuals._keep, residuals._weight_gradient)
    for cache in caches:
        cache.cache_clear()
    yield monkeypatch
    for cache in caches:
        cache.cache_clear()


# The two tiers. `python -m pytest` (the README's command) runs the quick tier:
# `addopts` in pyproject.toml deselects `slow`. `python -m pytest -m slow` runs the
# rest, `-m "slow or not slow"` everything; `.ci/run` runs both
# (`test_package.py` checks that together they select every test).
#
# A test's tier is marked beside it: `pytestmark = pytest.mark.slow` in a slow
# module (with `pytest.mark.catalogue_wide` where CI also runs it at the minimum
# versions), `@pytest.mark.slow` on a slow test, a slow parameter's
# `pytest.param(..., marks=pytest.mark.slow)`, and `@pytest.mark.first_case_quick`
# on a parametrised test whose first case alone stays quick (so that each check
# and its planted defect run in both tiers), or `@pytest.mark.first_entry_quick` on a
# property test over the catalogue whose first case alone stays quick, the others
# slow but not `later` (each entry's first example still runs at the minimum
# versions, where the module is marked `catalogue_wide`). One policy needs no mark: every
# example of a catalogue entry after its first, in a test parametrised by `entry`
# and `index`, is slow (the first example of every entry stays quick).
#
# The hook below applies the two policies, and marks `later` every case beyond a
# test's first example or dtype (a later example, a case marked slow on its own in
# a slow module, a later case of a `first_case_quick` test): CI's minimum-version
# run takes `catalogue_wide and not later`, each entry's first example.


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked `newest(jax=V)` needs JAX V or later (what it checks does not
    run on an older one): `addopts` deselects it, `.ci/run`'s Python 3.12 run
    selects it, and selected at an older JAX it fails saying so, never skipped."""
    mark = item.get_closest_marker("newest")
    if mark is not None and _version(jax.__version__) < _version(mark.kwargs["jax"]):
        pytest.fail(
            f"{item.name} needs JAX >= {mark.kwargs['jax']} (marked `newest`); this "
            f"is JAX {jax.__version__}. It runs in .ci/run's Python 3.12 environment "
            'at the newest JAX (`python -m pytest -m "not slow"` there); the '
            "README's command leaves it out.",
            pytrace=False,
        )


def _is_later_example(item: pytest.Item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    index = params.get("index")
    return "entry" in params and isinstance(index, int) and index > 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]):
    seen: set[tuple[str, str]] = set()
    seen_entry: set[tuple[str, str]] = set()
    for item in items:
        test = (item.path.name, getattr(item, "originalname", item.name))
        later_case = item.get_closest_marker("first_case_quick") is not None and (
            test in seen
        )
        seen.add(test)
        own_slow = any(m.name == "slow" for m in item.own_markers)
        if item.get_closest_marker("first_entry_quick") is not None and (
            test in seen_entry
        ):
            # A later entry: slow, and still run at the minimum versions.
            item.add_marker(pytest.mark.slow)
        seen_entry.add(test)
        if _is_later_example(item) or later_case:
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.later)
        elif own_slow:
            item.add_marker(pytest.mark.later)
