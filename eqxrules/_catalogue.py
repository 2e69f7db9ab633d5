"""The one way a rule is declared: the `Rule` bases and the shared custom-derivative
functions every rule calls.

A rule is an `eqx.Module` subclass of [`JVPRule`][] or [`VJPRule`][]. The subclass is
the whole declaration:

- its fields are the hyperparameters, each declared once with
  [`hyperparameter`][eqxrules.hyperparameter] (default and checks: validated when
  the Module is built, and the source of the misuse tests' invalid values), and any
  wrapped sub-models (dynamic, so their parameters receive tangents);
- `primal` computes the value, and `tangent` (for `JVPRule`) or `fwd`/`bwd` (for
  `VJPRule`) the derivative. These are the only place the rule's maths is code;
- the class docstring holds the maths as a formula and `summary` as one line of
  text, from which the functional form's docstring and the README table derive;
- `kinks()` says where, for this instance's hyperparameters, the derivative jumps;
- `reference_forward`, `reference_derivative` and `reference_vjp` are *independent*
  references that the tests and `python -m eqxrules` check the rule against.

A public subclass in `eqxrules._rules` is registered in [`catalogue`][] as it is
defined, with its functional form derived from it. Yours (defined elsewhere) are
registered only if asked, with `functional(..., register=True)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PRNGKeyArray

from . import _registry
from ._hyper import Invalid, check_fields, invalid_constructions
from ._inputs import check_float_array, check_key
from ._registry import Domain, Entry, catalogue, functional
from ._tangents import (
    _align_tangents,
    _is_none_leaf,
    _match_cotangents,
    _match_dtypes,
)
from ._typing import PyTree
from ._vjp_slot import rule_cotangent, split_cotangents

_T = TypeVar("_T")

REVERSE_ONLY_MESSAGE = "supports reverse mode only"
# JAX's own words when forward mode meets a `custom_vjp` (stable since jax 0.2).
_JAX_REVERSE_ONLY = "can't apply forward-mode autodiff"


class Rule(eqx.Module):
    """Base class of every catalogue rule. Subclass [`JVPRule`][] or [`VJPRule`][].

    Class variables a rule sets, where it differs from the default:

    - `summary`: the maths in one line of text, shown in the catalogue table and the
        functional form's docstring.
    - `exact` (default `False`): `True` if the rule's derivative is the true
        derivative of its value (so finite differences apply).
    - `elementwise` (default `True`): `True` if the rule takes one floating-point
        array and rejects integer and bool input with a `TypeError`.
    - `domain`: a [`Domain`][] for test inputs: range and shape,
        `Domain(low=..., high=..., shape=...)`. Its kinks come from `kinks()`, per
        instance; a range left at the default `[-2, 2]` is widened to cover them.
    - `pytree_input` (default `False`): `True` if `x` may be any pytree:
        floating-point leaves are transformed, every other leaf (integer and bool
        arrays, strings, Python numbers, `None`) comes back unchanged with no
        gradient, and the output has `x`'s structure.
    - `functional_name`: the functional form's name, where it is not the class
        name in snake case (`DoReFa` is `dorefa_quantize`).
    - `constant_on_non_negative` (default `False`): `True` if the value is the same
        on every input >= 0 (a sign: +1), so that [`quantize`][] warns where the
        rule would follow an activation that is never negative (a ReLU).
    """

    summary: ClassVar[str] = ""
    exact: ClassVar[bool] = False
    elementwise: ClassVar[bool] = True
    forward_mode: ClassVar[bool] = True
    domain: ClassVar[Domain] = Domain()
    pytree_input: ClassVar[bool] = False
    constant_on_non_negative: ClassVar[bool] = False
    function: ClassVar[Callable[..., Any] | None] = None
    functional_name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Registration cannot be forgotten: every public rule class of the library's
        # rule modules is in the catalogue. A user's subclass elsewhere is not,
        # unless it asks: `functional(..., register=True)`.
        # An abstract base (one declaring abstract methods, as `BlockQuantizer`)
        # is no rule of its own.
        abstract = any(
            getattr(v, "__isabstractmethod__", False) for v in vars(cls).values()
        )
        if (
            cls.__module__.startswith(_RULES_PACKAGE)
            and not cls.__name__.startswith("_")
            and not abstract
        ):
            _registry.register(cls)

    def __check_init__(self) -> None:
        check_fields(self, self.rule_name())

    def primal(self, *args: Any, **kwargs: Any) -> Any:
        """The value of the rule."""
        raise NotImplementedError

    def reference_forward(self, *args: Any, **kwargs: Any) -> Any:
        """An independent reference for the value."""
        raise NotImplementedError

    def reference_derivative(self, *args: Any, **kwargs: Any) -> Any:
        """A function whose ordinary autodiff derivative the rule's must equal."""
        raise NotImplementedError

    def reference_vjp(self, cotangent: Any, *args: Any, **kwargs: Any) -> Any:
        """Reference cotangents for `(self, *args)`, for rules whose backward is not
        linear in the cotangent (so no `reference_derivative` can express it)."""
        raise NotImplementedError

    @classmethod
    def examples(cls, key: PRNGKeyArray) -> Sequence[Rule]:
        """Instances, with representative hyperparameters, that the catalogue checks."""
        return [cls()]

    def kinks(self) -> tuple[float, ...]:
        """Where this instance's value or derivative jumps: test inputs hit these
        exactly, and finite differences keep away from them. Defaults to the
        class `domain`'s."""
        return type(self).domain.kinks

    def input_domain(self) -> Domain:
        """The class `domain` with this instance's `kinks()`, its range widened to
        cover them if the class declares none
        (`Domain.with_kinks`)."""
        return type(self).domain.with_kinks(self.kinks())

    @classmethod
    def invalid_hyperparameters(cls, key: PRNGKeyArray) -> list[Invalid]:
        """Constructions that must be rejected, derived from the field declarations:
        each bad value of each check of each hyperparameter, in place of that
        hyperparameter of the first example."""
        return invalid_constructions(cls.examples(key)[0])

    def needs_key(self) -> bool:
        """Whether this instance draws random numbers, and so must be called with
        `key=`. By default, whether `primal` requires a `key`; a rule whose
        hyperparameters decide it (`rounding="stochastic"`) takes `key=None` in
        `primal` and overrides this."""
        return _registry.key_parameter(type(self)) == "required"

    def call_kwargs(self, key: PRNGKeyArray) -> dict[str, Any]:
        """Keyword arguments the checks pass on each call: a PRNG key for an
        instance that needs one (`needs_key()`)."""
        return {"key": key} if self.needs_key() else {}

    def is_exact(self) -> bool:
        """Whether this instance's derivative is the true one. Defaults to `exact`;
        a rule whose hyperparameters change that (a `mode`, say) overrides it."""
        return self.exact

    def higher_order(self) -> bool:
        """Whether derivatives of every order (`grad∘grad`, `hessian`, ...) are those
        of plain autodiff through `reference_derivative` (or `reference_forward`,
        for a rule with `reference_vjp`), also for losses that are not linear in the
        output. Defaults to `is_exact()`. A rule that is not exact but declares its
        higher derivatives (a stop-gradient whose `primal` blocks them too, say)
        overrides it, and the test matrix then checks the claim."""
        return self.is_exact()

    def second_order(self) -> bool:
        """Whether this instance's derivative is differentiable, its second
        derivatives (the JVP and VJP of its VJP along a fixed cotangent:
        `check_rule(order=2)`) those of its references off its kinks, where
        `verify_rule` and `python -m eqxrules` check them. Defaults to `True`; a
        rule whose derivative is not (computed by a quantised product, say)
        returns `False`, reported "n/a". The catalogue's tests keep each
        declaration true both ways. (Weaker than `higher_order()`: every order,
        any loss.)"""
        return True

    def cotangent_thresholds(self) -> tuple[float, ...]:
        """Where this instance's backward pass changes with the size of the
        cotangent (a clipping level): the checks scale the random cotangent to
        either side of each (`check_rule`'s `cotangent_thresholds`), as well as
        by `1e-3` and `1e3`. None by default."""
        return ()

    @classmethod
    def rule_name(cls) -> str:
        """The name errors give: the functional form's, else the class's."""
        fn = cls.function
        if fn is not None:
            return fn.__name__
        return (
            _registry.functional_name(cls)
            if _registry.registered(cls)
            else (cls.__name__)
        )

    def _check_arity(self, args: tuple[Any, ...]) -> None:
        names = _registry.primal_arity(type(self))
        if names is not None and len(args) != len(names):
            listed = ", ".join(f"`{n}`" for n in names)
            raise TypeError(
                f"`{self.rule_name()}` takes {len(names)} positional argument(s) "
                f"({listed}), got {len(args)}."
            )

    def _one_input(self, args: tuple[Any, ...]) -> Any:
        """The one input `x` of a rule on any pytree (a Python float made an
        array)."""
        self._check_arity(args)
        (x,) = args
        return jnp.asarray(x) if isinstance(x, float) else x

    def _check_call(self, args: tuple[Any, ...]) -> None:
        if self.elementwise:
            hint = " (a rule of several inputs declares `elementwise = False`)"
            check_float_array(self.rule_name(), args, hint)

    def _key_kwargs(self, key: PRNGKeyArray | None) -> dict[str, Any]:
        # Every rule accepts `key=` so that it can sit in `eqx.nn.Sequential` (which
        # passes one to each layer); only a rule whose `primal` takes it receives it.
        if _registry.key_parameter(type(self)) is None:
            return {}
        if key is None and self.needs_key():
            raise TypeError(
                f"`{self.rule_name()}` needs a PRNG key: call it as `m(x, key=key)`."
            )
        if key is not None:
            check_key(self.rule_name(), key)
        return {"key": key}

    def _prepare(
        self, args: tuple[Any, ...], key: PRNGKeyArray | None, kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self._check_arity(args)
        args = tuple(jnp.asarray(a) if isinstance(a, float) else a for a in args)
        self._check_call(args)
        return args, {**kwargs, **self._key_kwargs(key)}


_RULES_PACKAGE = f"{__name__.rpartition('.')[0]}._rules."


class JVPRule(Rule):
    """A rule with a custom JVP (`eqx.filter_custom_jvp`): forward and reverse mode.

    Subclasses define `primal(*args, **kwargs)` and
    `tangent(args, t_args, t_self, out, **kwargs)`. The tangents are `None` where they
    are symbolic zeros; `tangent` must be linear in them and may return `None` for a
    zero output tangent. `t_self` holds the tangents of the Module's own array fields
    (a wrapped sub-model's parameters, say).
    """

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        **kwargs: Any,
    ) -> Any:
        """The tangent of the output: linear in `t_args` and `t_self`."""
        hint = (
            " (`slope` is read only by `ElementwiseRule`: subclass it instead)"
            if callable(getattr(self, "slope", None))
            else ""
        )
        raise NotImplementedError(
            f"`{self.rule_name()}` defines no `tangent`: a `JVPRule` gives its "
            f"derivative as `tangent(args, t_args, t_self, out)`{hint}."
        )

    def __call__(
        self, *args: Any, key: PRNGKeyArray | None = None, **kwargs: Any
    ) -> Any:
        """Apply the rule. `key` is a PRNG key for rules that draw random numbers;
        every other rule accepts and ignores it, as an Equinox layer does."""
        args, kwargs = self._prepare(args, key, kwargs)
        return apply_jvp_rule(self, *args, **kwargs)


class ElementwiseRule(JVPRule):
    r"""A rule on one floating-point array whose derivative is one number per
    element: the tangent is $t \cdot \mathrm{slope}(x)$, in the input's dtype.
    Subclasses define `primal` and `slope` instead of `tangent`.

    `slope(x)` returns a boolean mask (the tangent is $t$ where it holds, else 0),
    an array of slopes, or `None` for the identity ($t$ passes through). Where the
    slope is 0 (or the mask false) the tangent is selected to be exactly 0, never
    multiplied, in both modes: an inf or NaN tangent or cotangent there gives 0.
    """

    def slope(self, x: Array) -> Array | None:
        """The derivative per element: a boolean mask, an array of slopes (in
        `x`'s shape), or `None` for the identity."""
        raise NotImplementedError(
            f"`{self.rule_name()}` defines no `slope`: an `ElementwiseRule` gives its "
            "derivative as `slope(x)` (a mask, slopes, or `None` for the identity)."
        )

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        **kwargs: Any,
    ) -> Any:
        """`t · slope(x)`: `t` where the mask holds (or the slope is `None`), the
        product where the slope is non-zero, exactly 0 elsewhere."""
        (x,) = args
        (t,) = t_args
        if t is None:
            return None
        s = self.slope(x)
        if s is None:
            return t
        if s.dtype == jnp.bool_:
            return jnp.where(s, t, jnp.zeros_like(t))
        # Selected, not multiplied, where the slope is 0: an inf or NaN tangent
        # there gives 0, not `0 * inf`; and the transpose multiplies the selected
        # cotangent by a slope that is exactly 0 there.
        return jnp.where(s == 0, jnp.zeros_like(t), t * s)


class VJPRule(Rule):
    """A rule with a custom VJP (`eqx.filter_custom_vjp`): reverse mode only.

    For rules whose backward pass is not linear in the cotangent, or that must choose
    what is saved. Subclasses define `primal`, `bwd`, and optionally `fwd` (which by
    default saves nothing). Under `jax.jvp`, `jacfwd` or `hessian` the rule raises a
    `TypeError` that names it.

    A rule with learnable [`parameter`][eqxrules.parameter] fields (an implicit
    layer's weight, say) gives their cotangents from `bwd` too, in its declared
    slot: `bwd` returns `(cotangents of the arguments, {"W": cotangent of W,
    ...})`, one entry (or `None`, for a zero one) per parameter field. Returning
    the arguments' alone is a `TypeError` naming the fields, never a gradient
    silently 0.
    """

    forward_mode: ClassVar[bool] = False

    def fwd(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """The value and the residuals saved for `bwd`."""
        return self.primal(*args, **kwargs), None

    def bwd(
        self, residuals: Any, cotangent: Any, args: tuple[Any, ...], **kwargs: Any
    ) -> Any:
        """Cotangents for `args`, one per argument (`None` for a zero one); for a
        rule with `parameter` fields, `(those, {field: cotangent, ...})`."""
        raise NotImplementedError

    def __call__(
        self, *args: Any, key: PRNGKeyArray | None = None, **kwargs: Any
    ) -> Any:
        """Apply the rule. `key` is accepted (and ignored unless `primal` takes it)
        so that the rule can sit in `eqx.nn.Sequential`."""
        args, kwargs = self._prepare(args, key, kwargs)
        # Forward mode is not detected by inspecting tracers (their classes are
        # private and differ between JAX versions: before 0.7 `grad` used the same
        # JVP tracer as `jvp`). Instead JAX's own error, raised when `jvp` meets the
        # custom VJP during this call, is re-raised with the rule's name.
        try:
            return apply_vjp_rule((self, args), **kwargs)
        except TypeError as e:
            if _JAX_REVERSE_ONLY not in str(e):
                raise
            raise TypeError(
                f"`{self.rule_name()}` {REVERSE_ONLY_MESSAGE}: its backward pass is "
                "not linear in the cotangent, so it has no JVP. Use `jax.grad`, "
                "`jax.vjp` or `jax.jacrev` instead of `jax.jvp` or `jax.jacfwd`."
            ) from e


def no_tangent(out: PyTree) -> PyTree:
    """A symbolic-zero tangent for every leaf of `out` (a bare `None` is only
    accepted for a single-array output)."""
    return jtu.tree_map(lambda _: None, out)


def map_tangent(f: Callable[[Array, Array], Array], x: PyTree, t_x: PyTree) -> PyTree:
    """`f(leaf, tangent)` for every leaf of `x` with a tangent; `None` elsewhere."""
    if t_x is None:
        return no_tangent(x)
    return jtu.tree_map(
        lambda t, leaf: None if t is None else f(leaf, t), t_x, x, is_leaf=_is_none_leaf
    )


class PytreeRule(JVPRule):
    """Base of the rules that map any pytree `x` to a pytree of the same structure
    (`Detach`, `GradientReversal`, ...).

    `eqx.filter_custom_jvp` needs its outputs to be JAX types, so the non-array
    leaves of `x` (strings, Python numbers, `None`) are split off before the custom
    JVP and put back, untouched, after it. Integer and bool arrays go through it and
    get no tangent.
    """

    elementwise: ClassVar[bool] = False
    pytree_input: ClassVar[bool] = True

    def __call__(
        self, *args: PyTree, key: PRNGKeyArray | None = None, **kwargs: Any
    ) -> PyTree:
        arrays, other = eqx.partition(self._one_input(args), eqx.is_array)
        return eqx.combine(super().__call__(arrays, key=key, **kwargs), other)


def _as_arrays(args: Sequence[Any]) -> list[Any]:
    """`args` with each Python float (`jax.grad` of a Python float hands the rule
    JAX's own float subclass, with a `dtype` and no `astype`) as the 0-d array it
    stands for, so that a rule's maths sees arrays only."""
    return [
        jnp.asarray(a, getattr(a, "dtype", None)) if isinstance(a, float) else a
        for a in args
    ]


@eqx.filter_custom_jvp
def apply_jvp_rule(rule: JVPRule, *args: Any, **kwargs: Any) -> Any:
    """The module-level `eqx.filter_custom_jvp` function every `JVPRule` calls."""
    return rule.primal(*args, **kwargs)


@apply_jvp_rule.def_jvp
def _apply_jvp_rule_jvp(primals, tangents, **kwargs):
    rule, *args = primals
    t_rule, *t_args = tangents
    args = _as_arrays(args)
    # The value through the custom function itself, not `rule.primal`: a derivative
    # of this JVP (second order) then goes through the rule again, instead of
    # differentiating `primal` with plain autodiff.
    out = apply_jvp_rule(rule, *args, **kwargs)
    t_out = rule.tangent(tuple(args), tuple(t_args), t_rule, out, **kwargs)
    # A `None` may stand for a whole zero subtree of a pytree output; Equinox wants
    # one per leaf.
    return out, _match_dtypes(_align_tangents(out, t_out), out)


@eqx.filter_custom_vjp
def apply_vjp_rule(rule_and_args: tuple[VJPRule, tuple[Any, ...]], **kwargs: Any):
    """The module-level `eqx.filter_custom_vjp` function every `VJPRule` calls."""
    rule, args = rule_and_args
    return rule.primal(*args, **kwargs)


@apply_vjp_rule.def_fwd
def _apply_vjp_rule_fwd(perturbed, rule_and_args, **kwargs):
    del perturbed
    rule, args = rule_and_args
    return rule.fwd(*_as_arrays(args), **kwargs)


@apply_vjp_rule.def_bwd
def _apply_vjp_rule_bwd(residuals, cotangent, perturbed, rule_and_args, **kwargs):
    rule, args = rule_and_args
    args = tuple(_as_arrays(args))
    perturbed_rule, perturbed_args = perturbed
    ct_args, ct_params = split_cotangents(
        rule, rule.bwd(residuals, cotangent, args, **kwargs)
    )
    # JAX lets a bfloat16 primal receive a float32 cotangent; we do not. Under
    # `shard_map`, a replicated argument's cotangent is summed over the devices.
    ct_args = _match_cotangents(tuple(ct_args), args)
    ct_args = jtu.tree_map(
        lambda ct, p: ct if p else None,
        ct_args,
        perturbed_args,
        is_leaf=lambda t: t is None,
    )
    return rule_cotangent(rule, ct_params, perturbed_rule), ct_args


__all__ = [
    "Domain",
    "ElementwiseRule",
    "Entry",
    "JVPRule",
    "PytreeRule",
    "Rule",
    "VJPRule",
    "apply_jvp_rule",
    "apply_vjp_rule",
    "catalogue",
    "functional",
    "map_tangent",
    "no_tangent",
]
