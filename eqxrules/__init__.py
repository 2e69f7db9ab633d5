"""eqxrules: custom derivative rules for JAX and Equinox, each declared once and
checked against a reference."""

from . import _rules, checks as checks, recipes as recipes, testing as testing
from ._calibrate import calibrate as calibrate
from ._catalogue import (
    Domain as Domain,
    ElementwiseRule as ElementwiseRule,
    Entry as Entry,
    JVPRule as JVPRule,
    PytreeRule as PytreeRule,
    Rule as Rule,
    VJPRule as VJPRule,
    catalogue as catalogue,
    functional as functional,
)
from ._domain import Args as Args, Inputs as Inputs, Mask as Mask
from ._hyper import hyperparameter as hyperparameter, parameter as parameter
from ._layers import Quantized as Quantized, quantize as quantize
from ._lowp.conv import quantized_conv as quantized_conv
from ._lowp.dot import (
    quantized_dot as quantized_dot,
    quantized_dot_general as quantized_dot_general,
)
from ._lowp.einsum import quantized_einsum as quantized_einsum
from ._lowp.layer import (
    Keyed as Keyed,
    QuantizedConv as QuantizedConv,
    QuantizedLinear as QuantizedLinear,
)
from ._lowp.ragged import quantized_ragged_dot as quantized_ragged_dot
from ._rules import *  # noqa: F403  (every rule class and its functional form)
from ._rules.blocks import BlockQuantizer as BlockQuantizer
from ._sign_warning import NonNegativeSignInputWarning as NonNegativeSignInputWarning
from ._structured import (
    Integers as Integers,
    PositiveDefinite as PositiveDefinite,
    Simplex as Simplex,
    Symmetric as Symmetric,
)
from ._tangents import partial_jvp as partial_jvp
from ._verify_rule import (
    RuleVerification as RuleVerification,
    RuleVerificationError as RuleVerificationError,
    verify_rule as verify_rule,
)

__version__ = "0.2.0"

__all__ = [
    "Args",
    "BlockQuantizer",
    "Domain",
    "ElementwiseRule",
    "Entry",
    "Inputs",
    "Integers",
    "JVPRule",
    "Keyed",
    "Mask",
    "NonNegativeSignInputWarning",
    "PositiveDefinite",
    "PytreeRule",
    "Quantized",
    "QuantizedConv",
    "QuantizedLinear",
    "Rule",
    "RuleVerification",
    "RuleVerificationError",
    "Simplex",
    "Symmetric",
    "VJPRule",
    "calibrate",
    "catalogue",
    "checks",
    "functional",
    "hyperparameter",
    "parameter",
    "partial_jvp",
    "quantize",
    "quantized_conv",
    "quantized_dot",
    "quantized_dot_general",
    "quantized_einsum",
    "quantized_ragged_dot",
    "recipes",
    "testing",
    "verify_rule",
]
# Every rule class and its functional form, from the catalogue (for type checkers,
# from the stub eqxrules/_rules/__init__.pyi generated from it).
__all__ += _rules.__all__
