r"""[`quantized_ragged_dot`][eqxrules.quantized_ragged_dot]: `lax.ragged_dot`, the
grouped product of Mixture-of-Experts layers, on the quantised core (`core.Bilinear`
with a `RaggedDot` operation)."""

from __future__ import annotations

import functools as ft
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jaxtyping import Array, Float, Int, PRNGKeyArray

from . import segments
from .dot import check_call, run
from .ops import DotGeneral, Flat, Join, Op, Operand, pad_axis
from .recipes import Recipe

_NAME = "quantized_ragged_dot"
_F32 = jnp.float32


class RaggedDot(Op):
    """`lax.ragged_dot(a, b, group_sizes)` (`role="fwd"`), float32 output: `a`
    `[m, k]` (its rows in consecutive groups), `b` `[g, k, n]` (one matrix per
    group); or one of its gradient products, `role="dx"` (`(ȳ, b) -> ā`) or
    `"dw"` (`(a, ȳ) -> b̄`), `lax`'s own transposes. Each is batched by
    `contraction`'s rule (JAX has none for them)."""

    role: str = "fwd"
    like: Array | None = None

    def __call__(
        self, a: Array, b: Array, *extras: Array, precision: Any = None
    ) -> Array:
        (group_sizes,) = extras
        return contraction(self.role, precision)(a, b, group_sizes, self.like)

    def operands(self) -> tuple[Operand, Operand]:
        if self.role == "fwd":
            # Each group's rows a tensor of their own, blocked along k; each
            # group's matrix its own, blocked along k, paired with n (square
            # blocks).
            # Each output reads all of k of its row and its group's matrix: whole
            # blocks (`Operand.whole`), as in every role.
            return (
                Operand((1,), (), segmented=0, whole=True),
                Operand((1,), (2,), independent=(0,), whole=True),
            )
        if self.role == "dx":  # ȳ_i b_iᵀ: along n
            return (
                Operand((1,), (), segmented=0, whole=True),
                Operand((2,), (1,), independent=(0,), whole=True),
            )
        # a_iᵀ ȳ_i: along group i's rows, each group's own.
        return (
            Operand((0,), (1,), segmented=0, whole=True),
            Operand((0,), (1,), segmented=0, whole=True),
        )

    def transpose(self, role: str, like: Any) -> RaggedDot:
        return RaggedDot(role, like, name=self.name)

    def flat(self, multiple: int) -> Flat:
        if self.role == "dw":
            # Each group's rows from row 0, padded with zeros to the block: the
            # padding stays in each group's contraction, `[g, P, k]ᵀ [g, P, n]`.
            def per_group(v: Array, extras: tuple[Array, ...]) -> Array:
                return segments.segment(v, 0, extras[0], multiple)[0]

            op = DotGeneral(
                (((1,), (1,)), ((0,), (0,))), (3, 3), independent=True, name=self.name
            )
            return Flat((per_group, per_group), op)
        # Along k (fwd) or n (dx): both operands padded there.
        axes = (1, 1) if self.role == "fwd" else (1, 2)
        return Flat(
            (
                lambda v, extras: pad_axis(v, axes[0], multiple),
                lambda v, extras: pad_axis(v, axes[1], multiple),
            ),
            self,
        )

    def _rows(self) -> Join:
        return Join(self, frozenset("ay"), _fold, _unfold, _joined_sizes)


def _contract(
    role: str, precision: Any, lhs: Array, rhs: Array, sizes: Array, like: Any
) -> Array:
    """Product `role` of `lax.ragged_dot` on one problem, as `lax` computes it (its
    transposes are `lax`'s own, taken at `like`, the primal whose cotangent the
    product gives)."""

    def forward(a: Array, b: Array) -> Array:
        return jax.lax.ragged_dot(
            a, b, sizes, precision=precision, preferred_element_type=_F32
        )

    if role == "fwd":
        return forward(lhs, rhs)
    if role == "dx":  # ȳ_i b_iᵀ: a ragged product itself (`lax`'s transpose)
        return forward(lhs, jnp.swapaxes(rhs, 1, 2))
    return jax.vjp(lambda b: forward(lhs, b), like)[1](rhs)[0]


@ft.cache
def contraction(role: str, precision: Any = None) -> Any:
    """`_contract(role, ...)` with a batching rule: a batch of ragged products is
    one, its rows reordered. With one `b` for the batch (fwd, dx), group `i` takes
    every example's rows of group `i`; otherwise (a `b` per example, or the weight
    gradient, which is per example) each example's group is a group of its own."""

    @custom_vmap
    def run(lhs: Array, rhs: Array, sizes: Array, like: Any) -> Array:
        return _contract(role, precision, lhs, rhs, sizes, like)

    @run.def_vmap
    def rule(size: int, in_batched: Any, lhs, rhs, sizes, like):
        lhs_b, rhs_b, sizes_b, like_b = in_batched

        def batched(v: Any, b: Any) -> Any:
            return v if v is None or b else jnp.broadcast_to(v, (size, *v.shape))

        lhs, sizes = batched(lhs, lhs_b), batched(sizes, sizes_b)
        rows = lhs.shape[1]
        shared = role != "dw" and not rhs_b
        order = _order(rows, sizes, group_major=shared)

        def sort(v: Array) -> Array:
            return v.reshape(-1, *v.shape[2:])[order]

        def flat(v: Array) -> Array:
            return v.reshape(-1, *v.shape[2:])

        # `like` is `a` (rows, as `lhs`) for dx, `b` (a matrix per group) for dw.
        if shared:
            like = like if like is None else sort(batched(like, like_b))
            out = run(sort(lhs), rhs, jnp.sum(sizes, axis=0), like)
        elif role == "dw":
            rhs, like = batched(rhs, rhs_b), flat(batched(like, like_b))
            out = run(sort(lhs), sort(rhs), sizes.reshape(-1), like)
            return out.reshape(size, -1, *out.shape[1:]), True
        else:
            like = like if like is None else sort(batched(like, like_b))
            rhs = flat(batched(rhs, rhs_b))
            out = run(sort(lhs), rhs, sizes.reshape(-1), like)
        back = jnp.zeros_like(out).at[order].set(out)
        return back.reshape(size, rows, *out.shape[1:]), True

    return run


def _order(rows: int, group_sizes: Array, group_major: bool = True) -> Array:
    """The rows of a batch of ragged products (`group_sizes` `[B, g]`, `rows`
    each), flattened, in the order of one ragged product on all of them: by
    group, then example (`group_major`: each group of the one product holds every
    example's rows of that group), or by example, then group (each example's group
    a group of its own); within each, in order. Rows past every group last."""
    batch, groups = group_sizes.shape
    ends = jnp.cumsum(group_sizes, axis=1)
    r = jnp.arange(rows)
    group = jax.vmap(lambda e: jnp.searchsorted(e, r, side="right"))(ends)
    example = jnp.arange(batch)[:, None]
    if group_major:
        rank = group * (batch * rows) + example * rows + r[None, :]
    else:
        joint = jnp.where(group < groups, example * groups + group, batch * groups)
        rank = joint * (batch * rows) + example * rows + r[None, :]
    return jnp.argsort(rank.reshape(-1))


def _fold(v: Array, kind: str, extras: tuple[Array, ...]) -> Array:
    order = _order(v.shape[1], extras[0])
    return v.reshape(-1, *v.shape[2:])[order]


def _unfold(v: Array, kind: str, extras: tuple[Array, ...], size: int) -> Array:
    order = _order(v.shape[0] // size, extras[0])
    out = jnp.zeros_like(v).at[order].set(v)
    return out.reshape(size, -1, *v.shape[1:])


def _joined_sizes(extras: tuple[Array, ...]) -> tuple[Array, ...]:
    return (jnp.sum(extras[0], axis=0),)


def _check(lhs: Any, rhs: Any, group_sizes: Any) -> Array:
    """The shapes and dtypes of `quantized_ragged_dot`'s arguments, as
    `lax.ragged_dot` needs them; `group_sizes` as int32."""
    name = _NAME
    lhs_shape, rhs_shape = tuple(jnp.shape(lhs)), tuple(jnp.shape(rhs))
    if len(rhs_shape) != 3:
        raise ValueError(
            f"`{name}`: `rhs` (shape {rhs_shape}) must be 3-D, `[g, k, n]`: one "
            "`[k, n]` matrix per group."
        )
    if len(lhs_shape) != 2 or lhs_shape[1] != rhs_shape[1]:
        raise ValueError(
            f"`{name}`: `lhs` (shape {lhs_shape}) must be `[m, k]` with k = "
            f"{rhs_shape[1]}, the length of axis 1 of `rhs` (shape {rhs_shape})."
        )
    dtype = getattr(group_sizes, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(
            f"`{name}`: `group_sizes` (={_shown(group_sizes)}) must be an array of "
            "integers, the number of rows of `lhs` in each group."
        )
    if tuple(jnp.shape(group_sizes)) != (rhs_shape[0],):
        raise ValueError(
            f"`{name}`: `group_sizes` (shape {tuple(jnp.shape(group_sizes))}) must "
            f"have one entry per group of `rhs` (shape {rhs_shape}): shape "
            f"({rhs_shape[0]},)."
        )
    return jnp.asarray(group_sizes, jnp.int32)


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def quantized_ragged_dot(
    lhs: Float[Array, "m k"],
    rhs: Float[Array, "g k n"],
    group_sizes: Int[Array, " g"],
    *,
    recipe: Recipe,
    key: PRNGKeyArray | None = None,
    axis_name: Hashable | tuple[Hashable, ...] | None = None,
) -> Float[Array, "m n"]:
    r"""`jax.lax.ragged_dot(lhs, rhs, group_sizes)`, a Mixture-of-Experts layer's
    grouped product, with each operand of each of its three products, forward and
    backward, quantised as `recipe` says.

    The rows of `lhs` come in $g$ consecutive groups, group $i$ the
    $s_i$ = `group_sizes[i]` rows from $o_i = \sum_{j < i} s_j$ (an expert's
    tokens); they are multiplied by `rhs[i]` (that expert's weight). With
    $a_i$ = `lhs[o_i : o_i + s_i]`, $b_i$ = `rhs[i]` and $\bar y_i$ the cotangent's
    rows of group $i$:

    $$y_i = Q^{\mathrm{fwd}}(a_i)\, Q^{\mathrm{fwd}}(b_i), \qquad
    \bar a_i = Q^{\mathrm{dx}}(\bar y_i)\, Q^{\mathrm{dx}}(b_i)^{\top}, \qquad
    \bar b_i = Q^{\mathrm{dw}}(a_i)^{\top}\, Q^{\mathrm{dw}}(\bar y_i).$$

    **The convention: it is the loop over groups of
    [`quantized_dot_general`][eqxrules.quantized_dot_general].** Each group's rows
    are a tensor of their own, and so is each group's matrix:

    - per-tensor scales are per group (a group's rows are scaled by their own
        amax, never another group's);
    - the forward and input-gradient products block along $k$ and $n$ within
        each row (a length their blocks do not divide is padded with zeros in
        the quantiser's call, as for `quantized_dot_general`);
    - the weight-gradient product's blocks run along group $i$'s rows, which are
        padded with zeros at that group's end to a multiple of the block: a block
        never straddles two groups. With a random Hadamard transform
        (`recipes.nvfp4()`), the rotation runs along the same padded rows, and
        each group's padded contraction is $\bar b_i$;
    - stochastic rounding and the Hadamard signs draw for group $i$ (its rows,
        laid out from row 0, or its matrix) with `fold_in(k, i)` of each key $k$
        the product's operands take (`quantized_dot_general`'s).

    Rows past $\sum_i s_i$ belong to no group: their output and cotangent are
    zero, as for `lax.ragged_dot`. `group_sizes` may be traced (routing decides it
    at run time): one compiled program serves every split, empty groups
    included. With the identity recipe, the value and both cotangents are
    `lax.ragged_dot`'s and its VJP's, bit for bit (tested on the CPU).

    **Cost.** A quantiser with a scale per tensor (`fp8()`'s) or drawing random
    bits computes each group's scales and blocks on the group's rows laid out
    from row 0 (`[g, m, ·]`, zeros elsewhere), which is what XLA's CPU backend
    does for `lax.ragged_dot` itself (it computes the product densely over the
    groups). One with block scales alone (`mxfp8()`'s) needs no such layout: it
    quantises the rows in place where its blocks run along $k$ or $n$, and, for
    the weight gradient, the groups packed one after another, each from a
    multiple of the block ($m + g(B - 1)$ rows), with the same values. The products are `lax.ragged_dot` and its transposes, so a
    backend with a grouped kernel (a GPU's) runs them as such; a weight-gradient
    product with a Hadamard transform is a batched product over the groups'
    padded rows.

    **`vmap`** means `vmap` (each example its own call, its own `group_sizes`).
    With `axis_name` naming that `vmap`, the examples' rows join one call: group
    $i$ then holds every example's rows of group $i$ (example by example), so its
    scales and its weight-gradient blocks span the batch. A mapped `rhs` is then a
    `ValueError`. Under `jax.shard_map` over a mesh axis of that name, per-tensor
    scales span the devices (each group's own).

    Reverse mode only (`jax.grad`, `jax.vjp`); the derivative is not
    differentiated again.

    **Arguments:**

    - `lhs`: `[m, k]`, floating point, its rows sorted by group.
    - `rhs`: `[g, k, n]`, floating point.
    - `group_sizes`: `[g]`, integers summing to at most $m$.
    - `recipe`: an [`eqxrules.recipes.Recipe`][].
    - `key`: a PRNG key, required when the recipe rounds stochastically or
        rotates (a `TypeError` otherwise).
    - `axis_name`: `None`, or the name (or tuple of names) of mapped axes the
        products span, as for [`quantized_dot`][eqxrules.quantized_dot].

    **Returns:**

    `[m, n]`: row $r$ of group $i$ is $Q(a)_r\, Q(b_i)$.

    !!! Example

        ```python
        tokens = jax.random.normal(jax.random.key(0), (64, 32))
        experts = jax.random.normal(jax.random.key(1), (4, 32, 16)) / 6
        sizes = jnp.array([20, 0, 30, 14])
        y = eqxrules.quantized_ragged_dot(
            tokens, experts, sizes, recipe=eqxrules.recipes.mxfp8()
        )  # [64, 16]
        ```
    """
    operands = {"lhs": lhs, "rhs": rhs}
    products, random = check_call(_NAME, recipe, operands, key, axis_name)
    sizes = _check(lhs, rhs, group_sizes)
    op = RaggedDot(name=_NAME)
    return run(op, products, lhs, rhs, key, random, axis_name, (sizes,))


__all__ = ["quantized_ragged_dot"]
