import importlib.util
import os
import pathlib
import sys

import pytest

# Several test processes may share one GPU: take memory as needed, not 75% each.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# The property suite is jit-compiled on whatever backend JAX finds; keep hypothesis
# deterministic and bounded so the suite stays well inside CI's time.
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("EQXRULES_MAX_EXAMPLES", "8")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("ci")


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
