"""The `finite_differences` check: the rule's derivative against central
differences, in float64, along random unit directions (in the arguments' tangent
spaces). Where both evaluation points give the same value, infinities included,
the difference is 0, as in `jax.test_util.check_grads`: a masked `-inf` output
does not move."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax.tree_util as jtu
import numpy as np

from . import _programs
from ._compare import _Failure, _identity, _vdot
from ._compat import enable_x64
from ._host import _device
from ._options import _Options, _where
from ._problem import _Problem

FINITE_DIFFERENCE_TOLERANCES: dict[bool, tuple[float, float, float]] = {
    True: (1e-5, 1e-6, 1e-6),
    False: (3e-2, 3e-3, 1e-2),
}
"""`(rtol, atol, step)` for central differences, keyed by whether they run in
float64. The checker runs them in float64 (enabled for the check, on every
supported JAX version), so uses `True`; float32 differences would need the loose
`False`."""


@np.errstate(all="ignore")
def _check_finite_differences(p: _Problem, o: _Options) -> dict[str, Any] | str:
    rtol, atol, eps = FINITE_DIFFERENCE_TOLERANCES[True]
    worst: dict[str, Any] = {}
    with enable_x64():
        wide = np.float64
        d = _device(jtu.tree_map(lambda x: np.asarray(x).astype(wide), p.diff))

        def f_at(d: Any, v: Any, step: Any) -> Any:
            return p.f(jtu.tree_map(lambda x, y: x + step * y, d, v))

        # One program for every evaluation point (`d + step v`, the step an
        # argument), and the points built on the device, not sent from the host.
        f = _programs.jit(f_at)
        jvp, vjp = _programs.jit(p.jvp), _programs.jit(p.vjp)
        # Through the JVP if only forward mode is asked for, or if the rule has it
        # (found out from this check's own program if no check has yet, so as not
        # to trace another); else through the VJP.
        through_jvp = "fwd" in o.modes and (
            "rev" not in o.modes or p.forward_mode(jvp, d, d) is True
        )
        ct = None
        if not through_jvp:
            ct = _device(
                jtu.tree_map(
                    lambda x: (
                        np.asarray(x).astype(wide) if eqx.is_inexact_array(x) else x
                    ),
                    p.ct,
                )
            )

        def at_once(d: Any, v: Any, step: Any, ct: Any) -> Any:
            derivative = p.jvp(d, v) if through_jvp else p.vjp(d, ct)
            return f_at(d, v, step), f_at(d, v, -step), derivative

        # The two points and the derivative in one program (compiling dominates);
        # apart if it raises, so that an exception is named where it came from.
        together: Any = _programs.jit(at_once)
        rng = p.rng("fd")
        ct_vjp = None
        for _ in range(o.num_directions):
            raw = [
                rng.standard_normal(np.shape(x), dtype=np.float32).astype(wide)
                for x in jtu.tree_leaves(d)
            ]
            projected = p.project(
                _device(jtu.tree_unflatten(jtu.tree_structure(d), raw))
            )
            v = [np.asarray(x, wide) for x in jtu.tree_leaves(projected)]
            norm = np.sqrt(sum(float(np.sum(x**2)) for x in v))
            v = _device(
                jtu.tree_unflatten(jtu.tree_structure(d), [x / norm for x in v])
            )
            step = np.asarray(eps, wide)
            derivative = plus = minus = None
            if together is not None:
                try:
                    plus, minus, derivative = together(d, v, step, ct)
                except Exception:
                    together = None
            if together is None:
                plus, minus = f(d, v, step), f(d, v, -step)
            fd = jtu.tree_map(
                lambda a, b: (
                    _difference(a, b, eps) if eqx.is_inexact_array(a) else None
                ),
                plus,
                minus,
            )
            if through_jvp:
                with _where(
                    "the JVP along a random unit v against central differences"
                ):
                    jv = jtu.tree_map(
                        _float_or_none, jvp(d, v) if derivative is None else derivative
                    )
                    worst = p.compare(
                        jv,
                        fd,
                        "jvp(out)",
                        point=d,
                        rtol=rtol,
                        atol=atol,
                        floor=None,
                        check_dtype=False,
                    )
                continue
            if ct_vjp is None:
                ct_vjp = vjp(d, ct) if derivative is None else derivative
            lhs, s1 = _vdot(ct, fd)
            rhs, s2 = _vdot(ct_vjp, v)
            holds, worst = _identity(
                lhs,
                s1,
                rhs,
                s2,
                path="<ct, finite difference> vs <J^T ct, v>",
                rtol=rtol,
                atol=atol,
            )
            if holds is None:
                raise _Failure(
                    f"nothing compared: <ct, finite difference> = {lhs} and "
                    f"<J^T ct, v> = {rhs}, neither finite",
                    **worst,
                )
            if not holds:
                raise _Failure(
                    f"the VJP disagrees with central differences: {rhs:.6g} vs "
                    f"{lhs:.6g}",
                    **worst,
                )
    return worst


@np.errstate(all="ignore")
def _difference(plus: Any, minus: Any, eps: float) -> np.ndarray:
    """`(plus - minus) / 2 eps`, 0 where the two are equal (infinities included:
    `inf - inf` there is no change, not NaN)."""
    a, b = np.asarray(plus), np.asarray(minus)
    return np.where(a == b, np.zeros((), a.dtype), (a - b) / (2 * eps))


def _float_or_none(x: Any) -> Any:
    return x if eqx.is_inexact_array(x) else None
