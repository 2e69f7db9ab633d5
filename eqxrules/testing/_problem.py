"""`_Problem`: what every check shares. The split of `args` into differentiable
leaves and the rest, the rule and its references as functions of the differentiable
leaves, the random tangents and cotangents, and the compiled programs.

Everything is computed on first use, so that a check that is not run costs nothing:
no random draw, no trace, no compile. Random draws and the checker's arithmetic are
done in NumPy on the host (an eager JAX operation compiles a program per leaf shape);
only the rule and its references run as compiled programs (`_programs.jit`).
"""

from __future__ import annotations

import dataclasses
import functools as ft
import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PRNGKeyArray

from . import _core, _programs
from ._compare import (
    Inputs,
    KeyPath,
    _compare,
    _is_inexact,
    _is_none,
    _lowest_precision,
    _scalar,
)
from ._core import _is_reverse_only_error, _Part


def _entropy(key: PRNGKeyArray | None) -> list[int]:
    """The bits of a PRNG key (typed or raw `uint32`), to seed NumPy with."""
    if key is None:
        return [0, 0]  # the bits of `jax.random.key(0)`
    if jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return [int(b) for b in np.asarray(key).ravel()]


def _device(tree: Any) -> Any:
    """NumPy leaves of `tree` as JAX arrays (a transfer, no compiled program), so a
    rule never sees NumPy semantics; float0 leaves stay NumPy, as JAX has them."""

    def put(x: Any) -> Any:
        if isinstance(x, np.ndarray) and x.dtype != jax.dtypes.float0:
            return jax.device_put(x)
        return x

    return jtu.tree_map(put, tree)


def _random_like(rng: np.random.Generator, tree: Any) -> Any:
    """Standard-normal arrays, drawn on the host, shaped like the inexact leaves of
    `tree` (arrays or `jax.ShapeDtypeStruct`s); float0 zeros for the other array
    leaves; `None` elsewhere."""
    leaves, treedef = jtu.tree_flatten(tree, is_leaf=_is_none)
    out = []
    for leaf in leaves:
        if _is_inexact(leaf):
            x = rng.standard_normal(leaf.shape, dtype=np.float32)
            out.append(jax.device_put(x.astype(jnp.dtype(leaf.dtype))))
        elif eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):
            out.append(np.zeros(leaf.shape, jax.dtypes.float0))
        else:
            out.append(None)
    return jtu.tree_unflatten(treedef, out)


def _zeros_like(tree: Any) -> Any:
    return _device(jtu.tree_map(lambda x: np.zeros(x.shape, jnp.dtype(x.dtype)), tree))


def _fill(tree: Any, like: Any) -> Any:
    """`tree` aligned to `like` (whose leaves may be `None`), with `None` in `tree`
    standing for zeros of `like`'s leaf."""

    def fill(lk, t):
        if lk is None:
            return None
        if t is None:
            return jtu.tree_map(jnp.zeros_like, lk)
        return t

    return jtu.tree_map(fill, like, tree, is_leaf=_is_none)


def _arg_names(fn: Callable[..., Any], n: int) -> tuple[str, ...]:
    """The names `fn`'s signature gives its first `n` positional arguments, as the
    user wrote them (`lambda m, x: m(x)`: `m`, `x`); `args[i]` where it gives none
    (past a `*args`, or no signature)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )
    return tuple(
        params[i].name
        if i < len(params) and params[i].kind in positional
        else f"args[{i}]"
        for i in range(n)
    )


def _untransposable(e: BaseException) -> bool:
    """Whether `e` is what JAX raises when reverse mode transposes a JVP that is
    not linear in its tangent: a bare `AssertionError` (a product of tangents, a
    branch on one), or no transpose rule for the primitive applied to one."""
    if type(e) is AssertionError:
        return True
    return isinstance(e, NotImplementedError) and "Transpose rule" in str(e)


@dataclasses.dataclass(frozen=True)
class _Group:
    """One differentiable argument, or one field of a Module argument: what the
    `held_fixed` check perturbs alone. `get` takes its part of the differentiable
    leaves; `put` puts a replacement back; `path` is where it is among them."""

    label: str
    index: int
    field: str | None

    @property
    def path(self) -> KeyPath:
        index = (jtu.SequenceKey(self.index),)
        return index if self.field is None else (*index, jtu.GetAttrKey(self.field))

    def get(self, diff: tuple[Any, ...]) -> Any:
        arg = diff[self.index]
        return arg if self.field is None else getattr(arg, self.field)

    def put(self, diff: tuple[Any, ...], part: Any) -> tuple[Any, ...]:
        arg, field = part, self.field
        if field is not None:
            arg = eqx.tree_at(
                lambda m: getattr(m, field),
                diff[self.index],
                part,
                is_leaf=_is_none,
            )
        return diff[: self.index] + (arg,) + diff[self.index + 1 :]


def _groups(diff: tuple[Any, ...], names: tuple[str, ...]) -> list[_Group]:
    """Each top-level argument holding inexact arrays is a group; a Module argument
    is split into its fields that hold inexact arrays. `names`: the arguments'."""
    groups = []
    for i, arg in enumerate(diff):
        leaves = jtu.tree_flatten_with_path(arg)[0]
        if not leaves:
            continue
        keys = [path[0] if path else None for path, _ in leaves]
        if isinstance(arg, eqx.Module) and all(
            isinstance(k, jtu.GetAttrKey) for k in keys
        ):
            fields = dict.fromkeys(k.name for k in keys)  # type: ignore[union-attr]
            groups += [_Group(f"{names[i]}.{n}", i, n) for n in fields]
        else:
            groups.append(_Group(names[i], i, None))
    return groups


class _Problem:
    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        forward: Callable[..., Any] | None,
        derivative: Callable[..., Any] | None,
        reference_vjp: Callable[..., Any] | None,
        key: PRNGKeyArray | None,
        rtol: float | None,
        atol: float | None,
        modes: tuple[str, ...],
    ):
        self.args = args
        self.diff, self.static = eqx.partition(args, eqx.is_inexact_array)
        if not jtu.tree_leaves(self.diff):
            raise TypeError(
                "`check_rule`: `args` hold no floating-point array, so there is "
                "nothing to differentiate. Pass at least one inexact (float or "
                "complex) array, or a Module holding one."
            )
        self.fn = fn
        self.names = _arg_names(fn, len(args))
        self.forward = forward
        self.derivative = derivative
        self.reference_vjp = reference_vjp
        self.rtol, self.atol = rtol, atol
        self.modes = modes
        streams = ("t", "t2", "ct", "batch", "fd", "ct2")
        seeds = np.random.SeedSequence(_entropy(key)).spawn(len(streams))
        self.seeds: dict[str, np.random.SeedSequence] = dict(zip(streams, seeds))
        # Whether an element where a reference is NaN goes unchecked
        # (`check_rule(..., where_reference_nan="any")`).
        self.unchecked_nan = False
        self._forward_mode: bool | None = None if "fwd" in modes else False
        self._forward_error: BaseException | None = None

    def rng(self, stream: str) -> np.random.Generator:
        """A fresh generator per use, so a check's draws do not depend on which
        checks ran before it."""
        return np.random.default_rng(self.seeds[stream])

    @ft.cached_property
    def _out_shape(self) -> tuple[Any, BaseException | None]:
        try:
            return eqx.filter_eval_shape(self.f, self.diff), None
        except Exception as e:
            return None, e

    @property
    def out_shape(self) -> Any:
        """The output's shapes and dtypes: a trace, no compile. (If the rule raised,
        the same exception again, not another trace.)"""
        value, error = self._out_shape
        if error is not None:
            raise error
        return value

    @ft.cached_property
    def ct(self) -> Any:
        return _random_like(self.rng("ct"), self.out_shape)

    @ft.cached_property
    def t(self) -> Any:
        return _random_like(self.rng("t"), self.diff)

    @ft.cached_property
    def out(self) -> Any:
        """`fn(*args)`, evaluated eagerly (the `jit` check compares with it)."""
        return self.f(self.diff)

    def combine(self, d: Any) -> tuple[Any, ...]:
        return eqx.combine(d, self.static)

    def f(self, d: Any) -> Any:
        return self.fn(*self.combine(d))

    def g(self, d: Any) -> Any:
        assert self.derivative is not None
        return self.derivative(*self.combine(d))

    def jvp(self, d: Any, t: Any, fn: Callable[[Any], Any] | None = None) -> Any:
        return jax.jvp(fn or self.f, (d,), (t,))[1]

    def vjp(self, d: Any, ct: Any, fn: Callable[[Any], Any] | None = None) -> Any:
        _, pullback = jax.vjp(fn or self.f, d)
        return pullback(ct)[0]

    @property
    def has_reference(self) -> bool:
        return self.derivative is not None or self.reference_vjp is not None

    def reference_cotangent(self, d: Any, ct: Any) -> Any:
        # `d` is an argument (not `self.diff` closed over) so that, under `jax.jit`,
        # the point is not a constant for XLA to fold: folding a large model's
        # weights into the program costs seconds.
        if self.reference_vjp is not None:
            ref = self.reference_vjp(ct, *self.combine(d))
            # `None` may stand for a whole subtree (the rule Module, say).
            ref = jtu.tree_map(
                lambda r, d: jtu.tree_map(lambda _: None, d) if r is None else r,
                ref,
                self.args,
                is_leaf=_is_none,
            )
            return _fill(eqx.filter(ref, eqx.is_array), self.diff)
        return self.vjp(d, ct, self.g)

    @property
    def forward_mode_known(self) -> bool:
        return self._forward_mode is not None or self._forward_error is not None

    def forward_mode(
        self, jvp: _programs.Program | None = None, *args: Any
    ) -> bool | None:
        """Whether the rule has forward mode: `False` if it is reverse-only (or
        forward mode was not asked for), `None` if its JVP raised something else
        (the checks that use it then fail with that exception). Found out once, by
        lowering (not compiling) a JVP program: `jvp` at `args` if given (one a
        check is about to run anyway), else the rule's at the point. JAX reports
        forward mode through a `custom_vjp` under `jit` only when lowering."""
        if not self.forward_mode_known and jvp is None and self.uses_core():
            self._core  # noqa: B018  (building the core finds it out, if it can)
        if not self.forward_mode_known:
            if jvp is None:
                # The point stands in for the tangent: only shapes matter here.
                jvp, args = _programs.jit(self.jvp), (self.diff, self.diff)
            try:
                jvp.lower(*args)
            except Exception as e:
                self._forward_error = e
                if _is_reverse_only_error(e):
                    self._forward_mode = False
            else:
                self._forward_mode = True
        return self._forward_mode

    @property
    def groups(self) -> list[_Group]:
        return _groups(self.diff, self.names)

    def arg_name(self, path: KeyPath) -> str:
        """The argument leaf at `path` among the arguments, named as the user wrote
        it: `x`, `m.sub_model.weight` (`args` for them all)."""
        if not path:
            return "args"
        return self.names[path[0].idx] + jtu.keystr(tuple(path[1:]))

    def untransposable(self, e: BaseException) -> str | None:
        """Why reverse mode raised `e`, if it is JAX failing to transpose a JVP
        that is not linear in its tangent (its forward mode evaluates)."""
        if not _untransposable(e) or self._rule_jvp[1] is not None:
            return None
        return (
            "the rule's JVP is not linear in its tangent, so JAX cannot transpose "
            "it into a VJP; the `linearity` check shows it in forward mode (JAX "
            f"raised {type(e).__name__}: {e})"
        )

    # Each compiled program is built once per problem and shared by the checks.
    @ft.cached_property
    def jvp_jit(self) -> Callable[..., Any]:
        return _Part(self, "jvp", self.jvp)

    @ft.cached_property
    def vjp_jit(self) -> Callable[..., Any]:
        return _Part(self, "vjp", self.vjp)

    @ft.cached_property
    def reference_jvp_jit(self) -> Callable[..., Any]:
        return _Part(self, "reference_jvp", ft.partial(self.jvp, fn=self.g))

    @ft.cached_property
    def reference_vjp_jit(self) -> Callable[..., Any]:
        return _Part(self, "reference_vjp", self.reference_cotangent)

    @ft.cached_property
    def f_jit(self) -> Callable[..., Any]:
        return _Part(self, "out", self.f)

    def forward_at(self, d: Any) -> Any:
        assert self.forward is not None
        return self.forward(*self.combine(d))

    @ft.cached_property
    def forward_jit(self) -> Callable[..., Any]:
        """The `forward` reference at `d`: jitted in the core, else evaluated
        eagerly (a reference may be written in NumPy, on concrete values)."""
        return _Part(self, "forward", self.forward_at, eager=True)

    _forward_traceable = True
    """Whether the core may trace the `forward` reference (until it fails to)."""

    @ft.cached_property
    def u(self) -> Any:
        """The second cotangent, for the VJP of the VJP."""
        return _random_like(self.rng("ct2"), self.diff)

    def second_order_jit(self, part: str) -> Callable[..., Any]:
        """`part` of the second derivatives (`_core.second_order`)."""
        return _core.second_order(self, part)

    # The core: one program for every part above, at `(d, t, ct, u)`.
    options: Any = None
    """The call's `_Options` and selected checks (`(options, selected)`), set by
    `_run`: which second derivatives the core computes."""

    _core_names: frozenset[str] = frozenset()
    """The parts the core computes."""

    def uses_core(self) -> bool:
        """Whether a selected check reads a part of the core."""
        _, selected = self.options or (None, frozenset())
        return bool(_core.needed(selected))

    @ft.cached_property
    def _core(self) -> _programs.Program | None:
        """One program for the rule's and the references' value, first derivatives
        and (with `order=2`) second derivatives (`_core.build`)."""
        return _core.build(self)

    @ft.cached_property
    def _rule_jvp(self) -> tuple[Any, BaseException | None]:
        try:
            return self.jvp_jit(self.diff, self.t), None
        except Exception as e:
            return None, e

    @ft.cached_property
    def _rule_vjp(self) -> tuple[Any, BaseException | None]:
        try:
            return self.vjp_jit(self.diff, self.ct), None
        except Exception as e:
            return None, e

    @property
    def rule_jvp(self) -> Any:
        """The rule's JVP at the point along `t`, computed once (and, if it raised,
        raising the same exception again rather than compiling again)."""
        value, error = self._rule_jvp
        if error is not None:
            raise error
        return value

    @property
    def rule_vjp(self) -> Any:
        value, error = self._rule_vjp
        if error is not None:
            raise error
        return value

    @ft.cached_property
    def reference_vjp_value(self) -> Any:
        return self.reference_vjp_jit(self.diff, self.ct)

    def compare(
        self,
        actual: Any,
        expected: Any,
        prefix: str,
        *,
        point: Any = None,
        reference: bool = False,
        **kw: Any,
    ) -> dict[str, Any]:
        """Compare trees shaped like the output, named `prefix` (`"jvp(out)"`). A
        failure at an element gives the element there of each input of the leaf's
        shape: the input element of an elementwise rule. A Module argument's arrays
        are its parameters, which an output element does not follow index by index,
        so they are left out. `reference`: `expected` comes from a reference (so
        its NaN may go unchecked), not from the rule itself."""

        def same_shape(path: KeyPath, shape: Any, p: KeyPath, x: Any) -> bool:
            module = isinstance(self.args[p[0].idx], eqx.Module)
            return np.shape(x) == shape and not module

        inputs = self._inputs(point, same_shape)
        kw.setdefault("unchecked_nan", reference and self.unchecked_nan)
        return self._compare(actual, expected, prefix, inputs, **kw)

    def compare_args(
        self,
        actual: Any,
        expected: Any,
        template: str = "{}",
        *,
        at: KeyPath = (),
        point: Any = None,
        reference: bool = False,
        **kw: Any,
    ) -> dict[str, Any]:
        """Compare trees shaped like the arguments (or their part at path `at`),
        each leaf named by its argument in `template` (`"vmap(vjp)({})"`). A
        failure at an element gives the argument's element there. `reference`: as
        for `compare`."""

        def name(path: KeyPath) -> str:
            return template.format(self.arg_name((*at, *path)))

        def same_leaf(path: KeyPath, shape: Any, p: KeyPath, x: Any) -> bool:
            return p == (*at, *path)

        inputs = self._inputs(point, same_leaf)
        kw.setdefault("unchecked_nan", reference and self.unchecked_nan)
        return self._compare(actual, expected, name, inputs, **kw)

    def _inputs(self, point: Any, keep: Callable[..., bool]) -> Inputs:
        """The input elements at a failing index: of the argument leaves (at
        `point`, the point checked by default) that `keep(path, shape, p, x)`
        keeps for the failing leaf at `path` of shape `shape`."""
        leaves = jtu.tree_flatten_with_path(self.diff if point is None else point)[0]

        def inputs(path: KeyPath, shape: tuple[int, ...], index: tuple[int, ...]):
            return {
                self.arg_name(p): _scalar(np.asarray(x)[index])
                for p, x in leaves
                if keep(path, shape, p, x)
            }

        return inputs

    def _compare(self, actual, expected, prefix, inputs: Inputs, **kw):
        # Tolerances follow the least precise dtype among the inputs and outputs: a
        # bfloat16 rule is only as exact as bfloat16, whatever its cotangents' dtype.
        tolerances = dict(
            rtol=self.rtol,
            atol=self.atol,
            floor=_lowest_precision(self.diff, self.out_shape),
        )
        return _compare(
            actual, expected, prefix=prefix, inputs=inputs, **{**tolerances, **kw}
        )
