"""`eqxrules.testing`: prove any custom derivative rule against references.

It knows nothing of the catalogue: it checks any callable. The catalogue's own tests
and `python -m eqxrules` are built on it.
"""

from . import strategies as strategies
from ._check import (
    CHECKS as CHECKS,
    DEFAULT_TOLERANCES as DEFAULT_TOLERANCES,
    FINITE_DIFFERENCE_TOLERANCES as FINITE_DIFFERENCE_TOLERANCES,
    CheckResult as CheckResult,
    RuleCheckError as RuleCheckError,
    RuleReport as RuleReport,
    check_rule as check_rule,
)
