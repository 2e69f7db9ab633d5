"""eqxrules: custom derivative rules for JAX and Equinox, each declared once and
checked against a reference."""

from . import testing as testing
from ._catalogue import (
    BadHyperparameter as BadHyperparameter,
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
from ._layers import Quantized as Quantized, quantize as quantize
from ._rules.gradient import (
    ClipGradient as ClipGradient,
    ClipGradientNorm as ClipGradientNorm,
    GradientReversal as GradientReversal,
    GradientScale as GradientScale,
    ZeroNonFiniteGradient as ZeroNonFiniteGradient,
    clip_gradient as clip_gradient,
    clip_gradient_norm as clip_gradient_norm,
    gradient_reversal as gradient_reversal,
    gradient_scale as gradient_scale,
    zero_nonfinite_gradient as zero_nonfinite_gradient,
)
from ._rules.scaled import ScaledModel as ScaledModel, scaled_call as scaled_call
from ._rules.stop_gradient import (
    Detach as Detach,
    Frozen as Frozen,
    Standardize as Standardize,
    StopGradient as StopGradient,
    detach as detach,
    frozen_call as frozen_call,
    standardize as standardize,
    stop_gradient_call as stop_gradient_call,
)
from ._rules.straight_through import (
    ApproxSign as ApproxSign,
    DoReFa as DoReFa,
    GumbelSoftmax as GumbelSoftmax,
    MagnitudeAwareSign as MagnitudeAwareSign,
    SteHeaviside as SteHeaviside,
    SteQuantize as SteQuantize,
    SteRound as SteRound,
    SteSign as SteSign,
    SteTernary as SteTernary,
    StochasticRound as StochasticRound,
    StraightThrough as StraightThrough,
    StraightThroughOneHot as StraightThroughOneHot,
    SwishSign as SwishSign,
    approx_sign as approx_sign,
    dorefa_quantize as dorefa_quantize,
    gumbel_softmax as gumbel_softmax,
    magnitude_aware_sign as magnitude_aware_sign,
    ste_heaviside as ste_heaviside,
    ste_quantize as ste_quantize,
    ste_round as ste_round,
    ste_sign as ste_sign,
    ste_ternary as ste_ternary,
    stochastic_round as stochastic_round,
    straight_through as straight_through,
    straight_through_onehot as straight_through_onehot,
    swish_sign as swish_sign,
)

__version__ = "0.1.0"
