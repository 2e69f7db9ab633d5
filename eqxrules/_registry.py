"""The catalogue: the registry every library rule joins when its class is defined,
the functional forms derived from the classes, and the [`Entry`][] records the
tests, the command line and the README read.

It knows rules only through their class attributes (it imports no rule and no rule
base), so `_catalogue` can register each class as it is defined without an import
loop.
"""

from __future__ import annotations

import dataclasses
import functools as ft
import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
from jaxtyping import PRNGKeyArray

from ._domain import Args, Domain as Domain
from ._hyper import declarations, parameters, undeclared

_F = TypeVar("_F", bound=Callable[..., Any])


_REGISTRY: list[type] = []
_LIBRARY: set[type] = set()  # registered by definition, not by `functional`
_BASES = f"{__name__.rpartition('.')[0]}._catalogue"


def register(rule: type) -> None:
    """Add `rule` to the catalogue (a library rule, as its class is defined)."""
    if rule not in _REGISTRY:
        _REGISTRY.append(rule)
        _LIBRARY.add(rule)


def registered(rule: type) -> bool:
    return rule in _REGISTRY


def functional_name(rule: type) -> str:
    """`rule.functional_name`, or the class name in snake case."""
    declared = rule.__dict__.get("functional_name")
    if declared:
        return declared
    return re.sub(r"(?<!^)(?=[A-Z])", "_", rule.__name__).lower()


@ft.cache
def key_parameter(rule: type) -> str | None:
    """How `rule.primal` takes a PRNG key: `"required"` (a `key` parameter without a
    default), `"optional"` (with one) or `None` (no `key` parameter)."""
    param = inspect.signature(rule.primal).parameters.get("key")
    if param is None:
        return None
    return "required" if param.default is param.empty else "optional"


@ft.cache
def primal_arity(rule: type) -> tuple[str, ...] | None:
    """The names of `rule.primal`'s positional parameters (after `self`), or `None`
    if it takes `*args`."""
    params = list(inspect.signature(rule.primal).parameters.values())[1:]
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    positional = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )
    return tuple(p.name for p in params if p.kind in positional)


def _bare(sig: inspect.Signature) -> inspect.Signature:
    """`sig` without annotations, as a reader writes the call."""
    empty = inspect.Parameter.empty
    return sig.replace(
        parameters=[p.replace(annotation=empty) for p in sig.parameters.values()],
        return_annotation=empty,
    )


def _describe_form(rule: type, fn: Callable[..., Any]) -> str:
    call = f"{fn.__name__}{_bare(inspect.signature(fn))}"
    return f"Functional form of [`{rule.__name__}`][]: `{call}`.\n\n{rule.summary}."


def functional(rule: type, *, register: bool = False) -> Callable[[_F], _F]:
    """Declare `fn` as the functional form of `rule`, where the derived one (the
    inputs of `primal`, then its hyperparameters by keyword) does not fit: a wrapper
    that takes the wrapped callable first, say. `fn` must do nothing but build the
    Module and call it. Its docstring, if it has none, is derived from the rule's
    `summary`.

    **Arguments:**

    - `rule`: the rule class.
    - `register`: for a rule defined outside eqxrules, whether it joins
        [`catalogue`][] (and so `python -m eqxrules`). By default it does not: the
        catalogue is the library's. Verify your own rule with
        [`eqxrules.verify_rule`][] instead.

    !!! Example

        ```python
        @eqxrules.functional(Twice)
        def twice(x, *, factor=2.0):
            return Twice(factor=factor)(x)
        ```
    """
    if not isinstance(rule, type):
        raise TypeError(
            f"`functional`: `rule` must be a rule class, not "
            f"{type(rule).__name__} (={rule!r})."
        )
    if not isinstance(register, bool):
        raise TypeError(
            f"`functional`: `register` must be a bool, not "
            f"{type(register).__name__} (={register!r})."
        )

    def decorator(fn: _F) -> _F:
        if rule.__dict__.get("function") is not None:
            # Read through the class: Equinox < 0.12 keeps a method wrapper in
            # `__dict__`, which has no `__name__`.
            raise ValueError(
                f"`{rule.__name__}` already has a functional form "
                f"`{rule.function.__name__}`."
            )
        if not fn.__doc__:
            fn.__doc__ = _describe_form(rule, fn)
        rule.function = fn  # type: ignore[attr-defined]
        if register and rule not in _REGISTRY:
            _REGISTRY.append(rule)
        return fn

    return decorator


def _accepted(primal: inspect.Signature, name: str) -> Any:
    """The annotation of the functional form's input `name`: `primal`'s, where an
    `Array` is also accepted as anything array-like (a NumPy array, a float):
    `Float[Array, "*shape"]` becomes `Float[ArrayLike, "*shape"]`."""
    annotation = primal.parameters[name].annotation
    if isinstance(annotation, str):
        return re.sub(r"\bArray\b", "ArrayLike", annotation, count=1)
    return annotation


def _derived_form(rule: type) -> Callable[..., Any]:
    """`name(x, [parameters...,] [key,] positional hyperparameters..., *,
    hyperparameters...)`: builds `rule` from the arguments given (the Module's own
    defaults for the others) and calls it. Learnable
    [`parameter`][eqxrules._hyper.parameter]s without a default (a learned step,
    say) are positional after the inputs; a hyperparameter is keyword-only unless
    declared with `hyperparameter(..., positional=True)`."""
    name = functional_name(rule)
    inputs = primal_arity(rule) or ("x",)
    P = inspect.Parameter
    primal = inspect.signature(rule.primal)
    params = [
        P(n, P.POSITIONAL_OR_KEYWORD, annotation=_accepted(primal, n)) for n in inputs
    ]
    learnable = set(parameters(rule))
    positional = [
        f
        for f in dataclasses.fields(rule)
        if f.name in learnable and f.default is dataclasses.MISSING
    ]
    params += [
        P(f.name, P.POSITIONAL_OR_KEYWORD, annotation=f.type) for f in positional
    ]
    needs_key = key_parameter(rule)
    if needs_key == "required":
        params.append(P("key", P.POSITIONAL_OR_KEYWORD, annotation="PRNGKeyArray"))
    fields = [f.name for f in dataclasses.fields(rule)]
    declared = declarations(rule)
    for f in dataclasses.fields(rule):
        if f in positional:
            continue
        default = P.empty if f.default is dataclasses.MISSING else f.default
        by_position = f.name in declared and declared[f.name].positional
        kind = P.POSITIONAL_OR_KEYWORD if by_position else P.KEYWORD_ONLY
        params.append(P(f.name, kind, default=default, annotation=f.type))
    if needs_key == "optional":
        params.append(
            P("key", P.KEYWORD_ONLY, default=None, annotation="PRNGKeyArray | None")
        )
    try:
        signature = inspect.Signature(
            params, return_annotation=primal.return_annotation
        )
    except ValueError as e:
        raise TypeError(
            f"`{rule.__name__}`: its `positional=True` hyperparameters must come "
            f"first among its fields, each without a default after one with: {e}."
        ) from None
    by_keyword = any(p.kind is P.KEYWORD_ONLY for p in params)
    convention = "; hyperparameters after `*` by keyword" if by_keyword else ""

    def fn(*args: Any, **kwargs: Any) -> Any:
        try:
            given = signature.bind(*args, **kwargs).arguments
        except TypeError as e:
            raise TypeError(
                f"`{name}`: {e} (it is called as `{name}{_bare(signature)}`"
                f"{convention})."
            ) from None
        module = rule(**{f: given[f] for f in fields if f in given})
        key = {"key": given["key"]} if "key" in given else {}
        return module(*(given[n] for n in inputs), **key)

    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = _BASES.rpartition(".")[0]
    fn.__signature__ = signature  # type: ignore[attr-defined]
    fn.__doc__ = _describe_form(rule, fn)
    return fn


def declare_functional_forms() -> None:
    """Give every registered rule without one its derived functional form."""
    for rule in _REGISTRY:
        if rule.__dict__.get("function") is None:
            rule.function = _derived_form(rule)


def library_names() -> dict[str, Any]:
    """`{name: object}` for every library rule class and its functional form, in
    catalogue order: what `eqxrules` exports."""
    declare_functional_forms()
    names: dict[str, Any] = {}
    for rule in _REGISTRY:
        if rule in _LIBRARY:
            names[rule.__name__] = rule
            names[rule.function.__name__] = rule.function
    return names


def defines(rule: type, method: str) -> bool:
    """Whether `rule` (or a base of its own, not a `Rule` base) defines `method`."""
    owner = next(k for k in rule.__mro__ if method in k.__dict__)
    return owner.__module__ != _BASES


def missing_parts(rule: type) -> list[str]:
    """What `rule`'s declaration lacks, in words (empty if nothing)."""
    missing = []
    doc = rule.__doc__ or ""
    if not doc.strip() or doc.startswith(f"{rule.__name__}("):
        missing.append("a class docstring (the maths, the arguments, an example)")
    if not rule.summary:
        missing.append("`summary` (the maths in one line of text)")
    bases = {k.__name__ for k in rule.__mro__ if k.__module__ == _BASES}
    derivative = (
        "bwd" if "VJPRule" in bases else "slope" if "ElementwiseRule" in bases else ""
    )
    needs = [
        ("primal", "`primal` (the value)"),
        (
            derivative or "tangent",
            "the derivative (`tangent`; `slope` for an `ElementwiseRule`, `bwd` for "
            "a `VJPRule`)",
        ),
        ("reference_forward", "`reference_forward` (an independent reference value)"),
    ]
    missing += [what for method, what in needs if not defines(rule, method)]
    if not derivative and "slope" in dir(rule) and not defines(rule, "tangent"):
        missing.append(
            "a `tangent`: `slope` is read only by `ElementwiseRule` (subclass it)"
        )
    if not (defines(rule, "reference_derivative") or defines(rule, "reference_vjp")):
        missing.append(
            "`reference_derivative` or `reference_vjp` (an independent reference "
            "derivative)"
        )
    missing += [
        f"a declaration of field `{name}` with `hyperparameter(...)` (so it is "
        "validated and has invalid values)"
        for name in undeclared(rule)
    ]
    if rule.function is None and rule not in _REGISTRY:
        missing.append("registration (define it in `eqxrules._rules`)")
    return missing


@dataclasses.dataclass(frozen=True)
class Entry:
    """One catalogue entry: everything the tests, the CLI and the docs need to know.

    **Fields:**

    - `name`: the functional form's name, e.g. `"ste_sign"`.
    - `module`: the `eqx.Module` class, e.g. `SteSign`.
    - `function`: the functional form.
    - `summary`: one line.
    - `forward_mode`: whether `jax.jvp` is supported.
    - `exact`: whether the derivative is the true one (finite differences apply).
    - `elementwise`: whether it takes one floating-point array.
    - `domain`: the [`Domain`][] of test inputs, with the kinks of every example
        (`Domain.with_kinks`). (Each example's own
        are `rule.input_domain()`.)
    - `reference_vjp`: whether the derivative is checked against `reference_vjp`
        (backward not linear in the cotangent) rather than `reference_derivative`.
    """

    name: str
    module: type
    function: Callable[..., Any]
    summary: str
    forward_mode: bool
    exact: bool
    elementwise: bool
    domain: Any
    reference_vjp: bool

    def examples(self, key: PRNGKeyArray) -> Sequence[Any]:
        """The instances of the rule that are checked (`module.examples(key)`)."""
        return self.module.examples(key)

    @property
    def modes(self) -> tuple[str, ...]:
        """`("fwd", "rev")`, or `("rev",)` for a reverse-only rule."""
        return ("fwd", "rev") if self.forward_mode else ("rev",)

    def check_arguments(
        self, rule: Any, x: Any, key: PRNGKeyArray
    ) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        """`(fn, args, references)` for `eqxrules.testing.check_rule(fn, *args,
        **references)` on one example `rule` and input `x`. The Module itself is an
        argument, so the parameters of a wrapped sub-model are checked too."""
        kwargs = rule.call_kwargs(key)

        def fn(m, *x):
            return m(*x, **kwargs)

        def forward(m, *x):
            return m.reference_forward(*x, **kwargs)

        def derivative(m, *x):
            return m.reference_derivative(*x, **kwargs)

        def reference_vjp(ct, m, *x):
            return m.reference_vjp(ct, *x, **kwargs)

        references: dict[str, Any] = dict(forward=forward)
        if self.reference_vjp:
            references["reference_vjp"] = reference_vjp
        else:
            references["derivative"] = derivative
        # A rule of several inputs (its test input an `Args`) takes each as an
        # argument: `check_rule` then holds each fixed in turn (`held_fixed`). Its
        # reports name them as the signatures do: `m`, then `x` or each input's.
        several = isinstance(x, Args)
        args = tuple(x) if several else (x,)
        # One input is named as `primal` names it (`A`), `x` where it says not.
        own = primal_arity(type(rule)) or ("x",)
        names = rule.input_domain().names if several else own[:1]
        params = [
            inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            for n in ("m", *names)
        ]
        for f in (fn, forward, derivative):
            f.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        return fn, (rule, *args), references


def _entry(rule: Any, function: Callable[..., Any] | None = None) -> Entry:
    function = function or rule.function
    assert function is not None  # given, or set by `declare_functional_forms`
    kinks = {k for r in rule.examples(jax.random.key(0)) for k in r.kinks()}
    return Entry(
        name=function.__name__,
        module=rule,
        function=function,
        summary=rule.summary,
        forward_mode=rule.forward_mode,
        exact=rule.exact,
        elementwise=rule.elementwise,
        domain=rule.domain.with_kinks(sorted(kinks)),
        reference_vjp=defines(rule, "reference_vjp"),
    )


_ENTRIES: dict[type, Entry] = {}


def entry_of(rule: type) -> Entry:
    """`rule`'s [`Entry`][], registered or not: a rule outside the catalogue gets
    its derived functional form here without being given it (or joining)."""
    if rule in _REGISTRY:
        return next(e for e in catalogue() if e.module is rule)
    # Its own form only: a subclass of a library rule inherits the library's.
    own = rule.__dict__.get("function") is not None
    return _entry(rule, rule.function if own else _derived_form(rule))


def catalogue() -> tuple[Entry, ...]:
    """Every rule eqxrules ships (and any you registered with
    `functional(..., register=True)`), in declaration order.

    **Returns:**

    A tuple of [`Entry`][] objects.
    """
    declare_functional_forms()
    for rule in _REGISTRY:
        if rule not in _ENTRIES:
            _ENTRIES[rule] = _entry(rule)
    return tuple(_ENTRIES[rule] for rule in _REGISTRY)


__all__ = ["Domain", "Entry", "catalogue", "functional", "missing_parts"]
