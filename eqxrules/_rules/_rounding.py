"""Rounding to nearest or stochastically, declared once: the one check of a
`rounding` hyperparameter and the one place that says a stochastic rule needs a
key. Every quantiser with a `rounding` field (`FloatQuantize`, the block
quantisers, `SteQuantize`, `DoReFa`) subclasses `Rounded`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import equinox as eqx

from .._hyper import Check

_string = Check("be a string", lambda v, _: isinstance(v, str), TypeError, (3, None))
rounding_mode = Check(
    "be one of ('nearest', 'stochastic')",
    lambda v, _: v in ("nearest", "stochastic"),
    bad=("bogus", "Stochastic"),
    after=(_string,),
)


class Rounded(eqx.Module):
    """A rule with a `rounding` hyperparameter (`"nearest"` or `"stochastic"`,
    checked by `rounding_mode`): stochastic rounding draws random numbers, so the
    rule is then called with `key=`."""

    if TYPE_CHECKING:
        rounding: str

    def needs_key(self) -> bool:
        """`True` with `rounding="stochastic"`: then called with `key=`."""
        return getattr(self, "rounding") == "stochastic"
