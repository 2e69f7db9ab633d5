"""eqxrules: custom derivative rules for JAX and Equinox, each declared once and
checked against a reference."""

from . import testing as testing
from ._catalogue import (
    Domain as Domain,
    Entry as Entry,
    JVPRule as JVPRule,
    Rule as Rule,
    VJPRule as VJPRule,
    catalogue as catalogue,
    functional as functional,
    partial_jvp as partial_jvp,
)
from ._rules.scaled import ScaledModel as ScaledModel, scaled_call as scaled_call

# <straight-through exports: issue 3>
# <stop-gradient and gradient-shaping exports: issue 4>

__version__ = "0.1.0"
