"""How the checker compiles the rule and its references.

Compiling dominates a check. Within one `check_rule` call each function is traced
and compiled once per argument signature, like `jax.jit`. Across calls a compiled
program is reused only when the program is the same: the cache is keyed on what was
traced (the jaxpr's text, the bytes of its constants, the argument and output
structures, JAX's configuration), never on the Python function. The function is
traced afresh on every call, so a rule whose closure changed gives a new jaxpr and
a new program: the checker never reports on an old version of a rule. A program
whose behaviour its jaxpr's text does not pin down (a host callback, or any other
Python callable in an equation's parameters) is never shared.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np

_CACHE_SIZE = 64
_cache: collections.OrderedDict[tuple[Any, ...], tuple[Any, Any]] = (
    collections.OrderedDict()
)
"""Compiled programs by fingerprint, least recently used first. Each entry keeps
its jaxpr alive too, so that no object named in a key can be freed and its `id`
reused."""

# Callables in these primitives' parameters say how to differentiate them, which a
# traced program has already done: they play no part in lowering.
_DIFFERENTIATION_ONLY = frozenset({"custom_jvp_call", "custom_vjp_call"})


def _signature(args: tuple[Any, ...]) -> tuple[Any, ...]:
    leaves, treedef = jtu.tree_flatten(args)
    return treedef, tuple(
        (
            np.shape(x),
            str(getattr(x, "dtype", type(x).__name__)),
            bool(getattr(x, "weak_type", False)),
            getattr(x, "sharding", None) if isinstance(x, jax.Array) else None,
        )
        for x in leaves
    )


def _walk(closed: Any) -> tuple[list[Any], list[str]]:
    """The constants of `closed` and of every closed jaxpr nested in its equations'
    parameters, and the reprs of the meshes named there (which the jaxpr's text may
    leave out). Raises `_Unshareable` at any other Python callable in a parameter
    that lowering may use."""
    consts, meshes = list(closed.consts), []
    stack = [closed.jaxpr]
    while stack:
        jaxpr = stack.pop()
        for eqn in jaxpr.eqns:
            for value in eqn.params.values():
                for v in value if isinstance(value, (tuple, list)) else (value,):
                    if hasattr(v, "jaxpr") and hasattr(v, "consts"):
                        consts += v.consts
                        stack.append(v.jaxpr)
                    elif hasattr(v, "eqns"):
                        stack.append(v)
                    elif isinstance(v, _MESHES):
                        meshes.append(repr(v))
                    elif (
                        callable(v) and eqn.primitive.name not in _DIFFERENTIATION_ONLY
                    ):
                        raise _Unshareable
    return consts, meshes


_MESHES = (jax.sharding.Mesh, jax.sharding.AbstractMesh)


class _Unshareable(Exception):
    pass


def _digest(x: Any) -> tuple[Any, ...]:
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        # A typed PRNG key (a stochastic rule's, closed over): its bits and its
        # implementation (named by the dtype) pin it down.
        return ("key", str(dtype), *_digest(jax.random.key_data(x)))
    a = np.asarray(x)
    if a.dtype == object:
        raise _Unshareable
    return a.shape, a.dtype.str, hashlib.blake2b(a.tobytes(), digest_size=16).digest()


def _fingerprint(traced: Any, signature: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """What determines the compiled program, or `None` if it cannot be pinned down."""
    try:
        consts, meshes = _walk(traced.jaxpr)
        digests = tuple(_digest(c) for c in consts)
    except _Unshareable:
        return None
    except Exception:  # a constant NumPy cannot read (a PRNG key array, say)
        return None
    config = tuple(sorted((k, repr(v)) for k, v in jax.config.values.items()))
    return (
        str(traced.jaxpr),
        digests,
        tuple(meshes),
        signature,
        jtu.tree_structure(traced.out_info),
        config,
        jax.default_backend(),
    )


def _compiler_options() -> dict[str, Any]:
    """On the CPU, XLA's LLVM back end unoptimised (XLA's own passes still run):
    a checker's programs are small and run a few times, and compile in about half
    the time (verifying every entry's first example: 41 s against 46 s). As the
    test matrix does (`tests/matrix/harness.py`); the whole suite runs with it."""
    if jax.default_backend() == "cpu":
        return {"xla_backend_optimization_level": 0}
    return {}


class Program:
    def __init__(self, fun: Callable[..., Any]) -> None:
        self._jitted = jax.jit(fun)
        self._compiled: dict[tuple[Any, ...], Any] = {}
        self._lowered: dict[tuple[Any, ...], Any] = {}

    def _find(self, args: tuple[Any, ...]) -> tuple[Any, Any, Any]:
        """`(signature, fingerprint, compiled or None)`, tracing if need be."""
        signature = _signature(args)
        compiled = self._compiled.get(signature)
        if compiled is not None:
            return signature, None, compiled
        if signature in self._lowered:
            return signature, self._lowered[signature][1], None
        traced = self._jitted.trace(*args)
        key = _fingerprint(traced, signature)
        if key is not None and key in _cache:
            _cache.move_to_end(key)
            compiled = self._compiled[signature] = _cache[key][0]
            return signature, key, compiled
        self._lowered[signature] = (traced.lower(), key, traced.jaxpr)
        return signature, key, None

    def lower(self, *args: Any) -> None:
        """Trace and lower at `args` (unless already compiled), without compiling:
        what raises for forward mode through a `custom_vjp`."""
        self._find(args)

    def __call__(self, *args: Any) -> Any:
        signature, _, compiled = self._find(args)
        if compiled is None:
            lowered, key, jaxpr = self._lowered.pop(signature)
            compiled = lowered.compile(_compiler_options())
            self._compiled[signature] = compiled
            if key is not None:
                _cache[key] = (compiled, jaxpr)
                while len(_cache) > _CACHE_SIZE:
                    _cache.popitem(last=False)
        return compiled(*args)


def jit(fun: Callable[..., Any]) -> Program:
    """`fun`, compiled on first call for each argument signature, reusing a program
    compiled by an earlier `check_rule` call when the traced program is the same."""
    return Program(fun)
