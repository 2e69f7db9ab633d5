"""Hypothesis strategies for checking rules: arrays in a domain (off its kinks), the
inputs of a rule of several, pytrees of arrays, and small `eqx.nn.MLP`s.

Needs the `test` extra (`hypothesis`)."""

from __future__ import annotations

from typing import Any, Protocol

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._args import Args

try:
    from hypothesis import strategies as st
except ImportError as e:
    raise ImportError(
        "`eqxrules.testing.strategies` needs hypothesis, which eqxrules installs "
        "with its `test` extra: pip install 'eqxrules[test]' (importing hypothesis "
        f"failed: {e})"
    ) from e


class DomainLike(Protocol):
    """Anything with `low`, `high`, `kinks`, `shape` and `margin`, such as
    `eqxrules.Domain`."""

    low: float
    high: float
    kinks: tuple[float, ...]
    shape: tuple[int, ...]
    margin: float


def _off_kinks(x: np.ndarray, kinks: tuple[float, ...], margin: float) -> np.ndarray:
    for k in kinks:
        near = np.abs(x - k) < margin
        x = np.where(near, k + np.where(x >= k, 2, -2) * margin, x)
    return x


@st.composite
def arrays(
    draw: st.DrawFn,
    domain: DomainLike,
    *,
    dtype: Any = jnp.float32,
    shape: tuple[int, ...] | None = None,
    off_kinks: bool = True,
    with_kinks: bool = False,
) -> jax.Array:
    """Arrays with elements in `[domain.low, domain.high]`.

    - `off_kinks`: keep every element at least `domain.margin` from every kink (for
        finite differences).
    - `with_kinks`: then overwrite leading elements with the kinks themselves, so
        boundary behaviour is exercised. Where there are more kinks than elements,
        a drawn run of consecutive kinks (wrapping round), so that every kink is
        reached across draws; `eqxrules.Domain.on_kinks` gives inputs holding every
        kink at once.
    """
    shape = domain.shape if shape is None else shape
    size = int(np.prod(shape))
    values = draw(
        st.lists(
            st.floats(
                domain.low, domain.high, allow_nan=False, allow_infinity=False, width=32
            ),
            min_size=size,
            max_size=size,
        )
    )
    x = np.asarray(values, np.float32).reshape(shape)
    if off_kinks:
        x = _off_kinks(x, domain.kinks, domain.margin)
    kinks = tuple(domain.kinks)
    if with_kinks and kinks and size:
        start = 0 if len(kinks) <= size else draw(st.integers(0, len(kinks) - 1))
        chosen = [kinks[(start + i) % len(kinks)] for i in range(min(size, len(kinks)))]
        flat = x.reshape(-1)
        flat[: len(chosen)] = chosen
        x = flat.reshape(shape)
    return jnp.asarray(x, dtype)


@st.composite
def inputs(
    draw: st.DrawFn,
    domain: Any,
    *,
    dtype: Any = jnp.float32,
    off_kinks: bool = True,
    with_kinks: bool = False,
) -> Any:
    """The input of a rule whose domain is `domain`: an array drawn with
    [`arrays`][] for a `Domain`, booleans for a `Mask` (of its shape), and for
    `Inputs` (a rule of several) an `eqxrules.Args` of one such input each."""
    if hasattr(domain, "domains"):  # `eqxrules.Inputs`
        return Args(
            draw(inputs(d, dtype=dtype, off_kinks=off_kinks, with_kinks=with_kinks))
            for d in domain.domains
        )
    if getattr(domain, "boolean", False):  # `eqxrules.Mask`
        size = int(np.prod(domain.shape))
        flags = draw(st.lists(st.booleans(), min_size=size, max_size=size))
        return jnp.asarray(np.asarray(flags, bool).reshape(domain.shape))
    return draw(arrays(domain, dtype=dtype, off_kinks=off_kinks, with_kinks=with_kinks))


@st.composite
def pytrees(
    draw: st.DrawFn, domain: DomainLike, *, dtype: Any = jnp.float32
) -> dict[str, Any]:
    """A small dict-and-tuple pytree of arrays drawn with [`arrays`][], plus a string
    and an int leaf that rules must pass through untouched."""
    a = draw(arrays(domain, dtype=dtype))
    b = draw(arrays(domain, dtype=dtype, shape=(2,)))
    c = draw(arrays(domain, dtype=dtype, shape=()))
    return {"a": a, "nested": (b, {"c": c}), "name": "leaf", "count": 3}


@st.composite
def mlps(
    draw: st.DrawFn,
    *,
    in_size: int | None = None,
    max_width: int = 8,
    max_depth: int = 3,
    activation: Any = jnp.tanh,
) -> eqx.nn.MLP:
    """A small `eqx.nn.MLP` with random sizes and weights (smooth `tanh` activation
    by default, so finite differences apply)."""
    in_size = draw(st.integers(1, 5)) if in_size is None else in_size
    out_size = draw(st.integers(1, 4))
    width = draw(st.integers(1, max_width))
    depth = draw(st.integers(0, max_depth))
    seed = draw(st.integers(0, 2**31 - 1))
    return eqx.nn.MLP(
        in_size, out_size, width, depth, activation=activation, key=jax.random.key(seed)
    )
