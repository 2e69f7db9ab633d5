"""Hypothesis strategies for checking rules: arrays in a domain (off its kinks, or
with the extremes of the dtype's range mixed in), the inputs of a rule of one or
several (a structured domain's drawn through its own `sample` and `extremes`),
pytrees of arrays, and small `eqx.nn.MLP`s.

Needs the `test` extra (`hypothesis`)."""

from __future__ import annotations

from typing import Any, Protocol

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._args import Args
from ._extremes import extreme_values

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
    `eqxrules.Domain` (whose `structured` ones, drawing their own `sample`, are
    drawn through it by `inputs`)."""

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
    extremes: bool = False,
) -> jax.Array:
    """Arrays with elements in `[domain.low, domain.high]`.

    - `off_kinks`: keep every element at least `domain.margin` from every kink (for
        finite differences).
    - `with_kinks`: then overwrite leading elements with the kinks themselves, so
        boundary behaviour is exercised. Where there are more kinks than elements,
        a drawn run of consecutive kinks (wrapping round), so that every kink is
        reached across draws; `eqxrules.Domain.on_kinks` gives inputs holding every
        kink at once.
    - `extremes`: then overwrite a drawn set of elements with the extremes of
        `dtype`'s range, with the signs `[low, high]` allows: `±1e30`, `±1e-30`, a
        quarter of the largest finite value (for float32), `±inf`; and sometimes a
        whole slice along the last axis with `-inf` (a masked row).
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
    if extremes:
        x = draw(_with_extremes(x, domain, dtype))
    return jnp.asarray(x, dtype)


@st.composite
def _with_extremes(draw: st.DrawFn, x: np.ndarray, domain: Any, dtype: Any) -> Any:
    """`x` with a drawn set of its elements made extremes, and perhaps a masked
    row (see `arrays`)."""
    values = extreme_values(domain.low, domain.high, dtype)
    if not values or not x.size:
        return x
    picks = st.one_of(st.none(), st.sampled_from(values))
    chosen = draw(st.lists(picks, min_size=x.size, max_size=x.size))
    out = np.asarray(x, np.float64).copy()
    flat = out.reshape(-1)
    for i, v in enumerate(chosen):
        if v is not None:
            flat[i] = v
    if domain.low < 0 and out.ndim and draw(st.booleans()):
        out[(0,) * (out.ndim - 1)] = -np.inf  # a masked row
    return out


@st.composite
def inputs(
    draw: st.DrawFn,
    domain: Any,
    *,
    dtype: Any = jnp.float32,
    off_kinks: bool = True,
    with_kinks: bool = False,
    extremes: bool = False,
) -> Any:
    """The input of a rule whose domain is `domain`: an array drawn with
    [`arrays`][] for a box `Domain`, booleans for a `Mask` (of its shape), for
    `Inputs` (a rule of several) an `eqxrules.Args` of one such input each, and
    for a structured domain (one that draws its own `sample`: symmetric or
    positive definite matrices, integers, the simplex) its `sample` at a drawn
    key. With `extremes`, a box's elements may be the dtype's extremes (see
    [`arrays`][]), a mask may be all `False` (every element masked), and a
    structured domain's input may be one of its own `extremes`."""
    kw = dict(
        dtype=dtype, off_kinks=off_kinks, with_kinks=with_kinks, extremes=extremes
    )
    if hasattr(domain, "domains"):  # `eqxrules.Inputs`
        return Args(draw(inputs(d, **kw)) for d in domain.domains)
    if getattr(domain, "boolean", False):  # `eqxrules.Mask`
        size = int(np.prod(domain.shape))
        flags = draw(st.lists(st.booleans(), min_size=size, max_size=size))
        if extremes and draw(st.booleans()):
            flags = [False] * size  # every element masked
        return jnp.asarray(np.asarray(flags, bool).reshape(domain.shape))
    if getattr(domain, "structured", False):  # draws its own
        key = jax.random.key(draw(st.integers(0, 2**31 - 1)))
        own = domain.extremes(key, dtype) if extremes else []
        pick = draw(st.integers(0, len(own)))
        return domain.sample(key, dtype) if pick == len(own) else own[pick][1]
    return draw(arrays(domain, **kw))


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
