"""Call-time checks of a rule's inputs, shared by the rules: each raises a
`TypeError` or `ValueError` naming the rule, the argument and what must hold (deep
inside `jnp`, a bad input is an error naming neither)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def check_float_array(
    rule: str, args: tuple[Any, ...], hint: str = "", argument: str = "x"
) -> None:
    """Raise a `TypeError` naming `rule` and its input `argument` unless `args` is
    one floating-point array. Elementwise rules call it on every call; so may rules
    that reduce an axis.

    A list, tuple, string or `None` is rejected, not converted: `jnp`'s own
    functions take no lists either (`jnp.sin([1.0])` is a `TypeError`), and a
    rule's input is an array of one dtype. (A Python float is made an array
    before this check, as `jnp` makes one.)"""
    check_array(rule, args, hint, argument, "a floating-point array")
    dtype = jnp.result_type(args[0])
    if not jnp.issubdtype(dtype, jnp.inexact):
        raise TypeError(
            f"`{rule}` expects a floating-point array for `{argument}`, got dtype "
            f"{dtype}. Cast it first, e.g. `{argument}.astype(jnp.float32)`."
        )


def check_array(
    rule: str,
    args: tuple[Any, ...],
    hint: str = "",
    argument: str = "x",
    what: str = "an array",
) -> None:
    """Raise a `TypeError` naming `rule` and its input `argument` unless `args` is
    one array (or a number): not a list, tuple, string or `None`."""
    if len(args) != 1:
        raise TypeError(f"`{rule}` takes one array argument, got {len(args)}{hint}.")
    if not _is_array_like(args[0]):
        raise TypeError(
            f"`{rule}` expects {what} for `{argument}`, got {_described(args[0])}. "
            f"Convert it first, e.g. `jnp.asarray({argument})` (like `jnp`'s "
            "functions, a rule does not convert lists)."
        )


def _is_array_like(x: Any) -> bool:
    """An array, a NumPy scalar, a Python number or an object JAX converts
    (`__jax_array__`): what `jnp.sin` takes."""
    return isinstance(
        x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)
    ) or hasattr(x, "__jax_array__")


def _described(x: Any) -> str:
    """`x` as an error shows it: its type, and its value, shortened."""
    if x is None:
        return "None"
    shown = repr(x)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"a {type(x).__name__} ({shown})"


def check_axis(
    rule: str, axis: int | tuple[int, ...], shape: tuple[int, ...], argument: str
) -> None:
    """Raise a `ValueError` naming `rule`, `axis` and the shape unless every axis in
    `axis` indexes an array of `shape` (checked at call time: deep inside `jnp`, a
    bad axis is an error naming neither)."""
    axes = axis if isinstance(axis, tuple) else (axis,)
    if not all(-len(shape) <= a < len(shape) for a in axes):
        raise ValueError(
            f"`{rule}`: `axis` (={axis!r}) is out of range for `{argument}` of shape "
            f"{tuple(shape)}."
        )


def check_broadcasts(rule: str, argument: str, value: Any, x_shape: Any) -> None:
    """Raise a `ValueError` naming `rule` and `argument` unless `value` (a scale, a
    clipping level) broadcasts to `x` of shape `x_shape` without changing it."""
    shape = jnp.shape(value)
    try:
        ok = jnp.broadcast_shapes(x_shape, shape) == tuple(x_shape)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"`{rule}`: `{argument}` of shape {shape} must broadcast to `x` of shape "
            f"{tuple(x_shape)}."
        )


def check_key(name: str, key: Any, argument: str = "key") -> None:
    """Raise an error naming `name` and `argument` unless `key` is one PRNG key: a
    typed key (`jax.random.key(seed)`, dtype `key<...>`, shape `()`) or a legacy
    raw key (`jax.random.PRNGKey(seed)`: `uint32`, of the shape the default PRNG
    implementation's keys have, `(2,)` for threefry). Deep inside `jax.random`,
    anything else is JAX's "invalid PRNG key data" or "split accepts a single key",
    naming neither.

    A `TypeError` for what is not a key (another type or dtype, a `uint32` array
    of another shape); a `ValueError` for a batch of keys (`jax.random.split(key,
    4)`) where one is expected. The check reads dtype and shape only, so a traced
    key passes (under `jit`, and under `vmap` one key per example)."""
    dtype = getattr(key, "dtype", None)
    shape = getattr(key, "shape", None)
    if dtype is None or shape is None:
        shown = repr(key)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise TypeError(_not_a_key(name, argument, f"{type(key).__name__} (={shown})"))
    shape = tuple(shape)
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if shape == ():
            return
        raise ValueError(_batch_of_keys(name, argument, "typed key array", shape))
    raw = _raw_key_shape()
    if dtype == jnp.uint32 and shape[len(shape) - len(raw) :] == raw:
        if len(shape) == len(raw):
            return
        raise ValueError(
            _batch_of_keys(name, argument, "legacy uint32 key array", shape)
        )
    raise TypeError(
        _not_a_key(name, argument, f"an array of dtype {dtype} and shape {shape}")
    )


def _not_a_key(name: str, argument: str, got: str) -> str:
    raw = "".join(f"[{n}]" for n in _raw_key_shape())
    return (
        f"`{name}`: `{argument}` must be a PRNG key, a typed key from "
        f"`jax.random.key(seed)` or a legacy uint32{raw} key from "
        f"`jax.random.PRNGKey(seed)`, not {got}."
    )


def _batch_of_keys(name: str, argument: str, what: str, shape: tuple) -> str:
    return (
        f"`{name}`: `{argument}` must be one PRNG key, not a batch of keys (a {what} "
        f"of shape {shape}, as `jax.random.split` gives): pass one, e.g. "
        f"`{argument}[0]`, or map the call over them with `jax.vmap`."
    )


def _raw_key_shape() -> tuple[int, ...]:
    """The shape of a legacy raw key of the default PRNG implementation (`(2,)` for
    threefry, `(4,)` for rbg)."""
    return _raw_key_shape_of(getattr(jax.config, "jax_default_prng_impl", None))


@functools.cache
def _raw_key_shape_of(implementation: Any) -> tuple[int, ...]:
    del implementation  # the cache's key: the shape follows the configured default
    return tuple(jax.eval_shape(jax.random.PRNGKey, 0).shape)
