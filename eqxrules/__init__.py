"""eqxrules: custom derivative rules for JAX and Equinox, each declared once and
checked against a reference."""

from typing import TYPE_CHECKING, Any

from . import checks as checks, testing as testing
from ._catalogue import (
    Domain as Domain,
    Entry as Entry,
    JVPRule as JVPRule,
    PytreeRule as PytreeRule,
    Rule as Rule,
    VJPRule as VJPRule,
    catalogue as catalogue,
    functional as functional,
    partial_jvp as partial_jvp,
)
from ._hyper import hyperparameter as hyperparameter, parameter as parameter
from ._layers import (
    Quantized as Quantized,
    calibrate as calibrate,
    quantize as quantize,
)
from ._rules import *  # noqa: F403  (every rule class and its functional form)
from ._rules import __all__ as _rule_names

__version__ = "0.1.0"

# The rules' names come from the catalogue: a type checker cannot list them.
__all__ = [  # pyright: ignore[reportUnsupportedDunderAll]
    "Domain",
    "Entry",
    "JVPRule",
    "PytreeRule",
    "Quantized",
    "Rule",
    "VJPRule",
    "calibrate",
    "catalogue",
    "checks",
    "functional",
    "hyperparameter",
    "parameter",
    "partial_jvp",
    "quantize",
    "testing",
    *_rule_names,
]

if TYPE_CHECKING:
    # The rules are exported from the catalogue, which a type checker cannot run:
    # to it they are `Any` rather than unknown names.
    def __getattr__(name: str) -> Any: ...
