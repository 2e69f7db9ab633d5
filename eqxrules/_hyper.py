"""Hyperparameters as validated fields.

A rule declares each hyperparameter once, with its default and what it must satisfy:

```python
clip_value: float | None = hyperparameter(1.0, non_negative, allow_none=True)
```

From that one declaration come the validation when the Module is built (`Rule`'s
`__check_init__` calls [`check_fields`][]) and the invalid constructions the misuse
tests try ([`invalid_constructions`][]): each [`Check`][] knows the error it raises
(`TypeError` for a wrong type, `ValueError` for a wrong value) and its own canonical
bad values. Messages read `` `rule`: `arg` (=value) must be ... ``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import core

_NAN, _INF = float("nan"), float("inf")
_MISSING = dataclasses.MISSING


@dataclasses.dataclass(frozen=True)
class Check:
    """One condition on a hyperparameter.

    - `must`: completes "`arg` (=value) must ...", e.g. `"be finite and positive"`;
        or a function of the Module giving that text.
    - `holds`: `holds(value, module)` is `True` if the value is acceptable. It runs
        after every check in `after`, so it may assume those hold.
    - `error`: the exception when it does not hold: `TypeError` for a wrong type,
        `ValueError` for a wrong value.
    - `bad`: values that fail it, or a function of a valid Module giving them.
    - `after`: checks that run first (usually the type).
    """

    must: str | Callable[[Any], str]
    holds: Callable[[Any, Any], bool]
    error: type[Exception] = ValueError
    bad: tuple[Any, ...] | Callable[[Any], tuple[Any, ...]] = ()
    after: tuple[Check, ...] = ()

    def chain(self) -> tuple[Check, ...]:
        """`after`, recursively, then this check."""
        return (*(c for a in self.after for c in a.chain()), self)

    def bad_values(self, module: Any) -> tuple[Any, ...]:
        return self.bad(module) if callable(self.bad) else self.bad

    def text(self, module: Any) -> str:
        return self.must(module) if callable(self.must) else self.must


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(
        v, (bool, np.bool_)
    )


def _is_integer(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


real: Check = Check(
    "be a real number", lambda v, _: _is_real(v), TypeError, ("1", True)
)
integer: Check = Check(
    "be an integer", lambda v, _: _is_integer(v), TypeError, (2.5, True, "2")
)
finite: Check = Check(
    "be finite", lambda v, _: math.isfinite(v), bad=(_NAN, _INF), after=(real,)
)
positive: Check = Check(
    "be finite and positive",
    lambda v, _: math.isfinite(v) and v > 0,
    bad=(0.0, -1.0, _NAN, _INF),
    after=(real,),
)
non_negative: Check = Check(
    "be finite and non-negative",
    lambda v, _: math.isfinite(v) and v >= 0,
    bad=(-1.0, _NAN, _INF),
    after=(real,),
)
boolean: Check = Check(
    "be a bool", lambda v, _: isinstance(v, (bool, np.bool_)), TypeError, ("yes", 1)
)
function: Check = Check("be callable", lambda v, _: callable(v), TypeError, (3, "f"))
axis_index: Check = Check(
    "be an integer", lambda v, _: _is_integer(v), TypeError, (1.5, True)
)
axis_indices: Check = Check(
    "be an int or a non-empty tuple of ints",
    lambda v, _: (
        _is_integer(v)
        or (isinstance(v, tuple) and bool(v) and all(_is_integer(a) for a in v))
    ),
    TypeError,
    (1.5, (), (0, "a")),
)


def at_least(bound: float, type_check: Check = real) -> Check:
    """`value >= bound` (NaN fails)."""
    return Check(
        f"be >= {bound!r}",
        lambda v, _: v >= bound,
        bad=(bound - 1,),
        after=(type_check,),
    )


def at_most(bound: float, why: str = "") -> Check:
    """`value <= bound`, infinities allowed (NaN fails)."""
    return Check(
        f"be <= {bound!r}{why}",
        lambda v, _: v <= bound,
        bad=(bound + 0.5, _NAN),
        after=(real,),
    )


def at_least_zero(why: str = "") -> Check:
    """`value >= 0`, infinities allowed (NaN fails)."""
    return Check(f"be >= 0{why}", lambda v, _: v >= 0, bad=(-0.5, _NAN), after=(real,))


def greater_than(other: str) -> Check:
    """`value > module.<other>`, another hyperparameter of the same Module."""
    return Check(
        lambda m: f"be greater than `{other}` (={getattr(m, other)!r})",
        lambda v, m: v > getattr(m, other),
        bad=lambda m: (getattr(m, other), getattr(m, other) - 1.0),
        after=(finite,),
    )


def one_of(*choices: Any) -> Check:
    """`value in choices`."""
    return Check(
        f"be one of {choices!r}", lambda v, _: v in choices, bad=("bogus", None)
    )


def fixed(value: int, why: str) -> Check:
    """`value == value`, for a hyperparameter that a rule fixes: declared so that
    the rule takes it like its kin (`NVFP4Quantize(block_size=16)`, as
    `MXQuantize(block_size=32)`), and any other value is a `ValueError` that says
    `why`, rather than Python's "unexpected keyword argument"."""
    return Check(
        f"be {value!r} ({why})",
        lambda v, _: v == value,
        bad=(value * 2,),
        after=(integer,),
    )


def _is_number_or_array(v: Any) -> bool:
    if isinstance(v, (bool, np.bool_)):
        return False
    if isinstance(v, (int, float, np.number)):
        return True
    # `jnp.issubdtype`, not NumPy's: NumPy counts bfloat16 as no number at all.
    return isinstance(v, (np.ndarray, jax.Array)) and jnp.issubdtype(
        v.dtype, jnp.number
    )


def _finite_nonzero(v: Any) -> bool:
    if isinstance(v, core.Tracer):  # checked where it is concrete
        return True
    a = np.asarray(v)
    return bool(np.all(a != 0) and np.all(np.isfinite(a)))


number_or_array: Check = Check(
    "be a number or a numeric array",
    lambda v, _: _is_number_or_array(v),
    TypeError,
    ("2", True),
)
finite_nonzero: Check = Check(
    "be finite and non-zero everywhere",
    lambda v, _: _finite_nonzero(v),
    bad=(0.0, _NAN, -_INF, np.array([1.0, 0.0, 2.0])),
    after=(number_or_array,),
)


def _concrete(v: Any, test: Callable[[np.ndarray], Any]) -> bool:
    if isinstance(v, core.Tracer):  # checked where it is concrete
        return True
    return bool(test(np.asarray(v, np.float64)))


float_or_array: Check = Check(
    "be a real number or a floating-point array",
    lambda v, _: (
        _is_real(v)
        or (
            isinstance(v, (np.ndarray, jax.Array))
            and jnp.issubdtype(v.dtype, jnp.floating)  # bfloat16 too
        )
    ),
    TypeError,
    ("2", True, np.array([1, 2])),
)
positive_everywhere: Check = Check(
    "be finite and positive everywhere",
    lambda v, _: _concrete(v, lambda a: np.all(np.isfinite(a) & (a > 0))),
    bad=(0.0, -1.0, _NAN, _INF, np.array([0.5, 0.0, 1.0], np.float32)),
    after=(float_or_array,),
)
finite_everywhere: Check = Check(
    "be finite everywhere",
    lambda v, _: _concrete(v, lambda a: np.all(np.isfinite(a))),
    bad=(_NAN, -_INF, np.array([0.5, _NAN], np.float32)),
    after=(float_or_array,),
)


@dataclasses.dataclass(frozen=True)
class Declaration:
    """What `hyperparameter` records on a field."""

    checks: tuple[Check, ...]
    allow_none: bool
    positional: bool = False

    def chain(self) -> tuple[Check, ...]:
        seen: list[Check] = []
        for c in (c for check in self.checks for c in check.chain()):
            if c not in seen:
                seen.append(c)
        return tuple(seen)

    def failure(self, value: Any, module: Any) -> Check | None:
        """The first check `value` fails, or `None`."""
        if value is None and self.allow_none:
            return None
        for check in self.chain():
            if not check.holds(value, module):
                return check
        return None


def hyperparameter(
    *args: Any,
    allow_none: bool = False,
    static: bool = True,
    positional: bool = False,
    **kwargs: Any,
) -> Any:
    """Declare a hyperparameter: `hyperparameter(default, *checks)`, or
    `hyperparameter(*checks)` for one without a default.

    **Arguments:**

    - `default`: the default value (omit it for a required hyperparameter).
    - `*checks`: the `Check`s it must pass, e.g. `non_negative`.
    - `allow_none`: whether `None` is also accepted.
    - `static`: `True` (the default) for a static field: a Python value that is part
        of the pytree structure. `False` for a dynamic one, such as a wrapped
        sub-model or an array scale, whose arrays get tangents.
    - `positional`: whether the derived functional form also takes it by position,
        after the inputs, in field order (as 0.1.0's hand-written forms did:
        `clip_gradient(x, -1.0, 1.0)`). New hyperparameters are keyword-only.
    """
    default = _MISSING
    if args and not isinstance(args[0], Check):
        default, *rest = args
        args = tuple(rest)
    if not args or not all(isinstance(c, Check) for c in args):
        caller = kwargs.pop("_caller", "hyperparameter")
        raise TypeError(
            f"`{caller}`: give a default, then one or more checks (from "
            f"`eqxrules.checks`), e.g. `{caller}(1.0, positive)`; got {args!r}."
        )
    kwargs.pop("_caller", None)
    metadata = {
        "hyperparameter": Declaration(tuple(args), allow_none, positional),
        **kwargs.pop("metadata", {}),
    }
    if default is not _MISSING:
        kwargs["default"] = default
    return eqx.field(static=static, metadata=metadata, **kwargs)


def parameter(*args: Any, allow_none: bool = False, **kwargs: Any) -> Any:
    """Declare a learnable parameter: an array field that is trained (a learned
    step size, say), validated like a hyperparameter, `parameter(default, *checks)`
    or `parameter(*checks)`.

    Unlike a hyperparameter it is dynamic: its arrays are pytree leaves, trained by
    `optax` with the rest of a model, and their tangents reach the rule's `tangent`
    in `t_self`. In the derived functional form a parameter without a default is
    positional, after the inputs (`lsq_quantize(x, step, *, bits)`); one with a
    default is keyword-only, like a hyperparameter.
    """
    metadata = {**kwargs.pop("metadata", {}), "parameter": True}
    return hyperparameter(
        *args,
        allow_none=allow_none,
        static=False,
        metadata=metadata,
        _caller="parameter",
        **kwargs,
    )


def parameters(cls: type) -> list[str]:
    """The names of the fields of `cls` declared with [`parameter`][]."""
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get("parameter")]


def declarations(cls: type) -> dict[str, Declaration]:
    """`{field name: declaration}` for the fields of `cls` declared with
    `hyperparameter`."""
    return {
        f.name: f.metadata["hyperparameter"]
        for f in dataclasses.fields(cls)
        if "hyperparameter" in f.metadata
    }


def undeclared(cls: type) -> list[str]:
    """The fields of `cls` not declared with `hyperparameter` (so unvalidated)."""
    return [
        f.name for f in dataclasses.fields(cls) if "hyperparameter" not in f.metadata
    ]


def check_fields(module: Any, name: str) -> None:
    """Raise the error of the first failed check of any declared field, naming the
    rule `name`, the field and its value."""
    for field, declaration in declarations(type(module)).items():
        value = getattr(module, field)
        failed = declaration.failure(value, module)
        if failed is not None:
            raise failed.error(
                f"`{name}`: `{field}` (={value!r}) must {failed.text(module)}."
            )


class Invalid(NamedTuple):
    """One invalid construction: `cls(**kwargs)` must raise `error` with a message
    naming the rule, `` `argument` `` and `=value!r`."""

    kwargs: dict[str, Any]
    error: type[Exception]
    argument: str
    value: Any


def invalid_constructions(valid: Any) -> list[Invalid]:
    """For each declared field of the Module `valid`, each bad value of each of its
    checks (and `None` where it is not allowed) in place of that field's value:
    the construction, and the error the first failing check raises."""
    cls = type(valid)
    fields = {f.name: getattr(valid, f.name) for f in dataclasses.fields(cls)}
    rows = []
    for field, declaration in declarations(cls).items():
        candidates: list[Any] = [] if declaration.allow_none else [None]
        for check in declaration.chain():
            candidates += check.bad_values(valid)
        for value in _unique(candidates):
            failed = declaration.failure(value, valid)
            if failed is not None:
                rows.append(
                    Invalid({**fields, field: value}, failed.error, field, value)
                )
    return rows


def _unique(values: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        if not any(_same(v, u) for u in out):
            out.append(v)
    return out


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


__all__ = [
    "Check",
    "Invalid",
    "at_least",
    "at_least_zero",
    "at_most",
    "axis_index",
    "axis_indices",
    "boolean",
    "check_fields",
    "declarations",
    "finite",
    "finite_everywhere",
    "finite_nonzero",
    "fixed",
    "float_or_array",
    "function",
    "greater_than",
    "hyperparameter",
    "integer",
    "invalid_constructions",
    "non_negative",
    "number_or_array",
    "one_of",
    "parameter",
    "parameters",
    "positive",
    "positive_everywhere",
    "real",
]
