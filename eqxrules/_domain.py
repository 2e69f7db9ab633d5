"""[`Domain`][]: where a rule's test inputs come from, for `python -m eqxrules`, the
test suite and [`eqxrules.verify_rule`][]: random points, points that hold every
kink, the degenerate inputs where a rule that reduces over an axis goes wrong, and
the extremes of the dtype's range. A rule of several inputs declares one per input
([`Inputs`][], [`Mask`][] for a boolean one), and its test inputs are [`Args`][].

`Domain` is a small public protocol: a structured domain (the symmetric and
positive definite matrices, integer labels, the simplex: `_structured`, or a
user's) subclasses it and overrides its public methods."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray

from .testing._args import Args as Args, call as call
from .testing._extremes import magnitudes


@dataclasses.dataclass(frozen=True)
class Domain:
    """Where a rule's inputs are drawn from in tests.

    A rule declares its own as a class variable, where the default (inputs of shape
    `(4, 3)` in `[-2, 2]`) does not fit:

    ```python
    domain: ClassVar[eqxrules.Domain] = eqxrules.Domain(low=0.0, high=6.0, shape=(4, 32))
    ```

    Its kinks come from the instance (`rule.kinks()`, through
    `rule.input_domain()`), and a range left at the default `[-2, 2]` is widened to
    cover them (see `with_kinks`). Keep `shape` to
    what the rule needs (a block size, say): the tests never enlarge it, but use
    several inputs of that shape where one cannot hold every kink.

    **Arguments:**

    - `low`, `high`: inputs are drawn uniformly from `[low, high]`.
    - `kinks`: points where the rule's derivative is discontinuous. Finite differences
        stay at least `margin` away from them; boundary checks evaluate exactly on
        every one of them (`on_kinks`).
    - `shape`: the shape of a test input.
    - `margin`: the distance kept from each kink when sampling off kinks.

    **The protocol.** `verify_rule` and the command line read a domain through
    these methods only, so a structured domain of your own subclasses `Domain`
    and overrides them (none is private):

    - `sample(key, dtype, *, off_kinks=True)`: one random input (required);
    - `project(t)`: a tangent `t` at an input, projected orthogonally onto the
        directions the input can move in (the identity by default; symmetrised
        for a symmetric matrix): random tangents are drawn through it, and
        cotangents compared through it (`check_rule`'s `tangent_space`);
    - `on_kinks(key, dtype)`: inputs holding every kink (by default, with no
        kinks, one `sample`);
    - `degenerate(key, dtype)` and `extremes(key, dtype)`: `(what, input)`
        pairs. A domain that draws its own `sample` gets none of the box's (a
        zero matrix is not positive definite) unless it overrides them.

    [`Symmetric`][eqxrules.Symmetric], [`PositiveDefinite`][eqxrules.PositiveDefinite],
    [`Integers`][eqxrules.Integers] and [`Simplex`][eqxrules.Simplex] are
    written so.
    """

    boolean: ClassVar[bool] = False  # a `Mask`: boolean inputs

    low: float = -2.0
    high: float = 2.0
    kinks: tuple[float, ...] = ()
    shape: tuple[int, ...] = (4, 3)
    margin: float = 0.05

    def __post_init__(self) -> None:
        if not self.low < self.high:
            raise ValueError(
                f"`Domain`: `low` (={self.low}) must be less than `high` "
                f"(={self.high})."
            )

    def with_kinks(self, kinks: Sequence[float]) -> Domain:
        """This domain with `kinks`. If its range is the default `[-2, 2]` (not
        declared), each side a finite kink lies beyond is moved past the farthest
        kink by a quarter of the range the kinks and `[-2, 2]` span together, so the
        inputs cover every kink and some way beyond: a ReLU6 with kinks 0 and 6 is
        sampled on `[-2, 8]`. A declared range is kept as it is."""
        kinks = tuple(float(k) for k in kinks)
        default = (type(self).low, type(self).high)
        finite = [k for k in kinks if math.isfinite(k)]
        low, high = self.low, self.high
        if (low, high) == default and finite:
            lo, hi = min(low, *finite), max(high, *finite)
            room = (hi - lo) / 4
            low = lo - room if lo < low else low
            high = hi + room if hi > high else high
        return dataclasses.replace(self, low=low, high=high, kinks=kinks)

    def _uniform(self, key: PRNGKeyArray) -> np.ndarray:
        x = jax.random.uniform(
            key, self.shape, jnp.float32, minval=self.low, maxval=self.high
        )
        return np.array(x)  # a writable copy

    def sample(
        self, key: PRNGKeyArray, dtype: Any = jnp.float32, *, off_kinks: bool = True
    ) -> Array:
        """A random input of `self.shape`. With `off_kinks`, no element lies within
        `margin` of a kink; otherwise the first kinks (as many as the input has
        elements) are written into its leading elements, so boundary behaviour is
        exercised. `on_kinks` gives inputs that hold
        every kink."""
        if not off_kinks:
            return self.on_kinks(key, dtype)[0]
        x = self._uniform(key)
        for k in self.kinks:
            near = np.abs(x - k) < self.margin
            x = np.where(near, k + np.where(x >= k, 1, -1) * self.margin * 2, x)
        return jnp.asarray(x, dtype=dtype)

    def project(self, t: Array) -> Array:
        """`t`, a tangent at an input, projected orthogonally onto the directions
        the input can move in: the identity for a box."""
        return t

    @property
    def structured(self) -> bool:
        """Whether this domain draws its own inputs (a subclass that overrides
        `sample`: a structured domain), so that the box's degenerate and extreme
        inputs, and the box's draws in `eqxrules.testing.strategies`, are not
        its."""
        return type(self).sample is not Domain.sample

    def on_kinks(self, key: PRNGKeyArray, dtype: Any = jnp.float32) -> list[Array]:
        """Random inputs of `self.shape` that together hold every kink exactly
        once: with `n` elements per input, the `i`-th holds kinks `i n` to
        `(i + 1) n - 1` in its leading elements, the rest drawn from `[low, high]`.
        One input, a `sample`, if there are none. However many kinks a rule
        declares, each is evaluated exactly, at the shape the rule declares."""
        if not self.kinks:
            return [self.sample(key, dtype)]
        size = math.prod(self.shape)
        count = max(1, -(-len(self.kinks) // size)) if size else 1
        inputs = []
        for i in range(count):
            x = self._uniform(key if i == 0 else jax.random.fold_in(key, i))
            flat = x.reshape(-1)
            batch = self.kinks[i * size : (i + 1) * size]
            flat[: len(batch)] = batch
            inputs.append(jnp.asarray(flat.reshape(self.shape), dtype=dtype))
        return inputs

    def degenerate(
        self, key: PRNGKeyArray, dtype: Any = jnp.float32
    ) -> list[tuple[str, Array]]:
        """`(what, input)` pairs of `self.shape` where a rule that reduces over an
        axis (a norm, a scale from a slice's mean or maximum) divides by zero or
        meets an infinity: all zeros, and (for two axes or more) the slice through
        the first element along every axis zero, the rest random (both only where
        `[low, high]` holds 0); a constant `c` (seven tenths of the way from `low`
        to `high`), and the slice through the first element along every axis `c`;
        and one `inf`, in the first element, the rest random. A rule must agree
        with its references there as anywhere: where they are finite, so is it.
        (None for a domain that draws its own `sample`, unless it overrides
        this.)"""
        if self.structured:
            return []
        k_zero, k_const, k_inf = jax.random.split(key, 3)
        c = self.low + 0.7 * (self.high - self.low)
        rank = len(self.shape)
        lines = np.zeros(self.shape, bool)
        for axis in range(rank):
            index: list[int | slice] = [0] * rank
            index[axis] = slice(None)
            lines[tuple(index)] = True
        pairs: list[tuple[str, np.ndarray]] = []
        if self.low <= 0.0 <= self.high:
            pairs.append(("an all-zero input", np.zeros(self.shape, np.float32)))
            if rank >= 2:
                zero_lines = np.where(lines, 0.0, self._uniform(k_zero))
                pairs.append(("an all-zero slice along every axis", zero_lines))
        pairs.append(
            (f"a constant input (every element {c:g})", np.full(self.shape, c))
        )
        if rank >= 2:
            const_lines = np.where(lines, c, self._uniform(k_const))
            pairs.append((f"a constant slice ({c:g}) along every axis", const_lines))
        with_inf = self._uniform(k_inf)
        with_inf.reshape(-1)[:1] = np.inf
        pairs.append(("a slice holding one inf (the first element)", with_inf))
        return [(what, jnp.asarray(x, dtype=dtype)) for what, x in pairs]

    def extremes(
        self, key: PRNGKeyArray, dtype: Any = jnp.float32
    ) -> list[tuple[str, Array]]:
        """`(what, input)` pairs of `self.shape` at the ends of `dtype`'s range, with
        the signs `[low, high]` allows (a range that holds no negative number gets
        none): every element `±big` (`1e30` for float32 and bfloat16), `±tiny`
        (`1e-30`) and a quarter of the largest finite value, in random signs;
        and, where negative numbers are allowed, one `-inf` (the first element)
        and a slice of `-inf` (through the first element, along the last axis:
        a masked row). A rule must agree with its references there as anywhere
        (where they are finite, so is it); an input where the reference value is
        finite nowhere is outside the rule's domain, and `verify_rule` skips it,
        saying so. (None for a domain that draws its own `sample`, unless it
        overrides this.)"""
        if self.structured:
            return []
        return [
            (what, jnp.asarray(x, dtype=dtype))
            for what, x in _box_extremes(self, key, dtype)
        ]


class Mask(Domain):
    """The domain of a boolean input (`safe_where`'s mask): random `True` and
    `False` of `shape`, whatever dtype is asked for (a mask stays boolean); no
    kinks. Its degenerate inputs are all `False` and all `True`.

    **Arguments:**

    - `shape`: the shape of a test input.
    """

    boolean: ClassVar[bool] = True

    def __init__(self, shape: tuple[int, ...] = (4, 3)) -> None:
        super().__init__(low=0.0, high=1.0, shape=tuple(shape))

    def sample(
        self, key: PRNGKeyArray, dtype: Any = jnp.float32, *, off_kinks: bool = True
    ) -> Array:
        """Random booleans, both values present where there are two elements."""
        flags = np.asarray(self._uniform(key) < 0.5).reshape(-1)
        if flags.size >= 2:
            flags[:2] = (True, False)
        return jnp.asarray(flags.reshape(self.shape))

    def on_kinks(self, key: PRNGKeyArray, dtype: Any = jnp.float32) -> list[Array]:
        """One random mask (a mask has no kinks)."""
        return [self.sample(key)]

    def degenerate(
        self, key: PRNGKeyArray, dtype: Any = jnp.float32
    ) -> list[tuple[str, Array]]:
        """Every element `False`, and every element `True`."""
        return [
            ("a mask of every element `False`", jnp.zeros(self.shape, bool)),
            ("a mask of every element `True`", jnp.ones(self.shape, bool)),
        ]


@dataclasses.dataclass(frozen=True, init=False)
class Inputs:
    """The domains of a rule's several inputs, by name, in the order `primal` takes
    them: a multi-input rule declares it as its `domain`,

    ```python
    domain: ClassVar = eqxrules.Inputs(a=eqxrules.Domain(), b=eqxrules.Domain(kinks=(0.0,)))
    ```

    and every test input is an [`Args`][] of one array per input, each drawn from
    its own domain (shapes may differ where the rule broadcasts). Kinks belong to
    the inputs (`kinks` is their union). At the kinks, each input holds its own
    while the others are drawn off theirs; the degenerate inputs are each input's
    own, the others drawn at random.
    """

    names: tuple[str, ...]
    domains: tuple[Domain, ...]

    def __init__(self, **domains: Domain) -> None:
        if len(domains) < 2 or not all(isinstance(d, Domain) for d in domains.values()):
            raise TypeError(
                "`Inputs`: give two or more inputs, each a `Domain` by name "
                f"(`Inputs(a=Domain(), b=Domain())`), not {domains!r}."
            )
        object.__setattr__(self, "names", tuple(domains))
        object.__setattr__(self, "domains", tuple(domains.values()))

    @property
    def kinks(self) -> tuple[float, ...]:
        """Every input's kinks together, sorted."""
        return tuple(sorted({k for d in self.domains for k in d.kinks}))

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape the inputs broadcast to (that of the output, elementwise).
        Inputs whose shapes do not broadcast (a matrix `W` of `(3, 4)` and a bias
        `b` of `(3,)`) have none: asking is a `ValueError` naming them; each
        input's own shape is `domains[i].shape`."""
        shapes = [d.shape for d in self.domains]
        try:
            return tuple(np.broadcast_shapes(*shapes))
        except ValueError:
            listed = ", ".join(
                f"`{n}` {tuple(s)}" for n, s in zip(self.names, shapes, strict=True)
            )
            raise ValueError(
                f"`Inputs`: the shapes of its inputs ({listed}) do not broadcast, "
                "so they have no common `shape`; each input's own is "
                "`domains[i].shape`."
            ) from None

    @property
    def margin(self) -> float:
        """The largest of the inputs' margins."""
        return max(d.margin for d in self.domains)

    def with_kinks(self, kinks: Sequence[float]) -> Inputs:
        """These inputs, whose kinks are their own: `kinks` must be none or theirs."""
        if set(kinks) - set(self.kinks):
            raise ValueError(
                f"`Inputs`: kinks {tuple(kinks)} are not those of its inputs "
                f"({self.kinks}); declare each in the domain of its input."
            )
        return self

    @property
    def varied(self) -> int:
        """The input a plot of the rule varies: the first with kinks, else the
        first that is not a [`Mask`][]."""
        with_kinks = [i for i, d in enumerate(self.domains) if d.kinks]
        floats = [i for i, d in enumerate(self.domains) if not isinstance(d, Mask)]
        return (with_kinks or floats)[0]

    def _keys(self, key: PRNGKeyArray) -> list[PRNGKeyArray]:
        return list(jax.random.split(key, len(self.domains)))

    def sample(
        self, key: PRNGKeyArray, dtype: Any = jnp.float32, *, off_kinks: bool = True
    ) -> Args:
        """One input of each domain (`Domain.sample`)."""
        return Args(
            d.sample(k, dtype, off_kinks=off_kinks)
            for d, k in zip(self.domains, self._keys(key), strict=True)
        )

    def on_kinks(self, key: PRNGKeyArray, dtype: Any = jnp.float32) -> list[Args]:
        """Inputs that together hold every input's kinks: the `i`-th has the `i`-th
        input of each `Domain.on_kinks` (the first again for an input with fewer)."""
        per = [d.on_kinks(k, dtype) for d, k in zip(self.domains, self._keys(key))]
        return [
            Args(xs[min(i, len(xs) - 1)] for xs in per)
            for i in range(max(len(xs) for xs in per))
        ]

    def degenerate(
        self, key: PRNGKeyArray, dtype: Any = jnp.float32
    ) -> list[tuple[str, Args]]:
        """Each input's degenerate inputs (`Domain.degenerate`), the other inputs
        drawn off their kinks; described with the input's name."""
        return self._each(key, dtype, lambda d, k: d.degenerate(k, dtype))

    def extremes(
        self, key: PRNGKeyArray, dtype: Any = jnp.float32
    ) -> list[tuple[str, Args]]:
        """Each input's extremes (`Domain.extremes`), the other inputs drawn off
        their kinks; described with the input's name."""
        return self._each(key, dtype, lambda d, k: d.extremes(k, dtype))

    def _each(
        self, key: PRNGKeyArray, dtype: Any, pairs: Any
    ) -> list[tuple[str, Args]]:
        k_base, k_own = jax.random.split(key)
        base = self.sample(k_base, dtype)
        out = []
        for i, (name, d) in enumerate(zip(self.names, self.domains, strict=True)):
            for what, x in pairs(d, jax.random.fold_in(k_own, i)):
                args = list(base)
                args[i] = x
                out.append((f"`{name}` {what}", Args(args)))
        return out

    def project(self, t: Args) -> Args:
        """Each input's tangent projected by its own domain (`Domain.project`)."""
        return Args(d.project(x) for d, x in zip(self.domains, t, strict=True))


def _box_extremes(
    d: Domain, key: PRNGKeyArray, dtype: Any
) -> list[tuple[str, np.ndarray]]:
    k_sign, k_inf, k_row = jax.random.split(key, 3)
    big, tiny, top = magnitudes(dtype)
    signed = d.low < 0 < d.high
    sign = 1.0 if d.low >= 0 else -1.0
    signs = np.full(d.shape, sign, np.float64)
    if signed:
        signs = np.where(np.asarray(jax.random.bernoulli(k_sign, 0.5, d.shape)), 1, -1)
    mark = "±" if signed else ("+" if sign > 0 else "-")
    name = jnp.dtype(dtype).name
    pairs = [
        (f"every element {mark}{big:g}", signs * big),
        (f"every element {mark}{tiny:g}", signs * tiny),
        (f"every element {mark}{top:.4g} (a quarter of {name}'s largest)", signs * top),
    ]
    if d.low < 0:
        with_inf = d._uniform(k_inf)
        with_inf.reshape(-1)[:1] = -np.inf
        pairs.append(("one -inf (the first element)", with_inf))
        if math.prod(d.shape) > 1:  # (a 1-D input is one slice: all of it)
            row = d._uniform(k_row)
            row[(0,) * (len(d.shape) - 1)] = -np.inf
            pairs.append(("a slice of -inf along the last axis (a masked row)", row))
    return pairs


__all__ = ["Args", "Domain", "Inputs", "Mask", "call"]
