"""The core of a `check_rule` call: one compiled program for the rule's and the
references' value and derivatives at the problem's point (`_Problem._core`), and
`_Part`, each of its parts called like the function it computes.

Compiling dominates a check. On the CPU a program at a check's sizes compiles in
tens of milliseconds whatever it holds, so one program computing the value, the
JVP, the VJP and their references (and, with `order=2`, the second derivatives)
compiles in well under the time of its parts apart (46 s against 64 s for the
first example of every catalogue entry, 365 compiled programs against 654). Its
parts are the same whichever checks are selected, so the calls `verify` makes at
each entry's kinks and degenerate slices reuse the first call's program.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax

from . import _programs, _reuse
from ._options import _is_reverse_only_error


class _Source(Protocol):
    """What the core reads of a `check_rule` problem (`_problem._Problem`): the
    point, the random directions, the rule and its references as functions of the
    differentiable leaves, and what is known of forward mode. The core knows the
    problem through this only, so that the imports run one way: `_problem` builds
    its parts from `_core`."""

    diff: Any
    t: Any
    ct: Any
    u: Any
    options: Any
    modes: tuple[str, ...]
    forward: Callable[..., Any] | None
    derivative: Callable[..., Any] | None
    _forward_traceable: bool
    _forward_mode: bool | None
    _forward_error: BaseException | None
    _core: Any
    _core_names: frozenset[str]
    fn: Callable[..., Any]
    reference_vjp: Callable[..., Any] | None
    static: Any
    spaces: tuple[Any, ...]
    _core_memo: tuple[tuple[Any, ...], Any] | None

    @property
    def forward_mode_known(self) -> bool: ...

    @property
    def has_reference(self) -> bool: ...

    def f(self, d: Any) -> Any: ...

    def g(self, d: Any) -> Any: ...

    def forward_at(self, d: Any) -> Any: ...

    def combine(self, d: Any) -> tuple[Any, ...]: ...

    def jvp(self, d: Any, t: Any, fn: Callable[[Any], Any] | None = None) -> Any: ...

    def vjp(self, d: Any, ct: Any, fn: Callable[[Any], Any] | None = None) -> Any: ...

    def reference_cotangent(self, d: Any, ct: Any) -> Any: ...


Parts = dict[str, Callable[[Any, Any, Any, Any], Any]]


_SECOND = frozenset(
    {"jvp_of_vjp", "vjp_of_vjp", "reference_jvp_of_vjp", "reference_vjp_of_vjp"}
)
_NEEDS: dict[str, frozenset[str]] = {
    "primal": frozenset({"out", "forward"}),
    "jvp": frozenset({"jvp", "reference_jvp"}),
    "linearity": frozenset({"jvp"}),
    "vjp": frozenset({"vjp", "reference_vjp"}),
    "transpose": frozenset({"jvp", "vjp"}),
    "held_fixed": frozenset({"jvp", "reference_jvp", "vjp", "reference_vjp"}),
    "batching": frozenset({"jvp", "vjp"}),
    "jit": frozenset({"out", "vjp"}),
    "zero_cotangent": frozenset({"vjp", "reference_vjp"}),
    "dtype": frozenset({"jvp", "vjp"}),
    "second_order": _SECOND,
}
"""The parts each check reads. A part no selected check reads is left out, so that
an unselected check costs nothing; the full battery and `verify`'s value checks
(`primal`, `jvp`, `vjp`) read the same parts, so they share one program."""


def needed(selected: frozenset[str]) -> frozenset[str]:
    """The parts the `selected` checks read."""
    return frozenset().union(*(_NEEDS.get(name, frozenset()) for name in selected))


def wanted(p: _Source) -> frozenset[str]:
    """The parts `p`'s core computes: those its selected checks read, and with
    `order=2` the second derivatives whether `second_order` is selected or not
    (so that the calls `verify` makes at one example's inputs, with and without
    it, share one program)."""
    options, selected = p.options or (None, frozenset(_NEEDS))
    second = _SECOND if options is not None and options.order >= 2 else frozenset()
    return needed(selected) | second


def parts(p: _Source, forward: bool) -> Parts:
    """The core's parts, by name, each a function of `(d, t, ct, u)`: the point,
    a tangent, a cotangent and (for the VJP of the VJP) a second cotangent. Only
    those `wanted`."""
    names = wanted(p)
    return {name: fn for name, fn in _parts(p, forward).items() if name in names}


def _parts(p: _Source, forward: bool) -> Parts:
    out: Parts = {"out": lambda d, t, ct, u: p.f(d)}
    if p.forward is not None and p._forward_traceable:
        out["forward"] = lambda d, t, ct, u: p.forward_at(d)
    if forward:
        out["jvp"] = lambda d, t, ct, u: p.jvp(d, t)
        if p.derivative is not None:
            out["reference_jvp"] = lambda d, t, ct, u: p.jvp(d, t, p.g)
    if "rev" not in p.modes:
        return out
    out["vjp"] = lambda d, t, ct, u: p.vjp(d, ct)
    if p.has_reference:
        out["reference_vjp"] = lambda d, t, ct, u: p.reference_cotangent(d, ct)
    options, _ = p.options or (None, frozenset())
    if (
        options is not None
        and options.order >= 2
        and (p.has_reference or p.forward is not None)
    ):
        for name, make in _SECOND_ORDER.items():
            if name == "vjp_of_vjp" or forward:
                for prefix, vjp in (("", p.vjp), ("reference_", _reference(p))):
                    out[prefix + name] = _second(make(vjp), name)
    return out


def _reference(p: _Source) -> Callable[[Any, Any], Any]:
    """What the rule's VJP is differentiated against for second derivatives: the
    reference's cotangent, or else (a true derivative) the VJP of `forward`."""
    if p.has_reference:
        return p.reference_cotangent
    forward = p.forward
    assert forward is not None
    return lambda d, ct: p.vjp(d, ct, lambda d: forward(*p.combine(d)))


def second_order(p: _Source, part: str) -> Callable[..., Any]:
    """`part` of the second derivatives: `jvp_of_vjp` or `vjp_of_vjp` of the rule
    (or `reference_` them), called as `(d, ct, t)` or `(d, ct, u)`."""
    name = part.removeprefix("reference_")
    vjp = _reference(p) if part.startswith("reference_") else p.vjp
    second = "t" if name == "jvp_of_vjp" else "u"
    return _Part(p, part, _second(_SECOND_ORDER[name](vjp), name), second)


def _second(fn: Callable[[Any, Any, Any], Any], name: str) -> Callable[..., Any]:
    """`fn(d, ct, t)` or `fn(d, ct, u)` as a function of `(d, t, ct, u)`."""
    if name == "jvp_of_vjp":
        return lambda d, t, ct, u: fn(d, ct, t)
    return lambda d, t, ct, u: fn(d, ct, u)


def program(p: _Source, forward: bool) -> _programs.Program:
    """The core with or without its forward-mode parts, lowered at the point."""
    named = parts(p, forward)
    core = _programs.jit(
        lambda d, t, ct, u: {name: fn(d, t, ct, u) for name, fn in named.items()}
    )
    core.lower(p.diff, p.t, p.ct, p.u)
    p._core_names = frozenset(named)
    return core


def build(p: _Source) -> _programs.Program | None:
    """The problem's core, or `None` where it cannot be built: the parts are then
    their own programs (as they are once it has raised), so that a rule raising
    in one part fails only the checks that use it. Building it finds out whether
    the rule has forward mode. Inside `_reuse.reusing()`, an earlier problem's
    core of the same functions and shapes, untraced."""
    k = _reuse.key(p, "core", wanted(p))
    found = _reuse.get(k)
    if found is not None and "core" in found:
        p._core_names = found["names"]
        p._forward_mode, p._forward_error = found["forward_mode"]
        p._forward_traceable = found["traceable"]
        return found["core"]
    core = _build(p)
    if core is not None:
        _reuse.put(
            k,
            p,
            core=core,
            names=p._core_names,
            forward_mode=(p._forward_mode, p._forward_error),
            traceable=p._forward_traceable,
        )
    return core


def _build(p: _Source) -> _programs.Program | None:
    forward = "fwd" in p.modes and p._forward_mode is not False
    try:
        try:
            core = program(p, forward)
        except Exception as e:
            if p.forward is None or _is_reverse_only_error(e):
                raise
            # Perhaps the `forward` reference is not traceable: without it.
            p._forward_traceable = False
            core = program(p, forward)
    except Exception as e:
        if not (forward and _is_reverse_only_error(e)):
            return None
        if not p.forward_mode_known:
            p._forward_error, p._forward_mode = e, False
        try:
            return program(p, False)
        except Exception:
            return None
    if "jvp" in p._core_names and not p.forward_mode_known:
        p._forward_mode = True
    return core


def _jvp_of_vjp(vjp: Callable[[Any, Any], Any]) -> Callable[[Any, Any, Any], Any]:
    return lambda d, ct, t: jax.jvp(lambda d: vjp(d, ct), (d,), (t,))[1]


def _vjp_of_vjp(vjp: Callable[[Any, Any], Any]) -> Callable[[Any, Any, Any], Any]:
    def fn(d: Any, ct: Any, u: Any) -> Any:
        _, pullback = jax.vjp(lambda d: vjp(d, ct), d)
        return pullback(u)[0]

    return fn


_SECOND_ORDER = {"jvp_of_vjp": _jvp_of_vjp, "vjp_of_vjp": _vjp_of_vjp}


class _Part:
    """One part of the problem's core program (`_Problem._core`), called like the
    function it computes (`jvp_jit(d, t)`, `vjp_jit(d, ct)`, `f_jit(d)`): the core
    runs at the given arguments and the problem's own for the rest (its other
    parts cost no compile, and little time at a check's sizes). Where the core
    cannot be built, lacks the part, or raises, the part is its own program, as
    if there were no core."""

    def __init__(
        self,
        p: _Source,
        name: str,
        fn: Callable[..., Any],
        second: str = "",
        eager: bool = False,
    ) -> None:
        self.p, self.name, self.fn, self.second = p, name, fn, second
        self.eager = eager
        self._alone: Callable[..., Any] | None = None

    def _arguments(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        p, name = self.p, self.name
        if self.second:  # `(d, ct, t)` or `(d, ct, u)`
            d, ct, x = args
            return (d, x, ct, p.u) if self.second == "t" else (d, p.t, ct, x)
        if name in ("out", "forward"):
            return (args[0], p.t, p.ct, p.u)
        d, x = args
        if name in ("jvp", "reference_jvp"):
            return (d, x, p.ct, p.u)
        return (d, p.t, x, p.u)

    def __call__(self, *args: Any) -> Any:
        p = self.p
        core = p._core
        if core is not None and self.name in p._core_names:
            arguments = self._arguments(args)
            memo = p._core_memo
            # The parts at the same arguments (a VJP and its reference, at one
            # cotangent) come from one run of the core.
            if memo is not None and all(a is b for a, b in zip(memo[0], arguments)):
                return memo[1][self.name]
            try:
                out = core(*arguments)
            except Exception:
                p._core = None  # raised: every part on its own from now on
            else:
                p._core_memo = (arguments, out)
                return out[self.name]
        if self._alone is None:
            if self.second:
                self._alone = _programs.jit(
                    lambda d, ct, x: (
                        self.fn(d, x, ct, None)
                        if self.second == "t"
                        else self.fn(d, None, ct, x)
                    )
                )
            else:
                self._alone = self.fn if self.eager else _programs.jit(self.fn)
        return self._alone(*args)
