"""[`Domain`][]: where a rule's test inputs come from, for `python -m eqxrules`, the
test suite and [`eqxrules.verify_rule`][]: random points, points that hold every
kink, and the degenerate inputs where a rule that reduces over an axis goes wrong."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray


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
    """

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

    def on_kinks(self, key: PRNGKeyArray, dtype: Any = jnp.float32) -> list[Array]:
        """Random inputs of `self.shape` that together hold every kink exactly
        once: with `n` elements per input, the `i`-th holds kinks `i n` to
        `(i + 1) n - 1` in its leading elements, the rest drawn from `[low, high]`.
        One input (without a kink) if there are none. However many kinks a rule
        declares, each is evaluated exactly, at the shape the rule declares."""
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
        with its references there as anywhere: where they are finite, so is it."""
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


__all__ = ["Domain"]
