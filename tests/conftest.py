import os

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
