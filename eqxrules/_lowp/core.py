r"""The quantised core: one custom VJP over a bilinear operation $y = f(a, b)$
(`lax.dot_general` with its dimension numbers, or `lax.conv_general_dilated`),
whose three products each quantise their operands as a recipe says.

$f$ is linear in each argument, so its two gradient products are its own
transposes, each evaluated on quantised operands:

$$y = f\big(Q^{\mathrm{fwd}}_a(a),\, Q^{\mathrm{fwd}}_b(b)\big), \qquad
\bar a = f(\cdot,\, Q^{\mathrm{da}}_b(b))^\top\, Q^{\mathrm{da}}_{\bar y}(\bar y),
\qquad
\bar b = f(Q^{\mathrm{db}}_a(a),\, \cdot)^\top\, Q^{\mathrm{db}}_{\bar y}(\bar y).$$

Each quantiser's blocks run along the dimensions of its operand that its product
contracts, which an operation (`Op`) derives from its dimension numbers
(`Op.blocked`). Several contracted dimensions are moved to the front, in the order
the product pairs them, and flattened row-major into one, blocked as one
(`quantise_along`). A contracted length that a block does not divide is padded with
zeros at the end (so the partial block is the last one) before quantising: zeros
change no block's scale, quantise to zero and add nothing, so the product is that of
the padded operands, bit for bit. Batch dimensions are never contracted, so never
blocked across.

A product of a contraction (`lax.dot_general`) whose recipe asks for a random
Hadamard transform (`Product.hadamard`), or whose contracted length its blocks do
not divide, is computed as one contraction of its flattened operands
(`_contracted`): both flattened and padded along what it contracts, rotated with
the same signs if asked, quantised, contracted, then laid out as the transpose lays
its result out. The padding stays in the sum, so the result is, bit for bit, that
of the padded operands. A convolution's product (not a contraction of its
operands) pads inside `quantise_along` and slices the padding off after quantising:
its values are those of the padded operands' quantisation, and the sum runs over
the real positions.

Each product is one compiled program eagerly (`product`), and under `jax.vmap`
(a `custom_vmap` rule, `_product`) one call on the whole batch: the mapped axis of
the left operand (the rows, which the weight-gradient product contracts) joins the
operation (`Op.with_mapped_lhs`), so that its blocks and any per-tensor scale see
every example, as when the function is called on the batch.
"""

from __future__ import annotations

import abc
import dataclasses
import functools as ft
import inspect
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.custom_batching import custom_vmap
from jaxtyping import Array, PRNGKeyArray

from .._catalogue import VJPRule
from .._rules.blocks import BlockQuantizer
from .hadamard import random_signs, rotate
from .recipes import Custom, Product

_F32 = jnp.float32

# The three products of an operation, by the argument whose value or cotangent
# they give: `fwd` = f(a, b); `da` contracts the cotangent with `b`; `db` the
# cotangent with `a`. Each takes (lhs, rhs, witness): its two operands, as the
# recipe's `Product.lhs` and `Product.rhs` name them, and the array whose shape
# (and sharding) its result has.
ROLES = ("fwd", "da", "db")


class Op(eqx.Module):
    """A bilinear operation `f(a, b)` and what the quantised core needs of it: which
    dimensions each product contracts, and how `vmap`'s mapped axis joins it. Data
    only (every field static), so that it keys compiled programs."""

    name: str = eqx.field(default="quantized_dot_general", kw_only=True)

    @abc.abstractmethod
    def __call__(self, a: Array, b: Array) -> Array:
        """`f(a, b)`, float32 operands and result."""

    @abc.abstractmethod
    def blocked(self, role: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The dimensions of the two operands of product `role` that it contracts
        and blocks, paired in order (the same length): in `fwd`, of `a` and `b`;
        in `da`, of the cotangent and `b`; in `db`, of `a` and the cotangent."""

    def square(self, role: str, side: int, q: BlockQuantizer) -> tuple[int, int]:
        """The two axes a quantiser with square blocks (`axis` a pair) covers on
        operand `side` (0, 1) of product `role`: its own `axis`, by default."""
        axis = q.axis
        assert isinstance(axis, tuple)
        return axis[0], axis[1]

    def hadamard_form(self, role: str) -> tuple[Any, tuple[int, ...], bool] | None:
        """How product `role` is computed as one contraction, for the Hadamard
        transform: `(dimension_numbers, permutation, swap)`, such that the product
        is `transpose(dot_general(*ops, dimension_numbers), permutation)` with
        `ops` its two operands (swapped if `swap`). `None` where the product is
        not a contraction of its operands (a convolution's)."""
        return None

    @abc.abstractmethod
    def with_mapped_lhs(self) -> Op:
        """The operation on `a` with one more leading axis (`vmap`'s mapped axis,
        at 0), joined to the rows: `a`'s free dimensions for a contraction, its
        batch for a convolution."""

    def with_mapped_both(self) -> Op | None:
        """The operation on `a` and `b` each with one more leading axis (`vmap`'s
        mapped axis, at 0), as one more batch dimension of both, or `None` where
        the operation has no batch dimension to add (a convolution: then each
        slice is its own product). The result, and each cotangent, has it at 0."""
        return None

    @abc.abstractmethod
    def fold(self, v: Array, what: str) -> Array:
        """`v` (`"a"` or `"y"`, the cotangent, as laid out under `vmap`: the mapped
        axis at 0) as the operation `with_mapped_lhs()` takes it."""

    @abc.abstractmethod
    def unfold(self, v: Array, what: str, size: int) -> Array:
        """The inverse of `fold`: the mapped axis (of length `size`) back at 0."""


def _remaining(n: int, *used: Sequence[int]) -> list[int]:
    taken = {int(d) for u in used for d in u}
    return [d for d in range(n) if d not in taken]


_Axes = tuple[int, ...]
DotNumbers = tuple[tuple[_Axes, _Axes], tuple[_Axes, _Axes]]


class DotGeneral(Op):
    """`lax.dot_general(a, b, dimension_numbers)`, float32 output."""

    dimension_numbers: DotNumbers
    ndims: tuple[int, int]

    def __call__(self, a: Array, b: Array) -> Array:
        return jax.lax.dot_general(
            a, b, self.dimension_numbers, preferred_element_type=_F32
        )

    def _dims(self) -> tuple[list[int], ...]:
        (ac, bc), (ab, bb) = self.dimension_numbers
        na, nb = self.ndims
        return (
            list(ac),
            list(bc),
            list(ab),
            list(bb),
            _remaining(na, ac, ab),
            (_remaining(nb, bc, bb)),
        )

    def _output(self) -> tuple[list[int], list[int]]:
        """The dimensions of `y` that are `a`'s free ones, and `b`'s."""
        _, _, ab, _, af, bf = self._dims()
        n = len(ab)
        return list(range(n, n + len(af))), list(
            range(n + len(af), n + len(af) + len(bf))
        )

    def blocked(self, role: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        ac, bc, _, _, af, bf = self._dims()
        ya, yb = self._output()
        if role == "fwd":
            return tuple(ac), tuple(bc)
        if role == "da":
            return tuple(yb), tuple(bf)
        return tuple(af), tuple(ya)

    def square(self, role: str, side: int, q: BlockQuantizer) -> tuple[int, int]:
        # The operand's contracted and free dimension, when it has one of each
        # beside its batch dimensions (a matrix, as a weight): in its own order.
        _, _, ab, bb, _, _ = self._dims()
        y_batch = list(range(len(ab)))
        batch = {"fwd": (ab, bb), "da": (y_batch, bb), "db": (ab, y_batch)}[role]
        contracted = self.blocked(role)[side]
        ndim = (
            self.ndims[side]
            if role == "fwd" or (role, side) in (("da", 1), ("db", 0))
            else len(ab) + sum(len(d) for d in self._dims()[4:])
        )
        free = _remaining(ndim, contracted, batch[side])
        if len(contracted) != 1 or len(free) != 1:
            raise ValueError(
                f"`{self.name}`: the quantiser {q!r} has square blocks, which need "
                "an operand with one contracted and one free dimension beside its "
                f"batch dimensions (a matrix); in the {role} product, operand "
                f"{'lhs' if side == 0 else 'rhs'} contracts {contracted} and keeps "
                f"{tuple(free)}. Give it blocks along one axis."
            )
        first, second = sorted((contracted[0], free[0]))
        return first, second

    def hadamard_form(self, role: str) -> tuple[Any, tuple[int, ...], bool] | None:
        # As `lax.dot_general`'s own transposes form them.
        ac, bc, ab, bb, af, bf = self._dims()
        ya, yb = self._output()
        batch = list(range(len(ab)))
        if role == "fwd":
            return (
                self.dimension_numbers,
                tuple(range(len(ab) + len(af) + len(bf))),
                False,
            )
        if role == "da":  # dot_general(dy, b) -> (batch, a free, b's contracted)
            dims = ((tuple(yb), tuple(bf)), (tuple(batch), tuple(bb)))
            a_contract = [ac[bc.index(d)] for d in sorted(bc)]
            return dims, tuple(np.argsort(ab + af + a_contract)), False
        # db: dot_general(dy, a) -> (batch, b free, a's contracted), the operands
        # swapped (the recipe's `lhs` is `a`).
        dims = ((tuple(ya), tuple(af)), (tuple(batch), tuple(ab)))
        b_contract = [bc[ac.index(d)] for d in sorted(ac)]
        return dims, tuple(np.argsort(bb + bf + b_contract)), True

    def with_mapped_lhs(self) -> DotGeneral:
        (ac, bc), (ab, bb) = self.dimension_numbers
        shift = tuple(d + 1 for d in ac), tuple(d + 1 for d in ab)
        return DotGeneral(
            ((shift[0], bc), (shift[1], bb)),
            (self.ndims[0] + 1, self.ndims[1]),
            name=self.name,
        )

    def with_mapped_both(self) -> DotGeneral:
        (ac, bc), (ab, bb) = self.dimension_numbers

        def shift(axes: _Axes) -> _Axes:
            return tuple(d + 1 for d in axes)

        return DotGeneral(
            ((shift(ac), shift(bc)), ((0, *shift(ab)), (0, *shift(bb)))),
            (self.ndims[0] + 1, self.ndims[1] + 1),
            name=self.name,
        )

    def fold(self, v: Array, what: str) -> Array:
        # `a`'s new free dimension is its first: at 0 in `a`, after the batch in `y`.
        return (
            v if what == "a" else jnp.moveaxis(v, 0, len(self.dimension_numbers[1][0]))
        )

    def unfold(self, v: Array, what: str, size: int) -> Array:
        return (
            v if what == "a" else jnp.moveaxis(v, len(self.dimension_numbers[1][0]), 0)
        )


class Conv(Op):
    """`lax.conv_general_dilated(a, b, ...)`, float32 output: `a` the input, `b`
    the kernel. `dimension_numbers` as `lax.ConvDimensionNumbers` gives them (the
    positions of batch, feature and spatial dimensions of input, kernel and
    output)."""

    window_strides: tuple[int, ...]
    padding: Any
    lhs_dilation: tuple[int, ...] | None
    rhs_dilation: tuple[int, ...] | None
    dimension_numbers: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    feature_group_count: int

    def __call__(self, a: Array, b: Array) -> Array:
        return jax.lax.conv_general_dilated(
            a,
            b,
            self.window_strides,
            self.padding,
            lhs_dilation=self.lhs_dilation,
            rhs_dilation=self.rhs_dilation,
            dimension_numbers=jax.lax.ConvDimensionNumbers(*self.dimension_numbers),
            feature_group_count=self.feature_group_count,
            preferred_element_type=_F32,
        )

    def blocked(self, role: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        lhs, rhs, out = self.dimension_numbers
        if role == "fwd":  # the input features
            return (lhs[1],), (rhs[1],)
        if role == "da":  # the output features
            return (out[1],), (rhs[0],)
        # The batch and spatial positions, each operand its own.
        return (lhs[0], *lhs[2:]), (out[0], *out[2:])

    def square(self, role: str, side: int, q: BlockQuantizer) -> tuple[int, int]:
        if side == 1 and role != "db":  # the kernel: its output and input features
            rhs = self.dimension_numbers[1]
            return rhs[0], rhs[1]
        return super().square(role, side, q)

    def with_mapped_lhs(self) -> Conv:
        return self

    def fold(self, v: Array, what: str) -> Array:
        batch = self.dimension_numbers[0 if what == "a" else 2][0]
        v = jnp.moveaxis(v, 0, batch)  # the mapped axis just before the batch
        return v.reshape(*v.shape[:batch], -1, *v.shape[batch + 2 :])

    def unfold(self, v: Array, what: str, size: int) -> Array:
        batch = self.dimension_numbers[0 if what == "a" else 2][0]
        v = v.reshape(*v.shape[:batch], size, -1, *v.shape[batch + 1 :])
        return jnp.moveaxis(v, batch, 0)


def operand_keys(key: PRNGKeyArray) -> tuple[Array, Array, Array]:
    """A product's keys: its left operand's, its right operand's (independent, so
    that the expectation of a product of two stochastically rounded operands is
    the product of their expectations), and its Hadamard signs'."""
    k = jax.random.split(key, 3)
    return k[0], k[1], k[2]


def product_keys(key: PRNGKeyArray | None) -> tuple[Any, Any, Any]:
    """One key per product (forward, then the two gradient products)."""
    if key is None:
        return None, None, None
    k = jax.random.split(key, 3)
    return k[0], k[1], k[2]


def block_of(q: Any) -> int:
    """The block length `q` needs the contracted length to be a multiple of."""
    return q.block_size if isinstance(q, BlockQuantizer) else 1


def pad(v: Array, multiple: int) -> Array:
    """`v` with zeros appended along axis 0, up to the least multiple of
    `multiple` at least its length: `v` itself where that is its length."""
    extra = -v.shape[0] % multiple
    if not extra:
        return v
    return jnp.pad(v, ((0, extra),) + ((0, 0),) * (v.ndim - 1))


def _flatten(v: Array, dims: Sequence[int]) -> Array:
    """`v` with `dims` moved to the front, in that order, and flattened into one."""
    moved = jnp.moveaxis(v, tuple(dims), tuple(range(len(dims))))
    return moved.reshape(-1, *moved.shape[len(dims) :])


def _unflatten(f: Array, dims: Sequence[int], like: Array) -> Array:
    moved = jnp.moveaxis(like, tuple(dims), tuple(range(len(dims)))).shape
    return jnp.moveaxis(f.reshape(moved), tuple(range(len(dims))), tuple(dims))


def _call(q: Any, v: Array, axis: int | tuple[int, int], key: Any, where: str) -> Array:
    """`q` on `v`, a block quantiser's blocks along `axis` (or square over a pair)."""
    if isinstance(q, BlockQuantizer):
        if isinstance(axis, tuple):
            q = q if q.axis == axis else dataclasses.replace(q, axis=axis)
        else:
            q = q.for_reduction_axis(axis, v.shape[axis], where)
    return q(v, key=key)


def quantise_along(
    op: Op, role: str, side: int, q: Any, v: Array, dims: Sequence[int], key: Any
) -> Array:
    """`v` quantised by `q` (operand `side` of product `role` of `op`), blocks along
    `dims` (flattened, padded with zeros at the end to a multiple of the block:
    `quantise_along`'s statement in the module docstring). An elementwise `q`
    (per element, or one scale per tensor) takes `v` whole."""
    if q is None:
        return v
    where = f"an operand of shape {tuple(v.shape)} of the {role} product"
    if not isinstance(q, BlockQuantizer):
        return q(v, key=key)
    if isinstance(q.axis, tuple):  # square blocks: as the operation says
        return _call(q, v, op.square(role, side, q), key, where)
    if len(dims) == 1 and v.shape[dims[0]] % q.block_size == 0:
        return _call(q, v, dims[0], key, where)
    flat = _flatten(v, dims)
    n = flat.shape[0]
    quantised = _call(q, pad(flat, q.block_size), 0, key, where)[:n]
    return _unflatten(quantised, dims, v)


def _evaluate(
    op: Op, role: str, spec: Product, lhs: Array, rhs: Array, witness: Array, key: Any
) -> Array:
    """Product `role` of `op` with the quantisers and Hadamard transform of `spec`,
    on its operands `lhs` and `rhs` (as `spec` names them); `witness` is the array
    whose cotangent a gradient product is."""
    k_lhs = k_rhs = k_signs = None
    if key is not None:
        k_lhs, k_rhs, k_signs = operand_keys(key)
    dims = op.blocked(role)
    if spec.hadamard is not None or (
        op.hadamard_form(role) is not None and _padded(spec, lhs, dims[0])
    ):
        keys = (k_lhs, k_rhs, k_signs)
        return _contracted(op, role, spec, lhs, rhs, witness, keys)
    dims = op.blocked(role)
    q_lhs = quantise_along(op, role, 0, spec.lhs, lhs, dims[0], k_lhs)
    q_rhs = quantise_along(op, role, 1, spec.rhs, rhs, dims[1], k_rhs)
    if role == "fwd":
        return op(q_lhs, q_rhs)
    if role == "da":  # f(·, Q(b))ᵀ Q(ȳ): lhs is the cotangent
        return jax.vjp(lambda a: op(a, q_rhs), witness)[1](q_lhs)[0]
    return jax.vjp(lambda b: op(q_lhs, b), witness)[1](q_rhs)[0]


def multiple_of(spec: Product) -> int:
    """The least common multiple of the block lengths of `spec`: its quantisers'
    and its Hadamard transform's (1 if none)."""
    return math.lcm(spec.hadamard or 1, block_of(spec.lhs), block_of(spec.rhs))


def _padded(spec: Product, lhs: Array, dims: Sequence[int]) -> bool:
    """Whether product `spec`'s contracted length (that of `dims` of `lhs`) needs
    padding."""
    length = math.prod(lhs.shape[d] for d in dims)
    return length % multiple_of(spec) != 0


def _contracted(
    op: Op,
    role: str,
    spec: Product,
    lhs: Array,
    rhs: Array,
    witness: Array,
    keys: tuple[Any, Any, Any],
) -> Array:
    """Product `role` of `op`, a contraction, computed as one `dot_general` of its
    flattened operands: each operand flattened along what the product contracts
    (as `quantise_along` does) and padded with zeros at the end to a multiple of
    `multiple_of(spec)`, then, if `spec` asks, rotated by the random Hadamard
    transform with the same signs ($R R^\\top = I$), quantised along it, and
    contracted. The padding stays in the contraction, so the result is, bit for
    bit, that of the operands padded with zeros."""
    form = op.hadamard_form(role)
    if form is None:
        raise ValueError(
            f"`{op.name}`: the {role} product cannot take a random Hadamard "
            f"transform (`hadamard`={spec.hadamard}): it is not a contraction of "
            "its operands, which the transform needs; give that product "
            "`hadamard=None` (e.g. `dataclasses.replace(recipes.nvfp4(), "
            "hadamard=None)`)."
        )
    for q in (spec.lhs, spec.rhs):
        if isinstance(q, BlockQuantizer) and isinstance(q.axis, tuple):
            raise ValueError(
                f"`{op.name}`: the {role} product's quantiser {q!r} has square "
                "blocks, which cannot follow the flattening of what the product "
                "contracts (for its random Hadamard transform, or a length its "
                "blocks do not divide): give it blocks along one axis, or the "
                "product `hadamard=None`."
            )
    dims = op.blocked(role)
    (_, batch), permutation, swap = form
    k_lhs, k_rhs, k_signs = keys
    multiple = multiple_of(spec)
    signs = None if spec.hadamard is None else random_signs(k_signs, spec.hadamard)
    # Each operand with its contracted dimensions as one axis: a single one in
    # place (so that stochastic rounding's draws follow the operand's own layout,
    # as in `quantise_along`), several moved to the front and flattened. Padded at
    # the end of that axis, rotated along it, quantised along it.
    prepared = []
    for q, v, d, k in (
        (spec.lhs, lhs, dims[0], k_lhs),
        (spec.rhs, rhs, dims[1], k_rhs),
    ):
        kept = [i for i in range(v.ndim) if i not in d]
        if len(d) == 1:
            axis, f = (
                d[0],
                jnp.moveaxis(pad(jnp.moveaxis(v, d[0], 0), multiple), 0, d[0]),
            )
            position = {i: i for i in kept}
        else:
            axis, f = 0, pad(_flatten(v, d), multiple)
            position = {i: 1 + kept.index(i) for i in kept}
        if signs is not None:
            f = rotate(f, axis, signs)
        where = f"an operand of shape {tuple(v.shape)} of the {role} product"
        prepared.append(
            (f if q is None else _call(q, f, axis, k, where), axis, position)
        )
    if swap:  # the form's dimension numbers are of the swapped operands
        prepared.reverse()
    (a, a_axis, a_pos), (b, b_axis, b_pos) = prepared
    dimension_numbers = (
        ((a_axis,), (b_axis,)),
        (tuple(a_pos[i] for i in batch[0]), tuple(b_pos[i] for i in batch[1])),
    )
    sharding = {} if role == "fwd" else _sharding_of(witness, permutation)
    out = jax.lax.dot_general(
        a, b, dimension_numbers, preferred_element_type=_F32, **sharding
    )
    return jnp.transpose(out, permutation)


def _sharding_of(witness: Array, permutation: Sequence[int]) -> dict[str, Any]:
    """`{"out_sharding": ...}`: the sharding of `witness` (the array whose
    cotangent the product is), its dimensions laid out as the contraction gives
    them (`permutation` takes the contraction's to `witness`'s), as `lax`'s own
    transpose gives it. With explicit sharding (JAX >= 0.7) a contraction of a
    sharded dimension must be told its output's. Empty where JAX has no such
    thing, or `witness` is not sharded so."""
    typeof = getattr(jax, "typeof", None)
    if typeof is None or "out_sharding" not in _DOT_PARAMETERS:
        return {}
    sharding = getattr(typeof(witness), "sharding", None)
    if sharding is None or sharding.mesh.empty:
        return {}
    spec = list(sharding.spec) + [None] * (witness.ndim - len(sharding.spec))
    raw = [None] * witness.ndim
    for j, d in enumerate(permutation):
        raw[d] = spec[j]
    spec = jax.sharding.PartitionSpec(*raw)
    return {"out_sharding": jax.sharding.NamedSharding(sharding.mesh, spec)}


_DOT_PARAMETERS = inspect.signature(jax.lax.dot_general).parameters


@ft.cache
def product(op: Op, role: str, spec: Product) -> Any:
    """`_evaluate` for `op`, `role` and `spec`, as a function of
    `(lhs, rhs, witness, key)`, differentiated only as a clear error, whose `vmap`
    joins the mapped axis to the rows (see `_product`).

    One function per product (cached), jitted with `inline=True`: called eagerly,
    the product is one compiled program (op by op, its quantisers alone would
    compile dozens of small ones); under an enclosing trace (`jit`), it is traced in
    place, not as a nested call. XLA inlines a nested call but then schedules the
    program otherwise: on the attention benchmark (section 12), its buffers took
    1.2% more memory than the same steps written by hand."""
    return jax.jit(_not_differentiated(_product(op, role, spec), op.name), inline=True)


# Which of a product's (lhs, rhs, witness) carry the rows (`a`, or the cotangent),
# and which of `Op.fold`'s kinds each is; the result's kind.
_ROWS = {
    "fwd": (("a", None, None), "y"),
    "da": (("y", None, "a"), "a"),
    "db": (("a", "y", None), None),
}


def _product(op: Op, role: str, spec: Product) -> Any:
    """`product`'s function. Under `vmap`, `custom_vmap` traces it on one example,
    then replaces it with its rule's: with only the rows mapped (`a` and the
    cotangent), the same product of `op.with_mapped_lhs()` on the whole batch; with
    both operands mapped and a contraction, that of `op.with_mapped_both()` (one
    more batch dimension); with `b` mapped alone (an ensemble), a convolution's
    both, or only the key (independent draws), each slice its own product
    (`lax.map`, so that an enclosing `vmap` still reaches this rule)."""
    kinds, out_kind = _ROWS[role]

    @custom_vmap
    def run(lhs: Array, rhs: Array, witness: Array, key: Any) -> Array:
        return _evaluate(op, role, spec, lhs, rhs, witness, key)

    @run.def_vmap
    def batched(size: int, in_batched: Any, lhs, rhs, witness, key):
        *arrays_b, key_b = in_batched
        key_b = any(jtu.tree_leaves(key_b))
        rows_b = any(b for b, kind in zip(arrays_b, kinds) if kind)
        other_b = any(b for b, kind in zip(arrays_b, kinds) if not kind)
        both = op.with_mapped_both()
        if rows_b and other_b and not key_b and both is not None:
            # Both operands mapped (attention's q and k, per example): one more
            # batch dimension, at 0 in every operand and in the result.
            args = [
                _broadcast(v, b, size) for v, b in zip((lhs, rhs, witness), arrays_b)
            ]
            return product(both, role, spec)(*args, key), True
        if other_b or (key_b and not rows_b):
            args, mapped = (lhs, rhs, witness, key), (*arrays_b, key_b)
            return _map(run, args, mapped), True
        if key_b:
            raise ValueError(
                f"`{op.name}`: under `jax.vmap`, `key` is mapped with the rows "
                "(the left operand). Its mapped axis joins the rows of the products "
                "(the weight-gradient product's blocks run along it), which take "
                "one key: pass the same key to every example, e.g. "
                "`jax.vmap(lambda x: f(x, key=key))(xs)` or `in_axes=None` for it."
            )
        folded = op.with_mapped_lhs()
        args = [
            v if not kind else op.fold(_broadcast(v, b, size), kind)
            for v, b, kind in zip((lhs, rhs, witness), arrays_b, kinds)
        ]
        out = product(folded, role, spec)(*args, key)
        if out_kind is None:
            return out, False
        return op.unfold(out, out_kind, size), True

    return run


def _broadcast(v: Array, mapped: bool, size: int) -> Array:
    return v if mapped else jnp.broadcast_to(v, (size, *v.shape))


def _not_differentiated(f: Any, name: str) -> Any:
    """`f`, with a clear error when differentiated: a product of the backward pass
    is, only by a second derivative (`custom_vmap` has no derivative of its own)."""

    @jax.custom_jvp
    def g(*args: Any) -> Array:
        return f(*args)

    @g.defjvp
    def _(primals: Any, tangents: Any) -> Any:
        raise TypeError(
            f"`{name}` has no second derivative: its derivative quantises the "
            "cotangent, which has no derivative. Differentiate it once "
            "(`jax.grad`, `jax.vjp`)."
        )

    return g


def _map(f: Any, args: tuple[Any, ...], mapped: tuple[bool, ...]) -> Array:
    """`f(*args)` on each slice (along axis 0) of the `mapped` arguments, the
    others whole."""

    def one(slices: list[Any]) -> Array:
        it = iter(slices)
        return f(*(next(it) if m else a for a, m in zip(args, mapped)))

    return jax.lax.map(one, [a for a, m in zip(args, mapped) if m])


class _Bilinear(VJPRule):
    """The quantised core as a rule of the library's one custom-VJP function (so
    its cotangents have their primals' dtypes, and forward mode is a clear
    error): `op` computed with the three products of `recipe`."""

    op: Op = eqx.field(static=True)
    recipe: Custom = eqx.field(static=True)

    elementwise: ClassVar[bool] = False

    def rule_name(self) -> str:  # pyright: ignore[reportIncompatibleMethodOverride]
        return self.op.name

    def primal(self, a: Array, b: Array, *, key: Any = None) -> Array:
        k = product_keys(key)
        a32, b32 = a.astype(_F32), b.astype(_F32)
        y = product(self.op, "fwd", self.recipe.fwd)(a32, b32, b32, k[0])
        return y.astype(jnp.result_type(a, b))

    def bwd(
        self, residuals: Any, cotangent: Array, args: tuple[Any, ...], **kwargs: Any
    ) -> tuple[Array, Array]:
        a, b = args
        k = product_keys(kwargs.get("key"))
        a32, b32 = a.astype(_F32), b.astype(_F32)
        dy = cotangent.astype(_F32)
        da = product(self.op, "da", self.recipe.dx)(dy, b32, a32, k[1])
        db = product(self.op, "db", self.recipe.dw)(a32, dy, b32, k[2])
        return da, db
