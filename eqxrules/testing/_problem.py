"""`_Problem`: what every check shares. The split of `args` into differentiable
leaves and the rest, the rule and its references as functions of the differentiable
leaves, the random tangents and cotangents, and the compiled programs.

Everything is computed on first use, so that a check that is not run costs nothing:
no random draw, no trace, no compile. Random draws and the checker's arithmetic are
done in NumPy on the host (an eager JAX operation compiles a program per leaf shape);
only the rule and its references run as compiled programs (`_programs.jit`).
"""

from __future__ import annotations

import functools as ft
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PRNGKeyArray

from . import _core, _programs, _reuse
from ._compare import (
    Inputs,
    KeyPath,
    _compare,
    _is_inexact,
    _is_none,
    _lowest_precision,
    _scalar,
)
from ._core import _Part
from ._groups import _arg_names, _Group, _groups
from ._host import _entropy, _fill, _random_like
from ._options import _is_reverse_only_error, _untransposable

TangentSpace = Callable[[Any], Any] | Sequence[Callable[[Any], Any] | None] | None
"""`check_rule`'s `tangent_space`: one projection for every argument, or one per
argument (`None` for an unconstrained one)."""


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
        tangent_space: TangentSpace = None,
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
        self.spaces = _spaces(tangent_space, len(args))
        self._core_memo: tuple[tuple[Any, ...], Any] | None = None

    def rng(self, stream: str) -> np.random.Generator:
        """A fresh generator per use, so a check's draws do not depend on which
        checks ran before it."""
        return np.random.default_rng(self.seeds[stream])

    @ft.cached_property
    def _out_shape(self) -> tuple[Any, BaseException | None]:
        k = _reuse.key(self, "out_shape")
        found = _reuse.get(k)
        if found is not None and "out_shape" in found:
            return found["out_shape"]
        try:
            value = eqx.filter_eval_shape(self.f, self.diff), None
        except Exception as e:
            return None, e
        _reuse.put(k, self, out_shape=value)
        return value

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
        return self.tangent(self.rng("t"))

    def tangent(self, rng: np.random.Generator, point: Any = None) -> Any:
        """A random tangent at the point (or at `point`, shaped like it), in each
        argument's tangent space (`tangent_space`)."""
        return self.project(_random_like(rng, self.diff if point is None else point))

    def project(self, tree: Any, at: KeyPath = ()) -> Any:
        """`tree`, shaped like the differentiable arguments (or like their part at
        path `at`), with each argument's tangent-space projection applied to its
        part: a tangent drawn at random, or a cotangent about to be compared (a
        cotangent is defined only up to what the tangent space cannot see)."""
        if not any(self.spaces):
            return tree
        if at:
            space = self.spaces[at[0].idx] if len(at) == 1 else None
            return tree if space is None or tree is None else _apply(space, tree)
        return tuple(
            t if space is None or t is None else _apply(space, t)
            for space, t in zip(self.spaces, tree, strict=True)
        )

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
        """The second cotangent, for the VJP of the VJP: a cotangent of the rule's
        cotangents, in the arguments' tangent spaces."""
        return self.tangent(self.rng("ct2"))

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
        kw.setdefault("unchecked_inf", reference and self.unchecked_nan)
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
        kw.setdefault("unchecked_inf", reference and self.unchecked_nan)
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


def _spaces(tangent_space: TangentSpace, n: int) -> tuple[Any, ...]:
    """One projection (or `None`) per argument, from `check_rule`'s
    `tangent_space` (validated there)."""
    if tangent_space is None:
        return (None,) * n
    if callable(tangent_space):
        return (tangent_space,) * n
    return tuple(tangent_space)


def _apply(space: Callable[[Any], Any], tree: Any) -> Any:
    """`space(tree)` in `tree`'s dtypes, where `tree` holds inexact arrays (a
    float0 or `None` tangent has no direction to project)."""
    leaves = [x for x in jtu.tree_leaves(tree) if _is_inexact(x)]
    if not leaves:
        return tree
    out = space(tree)
    return jtu.tree_map(
        lambda y, x: y.astype(x.dtype) if _is_inexact(x) else x, out, tree
    )
