"""`PyTree` for annotations: jaxtyping's at runtime; to a type checker, `Any` (as
jaxtyping intends), but a known `Any`, so the public signatures count as typed."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import TypeAlias

    PyTree: TypeAlias = Any
else:
    from jaxtyping import PyTree

__all__ = ["PyTree"]
