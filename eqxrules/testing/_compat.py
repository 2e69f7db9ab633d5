"""The few public JAX names that moved between the versions eqxrules supports.

Only public API: `jax.enable_x64` appeared after jax 0.7, and the older public
`jax.experimental.enable_x64` was removed after it.
"""

from __future__ import annotations

import contextlib

import jax


def enable_x64() -> contextlib.AbstractContextManager[None]:
    """A context in which float64 is enabled, on every supported JAX version."""
    new = getattr(jax, "enable_x64", None)
    if new is not None:
        return new(True)
    from jax.experimental import enable_x64 as old  # pyright: ignore[reportAttributeAccessIssue]

    return old(True)
