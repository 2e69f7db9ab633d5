r"""The quantised core: one custom VJP over a bilinear operation $y = f(a, b)$
(`ops.Op`: `lax.dot_general`, `lax.conv_general_dilated`, `lax.ragged_dot`), whose
three products each quantise their operands as a recipe says:

$$y = f\big(Q^{\mathrm{fwd}}_a(a),\, Q^{\mathrm{fwd}}_b(b)\big), \qquad
\bar a = f^{\top}_{\mathrm{dx}}\big(Q^{\mathrm{dx}}_{\bar y}(\bar y),\,
Q^{\mathrm{dx}}_b(b)\big), \qquad
\bar b = f^{\top}_{\mathrm{dw}}\big(Q^{\mathrm{dw}}_a(a),\,
Q^{\mathrm{dw}}_{\bar y}(\bar y)\big),$$

each gradient product the forward product of a transposed operation
(`Op.transpose`), each evaluated by `quantise.evaluate`.

**`vmap` means `vmap`.** With no `axis_name`, a product is plain JAX: under
`jax.vmap` JAX batches it as it batches any function, so `vmap(f)(xs)[i]` is
`f(xs[i])`, `vmap(grad(f))` gives each example its own gradient, and a key mapped
with the examples draws for each as its own call would.

**Batch-wide by name.** With `axis_name` (as `eqx.nn.BatchNorm` takes it), the
named axes are joined to the products:

- under `jax.vmap(..., axis_name=name)`, the product's batching rule (a
  `custom_vmap`) joins the mapped axis to the operation (`Op.joined`: more rows
  of `a`, or with both operands mapped one more batch dimension of a
  contraction), so its per-tensor scales and the weight-gradient product's
  blocks see the whole batch, as one call on the batch would. The rule knows the
  axis it batches is the named one by an argument mapped along that axis alone,
  `lax.axis_index(name)` (`_axis_names.tags`). Under a `vmap` not named, the
  rule maps the product (each example its own), keeping the rule for the axes
  outside it;
- under `jax.shard_map` over a mesh axis of that name, each device computes on
  its own rows (the blocks stay within them) and per-tensor scales span the
  devices with one `pmax` of a scalar (`quantise.spanning`).
"""

from __future__ import annotations

import functools as ft
from collections.abc import Hashable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.custom_batching import custom_vmap
from jaxtyping import Array

from .._catalogue import VJPRule
from .ops import Op
from .quantise import evaluate, product_keys
from .recipes import Custom, Product

_F32 = jnp.float32

# The three products, by the recipe's names: `fwd` = f(a, b); `dx` contracts the
# cotangent with `b` (its operands `(ȳ, b)`), `dw` `a` with the cotangent
# (`(a, ȳ)`). Which primal each operand is, and which is the result: the kinds a
# named axis joins (`ops.Join`).
ROLES = ("fwd", "dx", "dw")
_KINDS = {
    "fwd": (("a", "b", None), "y"),
    "dx": (("y", "b", "a"), "a"),
    "dw": (("a", "y", "b"), "b"),
}
_Maps = tuple[tuple[Any, ...], ...]


def _body(op: Op, role: str, spec: Product, spanned: tuple[Hashable, ...]):
    """The product on one problem: `(lhs, rhs, extras, like, key, tags)` ->
    result, `like` the primal whose cotangent a gradient product gives; its
    per-tensor scales spanning the collective axes `spanned`."""

    def run(lhs, rhs, extras, like, key, tags):
        del tags
        g = op if role == "fwd" else op.transpose(role, like)
        return evaluate(g, spec, lhs, rhs, extras, key, spanned, role)

    return run


@ft.cache
def product(
    op: Op,
    role: str,
    spec: Product,
    names: tuple[Hashable, ...] = (),
    spanned: tuple[Hashable, ...] = (),
    maps: _Maps = (),
) -> Any:
    """Product `role` of `op` with `spec`, as a function of
    `(lhs, rhs, extras, like, key, tags)`, differentiated only as a clear error.
    `names` are the named `vmap` axes not yet joined (one tag each), `spanned` the
    collective ones; `maps` the unnamed `vmap` axes already applied (outermost
    first), each `(size, in_axes)` of the six arguments.

    One function per product (cached), jitted with `inline=True`: called eagerly,
    the product is one compiled program (op by op, its quantisers alone would
    compile dozens of small ones); under an enclosing trace (`jit`), it is traced in
    place, not as a nested call (through a nested call XLA schedules the program
    otherwise: on the attention benchmark, its buffers took 1.2% more memory than
    the same steps written by hand)."""
    f = _body(op, role, spec, spanned)
    for _, axes in reversed(maps):
        f = jax.vmap(f, in_axes=axes)
    if names:
        f = _batching(f, op, role, spec, names, spanned, maps)
    return jax.jit(_not_differentiated(f, op.name), inline=True)


def _batching(f, op: Op, role: str, spec: Product, names, spanned, maps: _Maps):
    """`f` with a batching rule that joins a named axis (`_join`) and maps any
    other (each example its own product, the rule kept for the axes outside)."""

    @custom_vmap
    def run(lhs, rhs, extras, like, key, tags):
        return f(lhs, rhs, extras, like, key, tags)

    @run.def_vmap
    def rule(size, in_batched, lhs, rhs, extras, like, key, tags):
        args = (lhs, rhs, extras, like, key, tags)
        batched = _frozen(jtu.tree_map(bool, in_batched))
        named = _named(names, batched[5])
        if not named:
            axes = jtu.tree_map(lambda b: 0 if b else None, batched)
            mapped = ((size, axes), *maps)
            return product(op, role, spec, names, spanned, mapped)(*args), True
        joined = (op, role, spec, names, spanned, maps)
        return _join(joined, named[0], size, args, batched)

    return run


def _named(names: tuple[Hashable, ...], tags: tuple[bool, ...]) -> list[Hashable]:
    """The names whose tag the `vmap` at hand maps: the axis it maps is theirs."""
    return [n for n, b in zip(names, tags) if b]


def _frozen(tree: Any) -> Any:
    """`tree` with its lists made tuples (hashable, to key `product`)."""
    if isinstance(tree, (list, tuple)):
        return tuple(_frozen(t) for t in tree)
    return tree


def _join(product_of, name, size, args, batched):
    """Product `role` (of `product_of`, `product`'s arguments) with the named axis
    `name` (of length `size`, at 0 of each batched argument) joined to the
    operation: the result of one call on the whole batch along it, inside each
    slice of the unnamed axes already mapped (`maps`)."""
    op, role, spec, names, spanned, maps = product_of
    lhs, rhs, extras, like, key, tags = args
    b_lhs, b_rhs, b_extras, b_like, b_key, _ = batched
    if any(jtu.tree_leaves(b_key)):
        raise ValueError(
            f"`{op.name}`: under `jax.vmap` with `axis_name` naming it ({name!r}), "
            "`key` must not be mapped: the whole batch's products take one key. Pass "
            "the same key to every example (`in_axes=None` for it), or leave "
            "`axis_name=None` so that each example is its own call, with its own key."
        )
    kinds, out_kind = _KINDS[role]
    mapped = dict(zip(kinds, (b_lhs, b_rhs, b_like)))
    del b_lhs, b_rhs, b_like
    join = op.joined(bool(mapped.get("a")), bool(mapped.get("b")))
    # Every argument the join folds, and the extras, carry the named axis and
    # every unnamed one already mapped (broadcast where they did not), the named
    # at 0.
    positions = [0, 1, 3]
    joined = [i for i, kind in zip(positions, kinds) if kind in join.kinds]
    new = list(args)
    for i in joined:
        new[i] = _materialise(args[i], batched[i], maps, i, size)
    extras = tuple(
        _materialise(e, b, maps, (2, j), size)
        for j, (e, b) in enumerate(zip(extras, b_extras))
    )
    depth = len(maps)

    def behind(v: Array) -> Array:  # the named axis behind the unnamed ones
        return jnp.moveaxis(v, 0, depth)

    inner_extras = tuple(behind(e) for e in extras)
    folded_extras = _inside(maps, join.extras, inner_extras) if extras else ()
    for i, kind in zip(positions, kinds):
        if i in joined:
            fold = ft.partial(_fold, join.fold, kind)
            new[i] = _inside(maps, fold, behind(new[i]), inner_extras)
    rest = tuple(n for n in names if n != name)
    kept = tuple(t for n, t in zip(names, tags) if n != name)
    inner = _remapped(maps, names, name, joined, len(extras))
    out = product(join.op, role, spec, rest, spanned, inner)(
        new[0], new[1], folded_extras, new[3], key, kept
    )
    if out_kind not in join.kinds:
        return out, False
    unfold = ft.partial(_unfold, join.unfold, out_kind, size)
    out = _inside(maps, unfold, out, inner_extras)
    return jnp.moveaxis(out, depth, 0), True


def _fold(fold: Any, kind: str, v: Array, extras: tuple[Array, ...]) -> Array:
    return fold(v, kind, extras)


def _unfold(unfold, kind: str, size: int, v: Array, extras: tuple[Array, ...]):
    return unfold(v, kind, extras, size)


def _materialise(v: Array, batched: bool, maps: _Maps, index: Any, size: int):
    """`v` with the named axis (length `size`) at 0, broadcast if it was not
    mapped, then each unnamed axis of `maps` it was not mapped along broadcast in
    its place."""
    v = v if batched else jnp.broadcast_to(v, (size, *v.shape))
    for level, (n, axes) in enumerate(maps):
        if _axis_of(axes, index) is None:
            v = jnp.expand_dims(v, 1 + level)
            v = jnp.broadcast_to(v, (*v.shape[: 1 + level], n, *v.shape[2 + level :]))
    return v


def _axis_of(axes: tuple[Any, ...], index: Any) -> Any:
    return axes[index[0]][index[1]] if isinstance(index, tuple) else axes[index]


def _inside(maps: _Maps, f: Any, *args: Any) -> Any:
    """`f(*args)` on each slice of the unnamed axes already mapped (`maps`), at the
    front of every argument."""
    for _ in maps:
        f = jax.vmap(f)
    return f(*args)


def _remapped(maps: _Maps, names, name, joined: list[int], extras: int) -> _Maps:
    """`maps` once `name` is joined: its tag gone, and the folded arguments and
    the extras mapped along every unnamed axis (`_materialise`)."""
    keep = [n != name for n in names]
    out = []
    for n, axes in maps:
        new = list(axes)
        for i in joined:
            new[i] = 0
        new[2] = (0,) * extras
        new[5] = tuple(a for a, k in zip(axes[5], keep) if k)
        out.append((n, tuple(new)))
    return tuple(out)


def _not_differentiated(f: Any, name: str) -> Any:
    """`f`, with a clear error when differentiated: a product of the backward pass
    is, only by a second derivative."""

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


class _Bilinear(VJPRule):
    """The quantised core as a rule of the library's one custom-VJP function (so
    its cotangents have their primals' dtypes, and forward mode is a clear
    error): `op` computed with the three products of `recipe`, the named `vmap`
    axes `names` joined, the collective ones `spanned` by the per-tensor
    scales. Called as `(a, b, key=, extras=, tags=)`: `extras` the operation's
    other operands (group sizes), `tags` one `lax.axis_index` per name of
    `names`."""

    op: Op = eqx.field(static=True)
    recipe: Custom = eqx.field(static=True)
    names: tuple[Hashable, ...] = eqx.field(static=True, default=())
    spanned: tuple[Hashable, ...] = eqx.field(static=True, default=())

    elementwise: ClassVar[bool] = False

    def rule_name(self) -> str:  # pyright: ignore[reportIncompatibleMethodOverride]
        return self.op.name

    def _product(self, role: str, spec: Product) -> Any:
        return product(self.op, role, spec, self.names, self.spanned)

    def primal(
        self, a: Array, b: Array, *, key: Any = None, extras=(), tags=()
    ) -> Array:
        k = product_keys(key)
        a32, b32 = a.astype(_F32), b.astype(_F32)
        y = self._product("fwd", self.recipe.fwd)(a32, b32, extras, None, k[0], tags)
        return y.astype(jnp.result_type(a, b))

    def bwd(
        self, residuals: Any, cotangent: Array, args: tuple[Any, ...], **kwargs: Any
    ) -> tuple[Array, Array]:
        a, b = args
        k = product_keys(kwargs.get("key"))
        extras, tags = kwargs.get("extras", ()), kwargs.get("tags", ())
        a32, b32 = a.astype(_F32), b.astype(_F32)
        dy = cotangent.astype(_F32)
        da = self._product("dx", self.recipe.dx)(dy, b32, extras, a32, k[1], tags)
        db = self._product("dw", self.recipe.dw)(a32, dy, extras, b32, k[2], tags)
        return da, db
