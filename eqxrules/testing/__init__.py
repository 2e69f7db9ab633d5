"""`eqxrules.testing`: prove any custom derivative rule against references.

[`check_rule`][eqxrules.testing.check_rule] knows nothing of the catalogue: it
checks any callable. The catalogue's own tests and `python -m eqxrules` are built on
it, and [`verify_rule`][eqxrules.testing.verify_rule] runs the catalogue's battery
on any rule class.
"""

from typing import TYPE_CHECKING, Any

from ._check import CHECKS as CHECKS, check_rule as check_rule
from ._checks import FINITE_DIFFERENCE_TOLERANCES as FINITE_DIFFERENCE_TOLERANCES
from ._compare import DEFAULT_TOLERANCES as DEFAULT_TOLERANCES
from ._report import (
    CheckResult as CheckResult,
    RuleCheckError as RuleCheckError,
    RuleReport as RuleReport,
)

# isort: split
# The catalogue's battery for one rule class: it imports the checker above.
from .._verify import (
    RuleVerification as RuleVerification,
    RuleVerificationError as RuleVerificationError,
    verify_rule as verify_rule,
)

if TYPE_CHECKING:
    from . import strategies as strategies


def __getattr__(name: str) -> Any:
    # `strategies` needs hypothesis, which only the `test` extra installs: import it
    # on first use, so `import eqxrules` works without it.
    if name == "strategies":
        import importlib

        return importlib.import_module(f"{__name__}.strategies")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CHECKS",
    "DEFAULT_TOLERANCES",
    "FINITE_DIFFERENCE_TOLERANCES",
    "CheckResult",
    "RuleCheckError",
    "RuleReport",
    "RuleVerification",
    "RuleVerificationError",
    "check_rule",
    "strategies",
    "verify_rule",
]
