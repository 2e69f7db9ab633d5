"""The checks of the NaN-safe rules' tests (tests/test_safe*.py), each a function of
an implementation that returns the names of the checks it fails, so that a test
can run it on the rule (nothing fails) and on a naive formula or a planted defect
(what must fail does)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

TINY = float(jnp.finfo(jnp.float32).tiny)
F32_EPS = float(jnp.finfo(jnp.float32).eps)


def finite_zero(a) -> bool:
    return bool(np.all(np.asarray(a) == 0))


def single_where(value: Callable, slope: Callable, ok: Callable) -> Callable:
    """A custom JVP whose slope is `where(ok, slope(x), 0)`: one `where`, so the
    unselected `slope` is still evaluated (inf) and its derivative meets a zero
    cotangent in reverse-over-reverse (0 * inf = NaN)."""

    @jax.custom_jvp
    def f(x):
        return value(x)

    @f.defjvp
    def _(primals, tangents):
        (x,), (t,) = primals, tangents
        return f(x), t * jnp.where(ok(x), slope(x), 0.0)

    return f


SECOND_ORDER = ("hessian", "jacrev(jacrev)")


def derivatives(f: Callable) -> dict[str, Callable]:
    """`f`'s Jacobian in both modes, and the Hessian of its sum forward over reverse
    and reverse over reverse."""

    def loss(x):
        return jnp.sum(f(x))

    return {
        "jacfwd": jax.jacfwd(f),
        "jacrev": jax.jacrev(f),
        "hessian": jax.hessian(loss),
        "jacrev(jacrev)": jax.jacrev(jax.jacrev(loss)),
    }


def singular_failures(f: Callable, x: jax.Array, value) -> set[str]:
    """Which checks `f` fails at `x`, a point of the singular set: the value there
    (bit for bit); every derivative finite and 0 (the convention) in forward mode,
    reverse mode, `hessian` and `jacrev(jacrev)`, eager, jitted and under `vmap`,
    the modes agreeing."""
    failed = set()
    if not np.array_equal(np.asarray(f(x)), np.asarray(value, np.float32)):
        failed.add("value")
    ds = derivatives(f)
    # Jitted and jitted under `vmap` as one program: one compilation, not eight.
    jitted, batched = jax.jit(
        lambda x, xs: (
            {name: d(x) for name, d in ds.items()},
            {name: jax.vmap(d)(xs) for name, d in ds.items()},
        )
    )(x, jnp.stack([x, x]))
    for name, d in ds.items():
        eager = d(x)
        if not finite_zero(eager):
            failed.add(name)
        if not np.array_equal(np.asarray(jitted[name]), np.asarray(eager)):
            failed.add(f"jit {name}")
        if not np.array_equal(np.asarray(batched[name][1]), np.asarray(eager)):
            failed.add(f"vmap {name}")
    return failed


def ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The float32 ulps between `a` and `b` (0 where both are the same infinity)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    far = np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32))
    return np.where(a == b, 0, far)


def away_failures(f: Callable, plain: Callable, x: jax.Array) -> set[str]:
    """Which checks `f` fails away from the singular set: the value within 4 ulps
    of `plain`'s (the same infinities where `plain` has one); each row of the
    Jacobian within 1e-5 of its largest entry of JAX's derivative of `plain`
    (`normalize`'s Jacobian cancels)."""
    failed = set()
    a, b = np.asarray(f(x)), np.asarray(plain(x))
    if not (np.all(np.isfinite(a) == np.isfinite(b)) and np.max(ulps(a, b)) <= 4):
        failed.add("value")
    j, jp = (np.asarray(jax.jacrev(g)(x)).reshape(a.size, x.size) for g in (f, plain))
    if not np.all(np.abs(j - jp) <= 1e-5 * np.max(np.abs(jp), axis=1, keepdims=True)):
        failed.add("derivative")
    return failed


def value_and_grads(f: Callable, *args) -> tuple[np.ndarray, ...]:
    """The value of `f(*args)` and its gradient in each argument (of a weighted
    sum, so that no cotangent is zero)."""
    grads = jax.grad(lambda *a: jnp.sum(f(*a) * jnp.cos(f(*a))), range(len(args)))(
        *args
    )
    return (np.asarray(f(*args)), *(np.asarray(g) for g in grads))
