"""The checker's arithmetic on the host: random tangents and cotangents drawn with
NumPy, zeros, and trees moved to the device as they are (an eager JAX operation on
a new shape compiles a program, which a check at small sizes pays for many times)."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PRNGKeyArray

from ._compare import _is_inexact, _is_none


def _entropy(key: PRNGKeyArray | None) -> list[int]:
    """The bits of a PRNG key (typed or raw `uint32`), to seed NumPy with."""
    if key is None:
        return [0, 0]  # the bits of `jax.random.key(0)`
    if jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return [int(b) for b in np.asarray(key).ravel()]


def _device(tree: Any) -> Any:
    """NumPy leaves of `tree` as JAX arrays (a transfer, no compiled program), so a
    rule never sees NumPy semantics; float0 leaves stay NumPy, as JAX has them."""

    def put(x: Any) -> Any:
        if isinstance(x, np.ndarray) and x.dtype != jax.dtypes.float0:
            return jax.device_put(x)
        return x

    return jtu.tree_map(put, tree)


def _random_like(rng: np.random.Generator, tree: Any) -> Any:
    """Standard-normal arrays, drawn on the host, shaped like the inexact leaves of
    `tree` (arrays or `jax.ShapeDtypeStruct`s); float0 zeros for the other array
    leaves; `None` elsewhere."""
    leaves, treedef = jtu.tree_flatten(tree, is_leaf=_is_none)
    out = []
    for leaf in leaves:
        if _is_inexact(leaf):
            x = rng.standard_normal(leaf.shape, dtype=np.float32)
            out.append(jax.device_put(x.astype(jnp.dtype(leaf.dtype))))
        elif eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):
            out.append(np.zeros(leaf.shape, jax.dtypes.float0))
        else:
            out.append(None)
    return jtu.tree_unflatten(treedef, out)


def _zeros_like(tree: Any) -> Any:
    return _device(jtu.tree_map(lambda x: np.zeros(x.shape, jnp.dtype(x.dtype)), tree))


def _fill(tree: Any, like: Any) -> Any:
    """`tree` aligned to `like` (whose leaves may be `None`), with `None` in `tree`
    standing for zeros of `like`'s leaf."""

    def fill(lk, t):
        if lk is None:
            return None
        if t is None:
            return jtu.tree_map(jnp.zeros_like, lk)
        return t

    return jtu.tree_map(fill, like, tree, is_leaf=_is_none)


def _scaled(tree: Any, scale: float) -> Any:
    """`tree` with its inexact leaves times `scale`, on the host, in their dtypes;
    every other leaf as it is."""
    if scale == 1.0:
        return tree

    def times(x: Any) -> Any:
        if not _is_inexact(x):
            return x
        a = np.asarray(x)
        return (a.astype(np.float64) * scale).astype(a.dtype)

    return _device(jtu.tree_map(times, tree))
