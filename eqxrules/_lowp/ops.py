r"""The operations of the quantised core: each a bilinear $y = f(a, b)$ (with
non-differentiable array operands, `extras`, such as a ragged product's group
sizes), and, the one source of its geometry, what it contracts.

Each operation says, for each of its two operands, along which dimensions the
product contracts it (`Operand.blocked`: its quantiser's blocks run along them), and
which of its other dimensions a square block pairs with that one
(`Operand.paired`). Its two gradient products are operations too, derived by
`transpose` (the shape of qwix's `_update_dimension_numbers_for_backward`):

$$\bar a = f^{\top}_{\mathrm{dx}}(\bar y, b), \qquad
\bar b = f^{\top}_{\mathrm{dw}}(a, \bar y),$$

each again an `Op`, whose own `operands()` say what it contracts. So blocking,
square blocks and the random Hadamard transform read one method, whatever the
product: a `lax.dot_general`'s transposes are `dot_general`s (as `lax` forms them),
a convolution's and a ragged product's are their linear transposes
(`jax.linear_transpose`), with their contracted dimensions stated beside them.

`joined` says how a named `vmap` axis joins the operation (`core`): as more rows
of `a` (its free dimensions, a convolution's batch, a ragged product's rows), or,
with both operands mapped, as one more batch dimension of a contraction.
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

_F32 = jnp.float32
_Axes = tuple[int, ...]
DotNumbers = tuple[tuple[_Axes, _Axes], tuple[_Axes, _Axes]]


class Operand(NamedTuple):
    """What a product does with one of its operands.

    - `blocked`: the dimensions it contracts, in the order the product pairs them
        with the other operand's: a quantiser's blocks run along them (several
        are flattened row-major into one).
    - `paired`: the operand's other dimensions a square block may pair with the
        blocked one (its free dimensions; not its batch or a kernel's positions).
    - `independent`: dimensions each index of which is a tensor of its own (a
        ragged product's per-group weights): quantised slice by slice.
    - `segmented`: a dimension whose rows the operation's group sizes split into
        consecutive segments, each a tensor of its own (a ragged product's rows).
    - `whole`: every output element that reads one entry of a block along
        `blocked` reads all of them (a contraction that sums, for each output,
        over all of `blocked` within its slice, segment or group), so a product
        NaN at the outputs that read a non-finite element is NaN at those that
        read its block (`LowPrecision.encode_operand`). Not a convolution's
        weight gradient (each output reads a window of the positions its blocks
        run along), nor a convolution's input gradient in feature groups (a
        block of output features may span two). `False` claims nothing.
    """

    blocked: _Axes
    paired: _Axes = ()
    independent: _Axes = ()
    segmented: int | None = None
    whole: bool = False


class Op(eqx.Module):
    """A bilinear operation and its geometry. Data only (every field static), so
    that it keys compiled programs."""

    name: str = eqx.field(default="quantized_dot_general", kw_only=True)

    @abc.abstractmethod
    def __call__(
        self, a: Array, b: Array, *extras: Array, precision: Any = None
    ) -> Array:
        """`f(a, b)`, float32 operands and result, at `precision` (`lax`'s)."""

    @abc.abstractmethod
    def operands(self) -> tuple[Operand, Operand]:
        """What the operation contracts of each operand (see `Operand`)."""

    def transpose(self, role: str, like: Any) -> Op:
        """The operation whose value is gradient product `role`: for `"dx"`,
        `g(ȳ, b) = ā`, for `"dw"`, `g(a, ȳ) = b̄`; `like` is the primal whose
        cotangent it gives (its shape, and its sharding)."""
        raise NotImplementedError

    def transposed_operands(self, role: str) -> tuple[Operand, Operand]:
        """The geometry of gradient product `role`, where it is `Transposed`."""
        raise NotImplementedError

    def flat(self, multiple: int) -> Flat | None:
        """The operation as one contraction of its operands, each with what it
        contracts as one axis padded with zeros to a multiple of `multiple` (for
        the random Hadamard transform, which rotates both operands alike along
        it), or `None` where it is not a contraction of its operands."""
        return None

    def padded_contraction(self) -> bool:
        """Whether a contracted length that a block does not divide is padded in
        the contraction itself (`flat`), or in each quantiser's call only (padding
        sliced off after quantising)."""
        return False

    def joined(self, a_mapped: bool, b_mapped: bool) -> Join:
        """How a named `vmap` axis (at 0 of `a`, or of `b`, as mapped) joins the
        operation. By default only as rows: `a` mapped, `b` not."""
        if b_mapped:
            raise ValueError(
                f"`{self.name}`: under `jax.vmap` with `axis_name`, `rhs` must not "
                "be mapped: the whole batch's call has one `rhs`. Map it without "
                "naming the axis (`axis_name=None`): each example is then its own "
                "call."
            )
        return self._rows()

    def _rows(self) -> Join:
        raise NotImplementedError


class Flat(NamedTuple):
    """An operation as one contraction of prepared operands (`Op.flat`):
    `prepare[i](v, extras)` lays operand `i` out with what it contracts as one
    axis, padded; `op` contracts the prepared operands."""

    prepare: tuple[Callable[..., Array], Callable[..., Array]]
    op: Op


class Join(NamedTuple):
    """A named `vmap` axis joined to an operation: `op` takes the folded operands.
    `kinds` are the operands that carry the axis (`"a"`, `"b"`, `"y"`, the output
    or its cotangent); `fold(v, kind, extras)` takes `v` (the axis at 0) to what
    `op` takes, `unfold(v, kind, extras, size)` is its inverse (the axis, of
    length `size`, back at 0); `extras(extras)` gives the extras of `op`. Every
    extra is given with the axis at 0 (broadcast if it was not mapped)."""

    op: Op
    kinds: frozenset[str]
    fold: Callable[[Array, str, tuple[Array, ...]], Array]
    unfold: Callable[[Array, str, tuple[Array, ...], int], Array]
    extras: Callable[[tuple[Array, ...]], tuple[Array, ...]] = lambda e: e


def remaining(n: int, *used: Sequence[int]) -> list[int]:
    """The dimensions of `range(n)` in none of `used`, in order."""
    taken = {int(d) for u in used for d in u}
    return [d for d in range(n) if d not in taken]


def _identity(v: Array, kind: str, extras: tuple[Array, ...], *size: int) -> Array:
    return v


def pad_axis(v: Array, axis: int, multiple: int) -> Array:
    """`v` with zeros appended along `axis` up to the least multiple of `multiple`
    at least its length (`v` itself where that is its length)."""
    extra = -v.shape[axis] % multiple
    if not extra:
        return v
    widths = [(0, 0)] * v.ndim
    widths[axis] = (0, extra)
    return jnp.pad(v, widths)


def flatten(v: Array, dims: Sequence[int]) -> Array:
    """`v` with `dims` moved to the front, in that order, and flattened into one."""
    moved = jnp.moveaxis(v, tuple(dims), tuple(range(len(dims))))
    return moved.reshape(-1, *moved.shape[len(dims) :])


def unflatten(f: Array, dims: Sequence[int], like_shape: Sequence[int]) -> Array:
    """The inverse of `flatten`, for an array of shape `like_shape`."""
    shape = [like_shape[d] for d in dims] + [
        s for i, s in enumerate(like_shape) if i not in dims
    ]
    return jnp.moveaxis(f.reshape(shape), tuple(range(len(dims))), tuple(dims))


class DotGeneral(Op):
    """`lax.dot_general(x, y, dimension_numbers)` with float32 output, transposed
    by `permutation` if given; `(x, y)` is `(a, b)`, or `(b, a)` if `swap` (as
    `lax` computes the transpose for its right operand). Dimension numbers and
    `ndims` are of `(x, y)`. With `independent`, each index of the batch
    dimensions is a tensor of its own (a ragged product's groups): quantised
    slice by slice; otherwise a per-tensor scale spans the batch."""

    dimension_numbers: DotNumbers
    ndims: tuple[int, int]
    permutation: _Axes | None = None
    swap: bool = False
    out_sharding: Any = None
    independent: bool = False

    def __call__(
        self, a: Array, b: Array, *extras: Array, precision: Any = None
    ) -> Array:
        x, y = (b, a) if self.swap else (a, b)
        sharding = (
            {} if self.out_sharding is None else {"out_sharding": self.out_sharding}
        )
        out = jax.lax.dot_general(
            x,
            y,
            self.dimension_numbers,
            precision=precision,
            preferred_element_type=_F32,
            **sharding,
        )
        return out if self.permutation is None else jnp.transpose(out, self.permutation)

    def operands(self) -> tuple[Operand, Operand]:
        (c0, c1), (b0, b1) = self.dimension_numbers
        n0, n1 = self.ndims
        i0, i1 = (tuple(b0), tuple(b1)) if self.independent else ((), ())
        # Each output sums over every contracted entry of its batch index.
        x = Operand(tuple(c0), tuple(remaining(n0, c0, b0)), i0, whole=True)
        y = Operand(tuple(c1), tuple(remaining(n1, c1, b1)), i1, whole=True)
        return (y, x) if self.swap else (x, y)

    def padded_contraction(self) -> bool:
        return True

    def transpose(self, role: str, like: Any) -> DotGeneral:
        # As `lax`'s transpose rules form them (`_dot_general_transpose_lhs`), so
        # that with nothing quantised each product is `lax`'s own, bit for bit.
        assert self.permutation is None and not self.swap
        (ac, bc), (ab, bb) = [list(map(list, p)) for p in self.dimension_numbers]
        na, nb = self.ndims
        af, bf = remaining(na, ac, ab), remaining(nb, bc, bb)
        n = len(ab)
        y_batch = list(range(n))
        y_a = list(range(n, n + len(af)))
        y_b = list(range(n + len(af), n + len(af) + len(bf)))
        ny = n + len(af) + len(bf)
        if role == "dx":  # dot_general(ȳ, b) -> (batch, a's free, a's contracted)
            dims = ((tuple(y_b), tuple(bf)), (tuple(y_batch), tuple(bb)))
            contracted = [ac[i] for i in np.argsort(bc)]
            perm = tuple(int(i) for i in np.argsort(ab + af + contracted))
            return DotGeneral(
                dims, (ny, nb), perm, False, _sharding_of(like, perm), name=self.name
            )
        # dw: dot_general(ȳ, a) -> (batch, b's free, b's contracted), computed with
        # the cotangent first; the recipe's `lhs` is `a`.
        dims = ((tuple(y_a), tuple(af)), (tuple(y_batch), tuple(ab)))
        contracted = [bc[i] for i in np.argsort(ac)]
        perm = tuple(int(i) for i in np.argsort(bb + bf + contracted))
        return DotGeneral(
            dims, (ny, na), perm, True, _sharding_of(like, perm), name=self.name
        )

    def flat(self, multiple: int) -> Flat:
        (c0, c1), (b0, b1) = self.dimension_numbers
        layouts = [_flat_layout(c, n) for c, n in zip((c0, c1), self.ndims)]
        prepare = tuple(
            _flat_prepare(c, axis, multiple) for c, (axis, _) in zip((c0, c1), layouts)
        )
        (x_axis, x_pos), (y_axis, y_pos) = layouts
        dims = (
            ((x_axis,), (y_axis,)),
            (tuple(x_pos[i] for i in b0), tuple(y_pos[i] for i in b1)),
        )
        ndims = (self.ndims[0] - len(c0) + 1, self.ndims[1] - len(c1) + 1)
        op = DotGeneral(
            dims,
            ndims,
            self.permutation,
            self.swap,
            self.out_sharding,
            self.independent,
            name=self.name,
        )
        x, y = prepare
        return Flat((y, x) if self.swap else (x, y), op)

    def joined(self, a_mapped: bool, b_mapped: bool) -> Join:
        assert self.permutation is None and not self.swap
        (ac, bc), (ab, bb) = self.dimension_numbers
        if not b_mapped:
            return self._rows()

        def shift(axes: _Axes) -> _Axes:
            return tuple(d + 1 for d in axes)

        op = DotGeneral(
            ((shift(ac), shift(bc)), ((0, *shift(ab)), (0, *shift(bb)))),
            (self.ndims[0] + 1, self.ndims[1] + 1),
            name=self.name,
        )
        return Join(op, frozenset("aby"), _identity, _identity)

    def _rows(self) -> Join:
        # `a`'s new free dimension is its first: at 0 in `a`, after the batch in `y`.
        (ac, bc), (ab, bb) = self.dimension_numbers
        op = DotGeneral(
            ((tuple(d + 1 for d in ac), bc), (tuple(d + 1 for d in ab), bb)),
            (self.ndims[0] + 1, self.ndims[1]),
            name=self.name,
        )
        n = len(ab)

        def fold(v: Array, kind: str, extras: tuple[Array, ...]) -> Array:
            return jnp.moveaxis(v, 0, n) if kind == "y" else v

        def unfold(v: Array, kind: str, extras: tuple[Array, ...], size: int) -> Array:
            return jnp.moveaxis(v, n, 0) if kind == "y" else v

        return Join(op, frozenset("ay"), fold, unfold)


def _flat_layout(contracted: Sequence[int], ndim: int) -> tuple[int, dict[int, int]]:
    """Where an operand's contracted dimensions are, as one axis, once prepared
    (`_flat_prepare`), and where each of its other dimensions goes: a single one
    stays in place (so that stochastic rounding's draws follow the operand's own
    layout), several are moved to the front and flattened."""
    kept = [i for i in range(ndim) if i not in contracted]
    if len(contracted) == 1:
        return contracted[0], {i: i for i in kept}
    return 0, {i: 1 + kept.index(i) for i in kept}


def _flat_prepare(contracted: Sequence[int], axis: int, multiple: int):
    def prepare(v: Array, extras: tuple[Array, ...]) -> Array:
        if len(contracted) == 1:
            return pad_axis(v, axis, multiple)
        return pad_axis(flatten(v, contracted), 0, multiple)

    return prepare


def _sharding_of(like: Any, permutation: Sequence[int]) -> Any:
    """The sharding of `like` (the array whose cotangent a product is), its
    dimensions laid out as the contraction gives them (`permutation` takes the
    contraction's to `like`'s), as `lax`'s own transpose gives it. With explicit
    sharding (JAX >= 0.7) a contraction of a sharded dimension must be told its
    output's. `None` where JAX has no such thing, or `like` is not sharded so."""
    typeof = getattr(jax, "typeof", None)
    if like is None or typeof is None or "out_sharding" not in _DOT_PARAMETERS:
        return None
    sharding = getattr(typeof(like), "sharding", None)
    if sharding is None or sharding.mesh.empty:
        return None
    spec = list(sharding.spec) + [None] * (like.ndim - len(sharding.spec))
    raw: list[Any] = [None] * like.ndim
    for j, d in enumerate(permutation):
        raw[d] = spec[j]
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*raw))


_DOT_PARAMETERS = inspect.signature(jax.lax.dot_general).parameters


class Transposed(Op):
    """A gradient product of `of` (a convolution) as its linear transpose: for
    `"dx"`, `g(ȳ, b) = (a ↦ f(a, b))ᵀ ȳ`; for `"dw"`, `g(a, ȳ) = (b ↦ f(a, b))ᵀ ȳ`,
    taken at `like`, the primal whose cotangent it is (its values unused: `f` is
    linear; its type, sharding and varying axes under `shard_map` are the
    cotangent's). Its geometry is `of.transposed_operands(role)`."""

    of: Op
    role: str
    like: Array

    def __call__(
        self, lhs: Array, rhs: Array, *extras: Array, precision: Any = None
    ) -> Array:
        def f(a: Array, b: Array) -> Array:
            return self.of(a, b, *extras, precision=precision)

        if self.role == "dx":
            return jax.vjp(lambda a: f(a, rhs), self.like)[1](lhs)[0]
        return jax.vjp(lambda b: f(lhs, b), self.like)[1](rhs)[0]

    def operands(self) -> tuple[Operand, Operand]:
        return self.of.transposed_operands(self.role)


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

    def __call__(
        self, a: Array, b: Array, *extras: Array, precision: Any = None
    ) -> Array:
        return jax.lax.conv_general_dilated(
            a,
            b,
            self.window_strides,
            self.padding,
            lhs_dilation=self.lhs_dilation,
            rhs_dilation=self.rhs_dilation,
            dimension_numbers=jax.lax.ConvDimensionNumbers(*self.dimension_numbers),
            feature_group_count=self.feature_group_count,
            precision=precision,
            preferred_element_type=_F32,
        )

    def operands(self) -> tuple[Operand, Operand]:
        lhs, rhs, _ = self.dimension_numbers
        # The input features; the kernel's input features, paired with its output
        # features (square blocks), its positions neither. An output reads every
        # input feature of its feature group at each position it reads, and a
        # block divides a group's input features (`conv.check_conv`): whole.
        return (
            Operand((lhs[1],), (lhs[0], *lhs[2:]), whole=True),
            Operand((rhs[1],), (rhs[0],), whole=True),
        )

    def transposed_operands(self, role: str) -> tuple[Operand, Operand]:
        lhs, rhs, out = self.dimension_numbers
        if role == "dx":  # the output features
            # Whole without feature groups: a block of output features may
            # straddle two groups (a block divides their number, not a group's).
            whole = self.feature_group_count == 1
            return (
                Operand((out[1],), (out[0], *out[2:]), whole=whole),
                Operand((rhs[0],), (rhs[1],), whole=whole),
            )
        # The batch and positions, each operand its own; each output (a kernel
        # position) reads a window of the positions, not whole blocks of them.
        return (
            Operand((lhs[0], *lhs[2:]), (lhs[1],)),
            Operand((out[0], *out[2:]), (out[1],)),
        )

    def transpose(self, role: str, like: Any) -> Transposed:
        return Transposed(self, role, like, name=self.name)

    def _rows(self) -> Join:
        lhs, _, out = self.dimension_numbers
        batches = {"a": lhs[0], "y": out[0]}

        def fold(v: Array, kind: str, extras: tuple[Array, ...]) -> Array:
            batch = batches[kind]
            v = jnp.moveaxis(v, 0, batch)  # the mapped axis just before the batch
            return v.reshape(*v.shape[:batch], -1, *v.shape[batch + 2 :])

        def unfold(v: Array, kind: str, extras: tuple[Array, ...], size: int) -> Array:
            batch = batches[kind]
            v = v.reshape(*v.shape[:batch], size, -1, *v.shape[batch + 1 :])
            return jnp.moveaxis(v, batch, 0)

        return Join(self, frozenset("ay"), fold, unfold)
