"""Structured domains: inputs that a box `[low, high]` cannot describe, each written
on [`Domain`][]'s public protocol (`sample`, `project`, `degenerate`, `extremes`)
as a domain of one's own would be: symmetric and symmetric positive definite
matrices (whose tangents are symmetric), integer labels in a range, and
probability vectors on the simplex."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray

from ._domain import Domain
from .testing._extremes import magnitudes


def _symmetric(x: Any) -> Any:
    """`(x + xᵀ) / 2` over the last two axes (NumPy or JAX alike)."""
    return (x + x.swapaxes(-1, -2)) / 2


def _check_square(name: str, shape: tuple[int, ...]) -> None:
    if len(shape) < 2 or shape[-1] != shape[-2]:
        raise ValueError(
            f"`{name}`: `shape` (={tuple(shape)}) must end in two equal axes "
            "(square matrices, batched over any leading axes)."
        )


@dataclasses.dataclass(frozen=True)
class Symmetric(Domain):
    """Symmetric matrices (over the last two axes of `shape`), their entries in
    `[low, high]`; a tangent is symmetric too (`project` symmetrises it).

    **Arguments:**

    - `low`, `high`: the range of the entries.
    - `shape`: the shape of a test input, ending in two equal axes.
    """

    shape: tuple[int, ...] = (3, 3)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_square(type(self).__name__, self.shape)

    def sample(
        self, key: PRNGKeyArray, dtype: Any = jnp.float32, *, off_kinks: bool = True
    ) -> Array:
        """A random symmetric matrix: the symmetric part of one drawn uniformly
        (its entries, means of two in `[low, high]`, stay in it)."""
        x = np.asarray(
            jax.random.uniform(key, self.shape, minval=self.low, maxval=self.high)
        )
        return jnp.asarray(_symmetric(x), dtype)

    def project(self, t: Array) -> Array:
        """The symmetric part of `t`."""
        return _symmetric(t)

    def degenerate(
        self, key: PRNGKeyArray, dtype: Any = jnp.float32
    ) -> list[tuple[str, Array]]:
        """The zero matrix (where the range holds 0), a constant matrix (every
        entry seven tenths of the way from `low` to `high`: rank one), and one
        `inf` on the diagonal."""
        c = self.low + 0.7 * (self.high - self.low)
        pairs = []
        if self.low <= 0.0 <= self.high:
            pairs.append(("the zero matrix", np.zeros(self.shape)))
        pairs.append((f"a constant matrix (every entry {c:g})", np.full(self.shape, c)))
        with_inf = np.array(self.sample(key), np.float64)
        with_inf[(..., 0, 0)] = np.inf
        pairs.append(("one inf on the diagonal (the first entry)", with_inf))
        return [(what, jnp.asarray(x, dtype)) for what, x in pairs]

    def extremes(
        self, key: PRNGKeyArray, dtype: Any = jnp.float32
    ) -> list[tuple[str, Array]]:
        """A random symmetric matrix scaled so that its largest entry is `big`,
        `tiny` or a quarter of the dtype's largest (see `Domain.extremes`)."""
        x = np.asarray(self.sample(key), np.float64)
        unit = x / max(float(np.abs(x).max()), 1e-30)
        return [
            (
                f"a symmetric matrix of largest entry {m:.4g}",
                jnp.asarray(unit * m, dtype),
            )
            for m in magnitudes(dtype)
        ]


@dataclasses.dataclass(frozen=True)
class PositiveDefinite(Symmetric):
    """Symmetric positive definite matrices (over the last two axes of `shape`),
    their eigenvalues drawn from `[low, high]` (`0 < low`) in a random orthonormal
    basis; a tangent is symmetric (`project` symmetrises it), and a small step
    along one stays positive definite.

    **Arguments:**

    - `low`, `high`: the range of the eigenvalues, `0 < low < high`.
    - `shape`: the shape of a test input, ending in two equal axes.
    """

    low: float = 0.5
    high: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.low > 0:
            raise ValueError(
                f"`PositiveDefinite`: `low` (={self.low}) must be positive: it is "
                "the smallest eigenvalue drawn."
            )

    def _with_eigenvalues(self, key: PRNGKeyArray, eigenvalues: np.ndarray) -> Any:
        n = self.shape[-1]
        q, _ = np.linalg.qr(
            np.asarray(jax.random.normal(key, (*self.shape[:-2], n, n)))
        )
        a = (q * eigenvalues[..., None, :]) @ q.swapaxes(-1, -2)
        return _symmetric(a)

    def sample(
        self, key: PRNGKeyArray, dtype: Any = jnp.float32, *, off_kinks: bool = True
    ) -> Array:
        """`Q diag(λ) Qᵀ`: `Q` orthonormal at random, `λ` drawn from `[low, high]`
        one in each of `n` equal parts of it, in the middle half of its part: so
        that no two are closer than a quarter of a part's width. (A derivative
        through an eigendecomposition divides by their differences; eigenvalues
        that meet are a `degenerate` input of their own.)"""
        k_basis, k_values = jax.random.split(key)
        batch, n = self.shape[:-2], self.shape[-1]
        jitter = np.asarray(
            jax.random.uniform(k_values, (*batch, n), minval=0.25, maxval=0.75)
        )
        width = (self.high - self.low) / n
        values = self.low + (np.arange(n) + jitter) * width
        return jnp.asarray(self._with_eigenvalues(k_basis, values), dtype)

    def degenerate(
        self, key: PRNGKeyArray, dtype: Any = jnp.float32
    ) -> list[tuple[str, Array]]:
        """A nearly singular matrix (its smallest eigenvalue `low / 1000`), and a
        multiple of the identity (every eigenvalue equal: where a derivative
        through an eigendecomposition divides by their differences)."""
        batch, n = self.shape[:-2], self.shape[-1]
        values = np.broadcast_to(np.linspace(self.low, self.high, n), (*batch, n))
        values = values.copy()
        values[..., 0] = self.low / 1000
        c = (self.low + self.high) / 2
        identity = np.broadcast_to(c * np.eye(n), self.shape)
        return [
            (
                f"a nearly singular matrix (smallest eigenvalue {self.low / 1000:g})",
                jnp.asarray(self._with_eigenvalues(key, values), dtype),
            ),
            (f"{c:g} times the identity", jnp.asarray(identity, dtype)),
        ]

    def extremes(
        self, key: PRNGKeyArray, dtype: Any = jnp.float32
    ) -> list[tuple[str, Array]]:
        """A random input with its eigenvalues times `big` and times `tiny` (see
        `Domain.extremes`): positive definite still."""
        big, tiny, _ = magnitudes(dtype)
        x = np.asarray(self.sample(key), np.float64)
        return [
            (f"a positive definite matrix times {m:g}", jnp.asarray(x * m, dtype))
            for m in (big, tiny)
        ]


@dataclasses.dataclass(frozen=True)
class Integers(Domain):
    """Integer inputs, such as class labels: `int32`, uniform in `{low, ..., high}`
    (both included), whatever dtype is asked for. Not differentiated: the checks
    hold them as they are. The extremes are the range's ends.

    **Arguments:**

    - `low`, `high`: the smallest and largest value, integers, `low <= high`.
    - `shape`: the shape of a test input.
    """

    low: int = 0  # type: ignore[assignment]
    high: int = 9  # type: ignore[assignment]
    shape: tuple[int, ...] = (4,)

    def __post_init__(self) -> None:
        for name in ("low", "high"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(
                    f"`Integers`: `{name}` must be an int, not "
                    f"{type(value).__name__} (={value!r})."
                )
        if not self.low <= self.high:
            raise ValueError(
                f"`Integers`: `low` (={self.low}) must be at most `high` "
                f"(={self.high})."
            )

    def sample(
        self, key: PRNGKeyArray, dtype: Any = jnp.float32, *, off_kinks: bool = True
    ) -> Array:
        """Uniform integers in `{low, ..., high}`, `int32`."""
        return jax.random.randint(key, self.shape, self.low, self.high + 1, jnp.int32)

    def extremes(
        self, key: PRNGKeyArray, dtype: Any = jnp.float32
    ) -> list[tuple[str, Array]]:
        """Every element `low`, and every element `high`."""
        return [
            (f"every element {v} (`{n}`)", jnp.full(self.shape, v, jnp.int32))
            for n, v in (("low", self.low), ("high", self.high))
        ]


@dataclasses.dataclass(frozen=True)
class Simplex(Domain):
    """Probability vectors along `axis`: positive entries summing to 1. A tangent
    sums to 0 along `axis` (`project` removes its mean), so a small step along
    one stays on the simplex.

    **Arguments:**

    - `shape`: the shape of a test input.
    - `axis`: the axis along which the entries sum to 1.
    """

    low: float = 0.0
    high: float = 1.0
    shape: tuple[int, ...] = (4,)
    axis: int = -1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not -len(self.shape) <= self.axis < len(self.shape):
            raise ValueError(
                f"`Simplex`: `axis` (={self.axis}) is out of range for `shape` "
                f"{tuple(self.shape)}."
            )

    def _normalised(self, x: np.ndarray) -> np.ndarray:
        return x / x.sum(axis=self.axis, keepdims=True)

    def sample(
        self, key: PRNGKeyArray, dtype: Any = jnp.float32, *, off_kinks: bool = True
    ) -> Array:
        """`softmax` of standard-normal logits along `axis`: every entry well
        inside `(0, 1)`."""
        z = np.asarray(jax.random.normal(key, self.shape), np.float64)
        return jnp.asarray(self._normalised(np.exp(z)), dtype)

    def project(self, t: Array) -> Array:
        """`t` less its mean along `axis`."""
        return t - jnp.mean(t, axis=self.axis, keepdims=True)

    def degenerate(
        self, key: PRNGKeyArray, dtype: Any = jnp.float32
    ) -> list[tuple[str, Array]]:
        """The uniform distribution (every entry `1/n`)."""
        n = self.shape[self.axis]
        return [
            (
                f"the uniform distribution (every entry 1/{n})",
                jnp.full(self.shape, 1 / n, dtype),
            )
        ]

    def extremes(
        self, key: PRNGKeyArray, dtype: Any = jnp.float32
    ) -> list[tuple[str, Array]]:
        """A vertex (the first entry 1, the others 0: the simplex's boundary), and
        one next to it (the others `tiny`, see `Domain.extremes`)."""
        _, tiny, _ = magnitudes(dtype)
        index: list[int | slice] = [slice(None)] * len(self.shape)
        index[self.axis] = 0
        vertex = np.zeros(self.shape)
        vertex[tuple(index)] = 1.0
        near = np.full(self.shape, tiny)
        near[tuple(index)] = 1.0
        return [
            ("a vertex (the first entry 1, the others 0)", jnp.asarray(vertex, dtype)),
            (f"next to a vertex (the others {tiny:g})", jnp.asarray(near, dtype)),
        ]


__all__ = ["Integers", "PositiveDefinite", "Simplex", "Symmetric"]
