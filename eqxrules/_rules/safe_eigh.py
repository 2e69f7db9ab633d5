r"""The NaN-safe eigendecomposition of a symmetric matrix: [`SafeEigh`][], whose
derivative drops the terms of degenerate pairs of eigenvalues. What the NaN-safe
rules share is in `_safe`."""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._catalogue import Domain, JVPRule
from .._inputs import check_float_array
from ._safe import wide

# Two eigenvalues closer than this many epsilons (of the compute dtype, float32 for
# float32 and narrower inputs) times the matrix's size `n` and its largest
# eigenvalue magnitude count as equal. LAPACK's symmetric eigensolvers are backward
# stable: each computed eigenvalue is within a small multiple of `n · eps · ‖a‖₂`
# of the exact one. Measured in float32, on the CPU: the two equal eigenvalues of
# `Q diag(1, 1, 3, ...) Qᵀ` rounded to float32, over 300 random `Q` for each n from
# 2 to 64, differ by at most 0.66 of `n · eps · max|λ|`: a margin of 24.
_TOLERANCE_EPS = 16


def _transpose(m: Array) -> Array:
    return jnp.swapaxes(m, -1, -2)


def _symmetric(a: Array) -> Array:
    return (a + _transpose(a)) / 2


def degenerate(w: Array) -> Array:
    r"""`close[..., i, j]`: whether eigenvalues `w[..., i]` and `w[..., j]` are
    equal within $16\, n\, \varepsilon \max_k \lvert \lambda_k \rvert$ (the
    diagonal, and every pair of a zero matrix, included). A NaN is close to
    nothing."""
    n = w.shape[-1]
    scale = jnp.max(jnp.abs(w), axis=-1, keepdims=True)[..., None]
    tol = _TOLERANCE_EPS * n * float(jnp.finfo(w.dtype).eps) * scale
    return jnp.abs(w[..., None, :] - w[..., :, None]) <= tol


class SafeEigh(JVPRule):
    r"""The eigendecomposition of a symmetric matrix, `jnp.linalg.eigh(a)`, whose
    derivative drops the terms of pairs of equal eigenvalues instead of dividing
    by their zero difference.

    With $a = V \operatorname{diag}(\lambda) V^\top$ (`a` symmetrised, $(a +
    a^\top)/2$, as `jnp.linalg.eigh` does by default), $\dot a$ likewise and
    $M = V^\top \dot a V$,

    $$\dot\lambda_i = M_{ii}, \qquad \dot V = V (F \circ M), \qquad
    F_{ij} = \begin{cases} 1 / (\lambda_j - \lambda_i) &
    \lvert \lambda_j - \lambda_i \rvert > \tau \\ 0 & \text{otherwise,}
    \end{cases}$$

    with the tolerance $\tau = 16\, n\, \varepsilon \max_k \lvert \lambda_k
    \rvert$ ($\varepsilon$ of float32 for float32, bfloat16 and float16 inputs,
    which are decomposed in float32; of float64 for float64), well above the
    eigensolver's rounding error (a small multiple of $n \varepsilon
    \lVert a \rVert$) and relative to the spectrum's scale. Away from degeneracy
    this is `jnp.linalg.eigh`'s derivative. Where two eigenvalues are equal within
    $\tau$, `jnp.linalg.eigh`'s derivative is NaN (JAX #669), even in a loss
    that does not depend on the basis chosen inside the degenerate eigenspace;
    here it is finite, in both modes and at every order (the Hessian included).

    **What it means.** Dropping those terms is the exact derivative of every
    function invariant to rotations inside each degenerate eigenspace: the
    eigenvalues, functions of them (`log det`, a trace), the projectors onto
    eigenspaces (degenerate or not), and the eigenvectors of the non-degenerate
    eigenvalues. For a loss that depends on the basis chosen inside a degenerate
    eigenspace (one eigenvector of a repeated eigenvalue, say), no derivative
    exists there, and what this gives is not one: the eigenvectors of a
    degenerate eigenvalue are whatever the eigensolver returns, and a small
    change of `a` can turn them by a finite angle. The same holds for eigenvalues
    distinct but within $\tau$, whose true derivative has terms of order
    $1/\tau$.

    **Second derivatives** are finite everywhere, in every mode (`hessian`,
    `jacrev(jacrev)`, ...), and exact away from degeneracy. At a degenerate
    spectrum they are not those of an invariant loss: its true Hessian has terms
    $(f'(\lambda_i) - f'(\lambda_j)) / (\lambda_i - \lambda_j)$ (with $f$ the
    loss as a function of the spectrum) that tend to $f''(\lambda)$ inside a
    degenerate eigenspace. They belong to the loss, which a rule of `eigh` alone
    cannot see, and are dropped with the first-order terms: at $a = I$ the
    second derivative of $\sum_i \sin \lambda_i$ along $\dot a$ is then
    $-\sin(1) \sum_i \dot a_{ii}^2$, where the true one is
    $-\sin(1) \lVert (\dot a + \dot a^\top)/2 \rVert^2$.

    A NaN or inf in `a` gives NaN eigenvalues (those of the part of `a` it
    reaches: LAPACK splits a block-diagonal matrix), and NaN derivatives with
    them; no other matrix of a batch is changed.

    **Returns:** a tuple `(eigenvalues, eigenvectors)` of shapes `(..., n)` and
    `(..., n, n)`, as `jnp.linalg.eigh(a)` (eigenvalues in ascending order, the
    eigenvectors in the columns), in `a`'s dtype.

    !!! Example

        ```python
        a = jnp.diag(jnp.array([1.0, 1.0, 3.0]))

        def projector(a):  # onto the eigenspace of the eigenvalue 1
            w, v = eqxrules.safe_eigh(a)
            return v[:, :2] @ v[:, :2].T

        jax.jacfwd(projector)(a)  # finite, where jnp.linalg.eigh gives NaN
        ```
    """

    elementwise: ClassVar[bool] = False
    exact: ClassVar[bool] = True
    domain: ClassVar[Any] = Domain(shape=(4, 4))

    summary: ClassVar[str] = (
        "eigh(a): eigenvalues and eigenvectors of (a + aᵀ)/2; derivative `λ̇ = "
        "diag(Vᵀ ȧ V)`, `V̇ = V(F ∘ Vᵀ ȧ V)` with F = 1/(λⱼ − λᵢ), 0 where they "
        "are equal within 16 n ε max|λ|"
    )

    def _check_call(self, args: tuple[Any, ...]) -> None:
        name = self.rule_name()
        check_float_array(name, args, argument="a")
        shape = tuple(jnp.shape(args[0]))
        if len(shape) < 2 or shape[-1] != shape[-2]:
            raise ValueError(
                f"`{name}`: `a` must be a square matrix, or a batch of them (shape "
                f"`(..., n, n)`), not of shape {shape}."
            )

    def primal(
        self, a: Float[Array, "*batch n n"]
    ) -> tuple[Float[Array, "*batch n"], Float[Array, "*batch n n"]]:
        w, v = jnp.linalg.eigh(a.astype(wide(a.dtype)), symmetrize_input=True)
        return w.astype(a.dtype), v.astype(a.dtype)

    def tangent(
        self,
        args: tuple[Any, ...],
        t_args: tuple[Any, ...],
        t_self: Any,
        out: Any,
        **kwargs: Any,
    ) -> Any:
        (a,), (t,) = args, t_args
        if t is None:
            return None
        dtype = wide(a.dtype)
        # `out` is the rule's own value: the derivative of this tangent (second
        # order) goes through this rule again, never through `1/(λⱼ − λᵢ)` of a
        # degenerate pair.
        w, v = out[0].astype(dtype), out[1].astype(dtype)
        m = _transpose(v) @ _symmetric(t.astype(dtype)) @ v
        # `1/inf` is 0, and so is its derivative (`-1/inf²` times a zero tangent):
        # one select, where `1/where(close, 1, d)` selected away would take two.
        d = w[..., None, :] - w[..., :, None]
        f = 1 / jnp.where(degenerate(jax.lax.stop_gradient(w)), jnp.inf, d)
        dw = jnp.diagonal(m, axis1=-2, axis2=-1)
        return dw.astype(a.dtype), (v @ (f * m)).astype(a.dtype)

    def reference_forward(self, a: Array) -> tuple[Array, Array]:
        w, v = jnp.linalg.eigh(_symmetric(a.astype(wide(a.dtype))))
        return w.astype(a.dtype), v.astype(a.dtype)

    def reference_derivative(self, a: Array) -> tuple[Array, Array]:
        """First-order perturbation theory written as a function of `a`: the
        eigendecomposition held constant, plus terms linear in `a - a₀` (zero in
        value, `ȧ` in derivative), whose plain derivative is the rule's first
        derivative. Its second derivative is 0, not the rule's: `higher_order()`
        is `False`, and the second derivatives are tested against finite
        differences of the first (tests/test_safe_eigh.py)."""
        w = a.astype(wide(a.dtype))
        vals, vecs = jax.lax.stop_gradient(jnp.linalg.eigh(_symmetric(w)))
        m = _transpose(vecs) @ _symmetric(w - jax.lax.stop_gradient(w)) @ vecs
        close = degenerate(vals)
        gap = jnp.where(close, 1, vals[..., None, :] - vals[..., :, None])
        f = jnp.where(close, 0, 1 / gap)
        dw = jnp.diagonal(m, axis1=-2, axis2=-1)
        return (vals + dw).astype(a.dtype), (vecs + vecs @ (f * m)).astype(a.dtype)

    def higher_order(self) -> bool:
        return False

    def second_order(self) -> bool:
        """`False`: the reference's second derivative is 0 (`reference_derivative`),
        so `check_rule(order=2)` has nothing to compare with; the rule's second
        derivatives are tested against central differences of its first
        (tests/test_safe_eigh.py)."""
        return False
