"""Pytree helpers for tests of rules: random, zero and cast trees shaped like others,
stacking, and comparisons that name the leaf where two trees differ.

Host arrays are built with NumPy and moved to the device as they are: an eager JAX
operation on a new shape is a compilation, which a suite of small tests pays for
many times over.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np


def is_none(x: Any) -> bool:
    return x is None


def is_inexact(leaf: Any) -> bool:
    """A floating-point array (JAX or NumPy) or `jax.ShapeDtypeStruct`."""
    dtype = getattr(leaf, "dtype", None)
    return (
        isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))
        and dtype is not None
        and jnp.issubdtype(dtype, jnp.inexact)
    )


def random_like(seed: int, tree: Any) -> Any:
    """Standard-normal arrays shaped like the floating-point leaves of `tree`
    (arrays or shapes), `None` elsewhere."""
    rng = np.random.default_rng(seed)
    leaves, treedef = jtu.tree_flatten(tree)
    return jtu.tree_unflatten(
        treedef,
        [
            jnp.asarray(rng.standard_normal(leaf.shape).astype(leaf.dtype))
            if is_inexact(leaf)
            else None
            for leaf in leaves
        ],
    )


def _zeros(a: Any) -> jax.Array:
    return jnp.asarray(np.zeros(a.shape, a.dtype))


def zeros_like(tree: Any) -> Any:
    """`tree` with zeros for its floating-point leaves; other leaves unchanged."""
    return jtu.tree_map(lambda a: _zeros(a) if is_inexact(a) else a, tree)


def fill(tree: Any, like: Any) -> Any:
    """`tree`, with every `None` (in place of a leaf or a whole subtree of `like`)
    expanded to zeros for the floating-point arrays of `like` and `None` for the
    rest: the structure `eqx.filter_grad` gives."""

    def expand(t, lk):
        if t is not None:
            return t
        return jtu.tree_map(lambda a: _zeros(a) if is_inexact(a) else None, lk)

    return jtu.tree_map(expand, tree, like, is_leaf=is_none)


def cast(tree: Any, dtype: Any) -> Any:
    """`tree` with its floating-point leaves in `dtype`."""
    return jtu.tree_map(
        lambda a: jnp.asarray(np.asarray(a).astype(dtype)) if is_inexact(a) else a,
        tree,
    )


def stack(trees: Sequence[Any], where: Callable[[Any], bool] = eqx.is_array) -> Any:
    """Leaves for which `where` holds stacked on a new leading axis; the others
    taken from the first tree."""
    return jtu.tree_map(
        lambda *xs: (
            jnp.asarray(np.stack([np.asarray(x) for x in xs]))
            if where(xs[0])
            else xs[0]
        ),
        *trees,
    )


def sum_trees(trees: Sequence[Any]) -> Any:
    """The leafwise sum of `trees`, accumulated in float64, in the first's dtypes."""
    return jtu.tree_map(
        lambda *xs: np.sum([np.asarray(x, np.float64) for x in xs], axis=0).astype(
            xs[0].dtype
        ),
        *trees,
    )


def first_slice(tree: Any) -> Any:
    """Element 0 along the leading axis of every array leaf."""
    return jtu.tree_map(lambda a: np.asarray(a)[0] if eqx.is_array(a) else a, tree)


def assert_trees_close(
    actual: Any,
    expected: Any,
    what: str,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    exact: bool = False,
) -> None:
    """Same structure, shapes and dtypes; values within tolerance (NaN where the
    other has NaN), or bit for bit with `exact`. Failures name `what` and the
    leaf's path."""
    a_leaves, a_def = jtu.tree_flatten_with_path(actual, is_leaf=is_none)
    e_leaves, e_def = jtu.tree_flatten_with_path(expected, is_leaf=is_none)
    assert a_def == e_def, f"{what}: structure {a_def} differs from {e_def}"
    for (path, a), (_, e) in zip(a_leaves, e_leaves):
        where = f"{what}{jtu.keystr(path)}"
        if not eqx.is_array(a) or not eqx.is_array(e):
            assert a == e if a is not None else e is None, f"{where}: {a!r} != {e!r}"
            continue
        assert a.shape == e.shape, f"{where}: shape {a.shape} != {e.shape}"
        assert a.dtype == e.dtype, f"{where}: dtype {a.dtype} != {e.dtype}"
        if a.dtype == jax.dtypes.float0:
            continue
        an, en = np.asarray(a), np.asarray(e)
        if exact:
            assert an.tobytes() == en.tobytes(), f"{where}: not bit-identical"
        else:
            np.testing.assert_allclose(
                an.astype(np.float64),
                en.astype(np.float64),
                rtol=rtol,
                atol=atol,
                equal_nan=True,
                err_msg=where,
            )


def assert_finite(tree: Any, what: str) -> None:
    for path, a in jtu.tree_flatten_with_path(tree)[0]:
        if is_inexact(a):
            assert np.all(np.isfinite(np.asarray(a, np.float64))), (
                f"{what}{jtu.keystr(path)}: not finite: {a}"
            )


def assert_zero(tree: Any, what: str) -> None:
    for path, a in jtu.tree_flatten_with_path(tree)[0]:
        assert not np.any(np.asarray(a)), f"{what}{jtu.keystr(path)}: {a}"


__all__ = [
    "assert_finite",
    "assert_trees_close",
    "assert_zero",
    "cast",
    "fill",
    "first_slice",
    "is_inexact",
    "is_none",
    "random_like",
    "stack",
    "sum_trees",
    "zeros_like",
]
