"""`eqxrules.testing`: prove any custom derivative rule against references.

[`check_rule`][eqxrules.testing.check_rule] knows nothing of the catalogue: it
checks any callable, and this package imports nothing else of eqxrules. The
catalogue's own tests and `python -m eqxrules` are built on it, and
[`eqxrules.verify_rule`][] runs the catalogue's battery on any rule class.
[`check_unbiased`][eqxrules.testing.check_unbiased] tests a stochastic rounding for
bias at a stated false-fail rate.
"""

from typing import TYPE_CHECKING, Any

from ._check import CHECKS as CHECKS, check_rule as check_rule
from ._checks import FINITE_DIFFERENCE_TOLERANCES as FINITE_DIFFERENCE_TOLERANCES
from ._chernoff import (
    detectable_bias as detectable_bias,
    draws_to_detect_bias as draws_to_detect_bias,
)
from ._compare import DEFAULT_TOLERANCES as DEFAULT_TOLERANCES
from ._report import (
    CheckResult as CheckResult,
    RuleCheckError as RuleCheckError,
    RuleReport as RuleReport,
)
from ._unbiased import check_unbiased as check_unbiased
from ._unbiased_report import (
    UnbiasedCheckError as UnbiasedCheckError,
    UnbiasedReport as UnbiasedReport,
)

if TYPE_CHECKING:
    from . import strategies as strategies

# Names that lived here in 0.2.0. They read the catalogue, which this package must
# not import (the imports would run both ways), so they live in `eqxrules` now.
_MOVED = ("RuleVerification", "RuleVerificationError", "verify_rule")


def __getattr__(name: str) -> Any:
    # `strategies` needs hypothesis, which only the `test` extra installs: import it
    # on first use, so `import eqxrules` works without it.
    if name == "strategies":
        import importlib

        return importlib.import_module(f"{__name__}.strategies")
    if name in _MOVED:
        raise AttributeError(
            f"`{__name__}.{name}` moved to `eqxrules.{name}` (it reads the catalogue, "
            f"which `{__name__}` does not import): use `eqxrules.{name}`, or "
            f"`from eqxrules import {name}`."
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CHECKS",
    "DEFAULT_TOLERANCES",
    "FINITE_DIFFERENCE_TOLERANCES",
    "CheckResult",
    "RuleCheckError",
    "RuleReport",
    "UnbiasedCheckError",
    "UnbiasedReport",
    "check_rule",
    "check_unbiased",
    "detectable_bias",
    "draws_to_detect_bias",
    "strategies",
]
