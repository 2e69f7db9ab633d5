"""The checks a hyperparameter is declared with:
`clip_value: float = hyperparameter(1.0, eqxrules.checks.positive)`.

Each [`Check`][eqxrules.checks.Check] knows the error it raises (`TypeError` for a
wrong type, `ValueError` for a wrong value), the words of its message
(`` `rule`: `arg` (=value) must be ... ``) and its own canonical bad values, from
which [`eqxrules.verify_rule`][] and the catalogue's misuse tests build the
invalid constructions a rule must reject. A check of your own is a `Check(...)`.

| check | the value must |
|---|---|
| `real` | be a real number (not a bool or a string): `TypeError` |
| `integer` | be an integer (not a bool): `TypeError` |
| `boolean` | be a bool: `TypeError` |
| `function` | be callable: `TypeError` |
| `finite` | be a finite real number |
| `positive` | be finite and positive |
| `non_negative` | be finite and non-negative |
| `at_least(bound)`, `at_most(bound)` | be `>= bound`, `<= bound` |
| `at_least_zero()` | be `>= 0` (infinity allowed) |
| `greater_than(other)` | be greater than the hyperparameter `other` of the same Module |
| `one_of(*choices)` | be one of `choices` |
| `fixed(value, why)` | be `value`, which the rule fixes (`why` says why) |
| `number_or_array` | be a number or a numeric array: `TypeError` |
| `float_or_array` | be a real number or a floating-point array: `TypeError` |
| `finite_nonzero` | be finite and non-zero everywhere (an array scale) |
| `positive_everywhere` | be finite and positive everywhere (a learned step) |
| `finite_everywhere` | be finite everywhere |

Array checks look at concrete values only: under `jit` a traced value passes, and is
checked where it is concrete.
"""

from ._hyper import (
    Check as Check,
    at_least as at_least,
    at_least_zero as at_least_zero,
    at_most as at_most,
    boolean as boolean,
    finite as finite,
    finite_everywhere as finite_everywhere,
    finite_nonzero as finite_nonzero,
    fixed as fixed,
    float_or_array as float_or_array,
    function as function,
    greater_than as greater_than,
    integer as integer,
    non_negative as non_negative,
    number_or_array as number_or_array,
    one_of as one_of,
    positive as positive,
    positive_everywhere as positive_everywhere,
    real as real,
)

__all__ = [
    "Check",
    "at_least",
    "at_least_zero",
    "at_most",
    "boolean",
    "finite",
    "finite_everywhere",
    "finite_nonzero",
    "fixed",
    "float_or_array",
    "function",
    "greater_than",
    "integer",
    "non_negative",
    "number_or_array",
    "one_of",
    "positive",
    "positive_everywhere",
    "real",
]
