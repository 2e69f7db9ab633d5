"""Settings, fixtures and the names the tests share (`from conftest import
ENTRIES, KEY, ...`): the catalogue, the keys its examples are built and called
with, and a plain loss."""

import os

# Several test processes may share one GPU: take memory as needed, not 75% each.
# (Set before JAX is imported.)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import functools as ft  # noqa: E402
import importlib.util  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

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
