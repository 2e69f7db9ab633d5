"""What every check shares: the options of a `check_rule` call, how a failure or an
exception raised inside a check names where it happened, and the two errors JAX
raises that the checker names by their cause."""

from __future__ import annotations

import contextlib
import dataclasses

from ._compare import _Failure


@dataclasses.dataclass(frozen=True)
class _Options:
    modes: tuple[str, ...]
    finite_differences: bool
    num_directions: int
    order: int
    unchecked_nan: bool = False
    cotangent_scales: tuple[float, ...] = (1.0,)
    cotangent_thresholds: tuple[float, ...] = ()


def _is_reverse_only_error(e: BaseException) -> bool:
    """Whether `e` is JAX (or eqxrules) refusing forward mode through a custom VJP."""
    msg = str(e)
    return (
        "can't apply forward-mode autodiff" in msg
        or "supports reverse mode only" in msg
    )


def _untransposable(e: BaseException) -> bool:
    """Whether `e` is what JAX raises when reverse mode transposes a JVP that is
    not linear in its tangent: a bare `AssertionError` (a product of tangents, a
    branch on one), or no transpose rule for the primitive applied to one."""
    if type(e) is AssertionError:
        return True
    return isinstance(e, NotImplementedError) and "Transpose rule" in str(e)


class _Raised(Exception):
    """The rule raised `exception` in the circumstances `context` names."""

    def __init__(self, exception: Exception, context: str) -> None:
        super().__init__(str(exception))
        self.exception = exception
        self.context = context


@contextlib.contextmanager
def _where(context: str):
    """Name `context` in a failure or an exception raised inside."""
    try:
        yield
    except _Failure as f:
        raise _Failure(f"{context}: {f.detail}", **f.figures) from None
    except _Raised:
        raise
    except Exception as e:
        raise _Raised(e, context) from e
