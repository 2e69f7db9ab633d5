"""What every check shares: the options of a `check_rule` call, and how a failure or
an exception raised inside a check names where it happened."""

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
