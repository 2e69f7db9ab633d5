r"""[`quantized_einsum`][eqxrules.quantized_einsum]: a two-operand `jnp.einsum` as
[`quantized_dot_general`][eqxrules.quantized_dot_general] with the dimension
numbers its subscripts give."""

from __future__ import annotations

from collections.abc import Hashable

import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .dot import _DimensionNumbers, _dot_op, check_call, run
from .recipes import Recipe


def _einsum_dims(
    subscripts: str, lhs_ndim: int, rhs_ndim: int
) -> tuple[_DimensionNumbers, tuple[int, ...]]:
    """The dimension numbers of a two-operand einsum and the permutation from
    `dot_general`'s output (batch, `lhs` free, `rhs` free) to the einsum's."""
    name = "quantized_einsum"
    spec = subscripts.replace(" ", "")
    if "->" in spec:
        inputs, output = spec.split("->")
    else:
        inputs, output = spec, None
    parts = inputs.split(",")
    if len(parts) != 2 or "." in spec or not all(p.isalpha() for p in parts):
        raise ValueError(
            f"`{name}`: `subscripts` (={subscripts!r}) must name two operands with "
            "one letter per axis, as `'bij,bjk->bik'` (no ellipsis)."
        )
    a, b = parts
    for labels, n, which in ((a, lhs_ndim, "lhs"), (b, rhs_ndim, "rhs")):
        if len(labels) != n:
            raise ValueError(
                f"`{name}`: `subscripts` (={subscripts!r}) gives `{which}` "
                f"{len(labels)} axes ({labels!r}); it has {n}."
            )
        if len(set(labels)) != n:
            raise ValueError(
                f"`{name}`: `subscripts` (={subscripts!r}) repeats a label within "
                f"`{which}` ({labels!r}): a trace or diagonal is not a product."
            )
    if output is None:
        output = "".join(sorted(c for c in set(a + b) if (a + b).count(c) == 1))
    if not output.isalpha() and output:
        raise ValueError(f"`{name}`: `subscripts` (={subscripts!r}): bad output.")
    for c in output:
        if c not in a and c not in b or output.count(c) > 1:
            raise ValueError(
                f"`{name}`: `subscripts` (={subscripts!r}): the output label {c!r} "
                "must appear once, and in an operand."
            )
    for c in a + b:
        if c not in output and not (c in a and c in b):
            raise ValueError(
                f"`{name}`: `subscripts` (={subscripts!r}): label {c!r} is in one "
                "operand only and not in the output, a sum over one operand, not a "
                "product: sum it first."
            )
    batch = [c for c in a if c in b and c in output]
    contract = [c for c in a if c in b and c not in output]
    dims = (
        (tuple(a.index(c) for c in contract), tuple(b.index(c) for c in contract)),
        (tuple(a.index(c) for c in batch), tuple(b.index(c) for c in batch)),
    )
    order = batch + [c for c in a if c not in b] + [c for c in b if c not in a]
    return dims, tuple(order.index(c) for c in output)


def quantized_einsum(
    subscripts: str,
    lhs: Float[Array, ...],
    rhs: Float[Array, ...],
    *,
    recipe: Recipe,
    key: PRNGKeyArray | None = None,
    axis_name: Hashable | tuple[Hashable, ...] | None = None,
) -> Float[Array, ...]:
    r"""`jnp.einsum(subscripts, lhs, rhs)` for two operands, as
    [`quantized_dot_general`][eqxrules.quantized_dot_general] with the dimension
    numbers the subscripts give: labels in both operands and the output are batch
    dimensions, labels in both and not in the output are contracted (in the order
    of `lhs`'s subscripts: flattened so, and blocked as one), and the others are
    free. The result is then transposed to the output's order.

    Every product, its blocks, padding, Hadamard transform, `vmap` and
    `axis_name` are `quantized_dot_general`'s. With the identity recipe the value and cotangents
    equal `jnp.einsum`'s within float32 summation bounds (`jnp.einsum` may
    contract in another order), and `quantized_dot_general`'s bit for bit.

    **Arguments:**

    - `subscripts`: as `jnp.einsum`'s, two operands, one letter per axis, e.g.
        `"bhqd,bhkd->bhqk"` (attention's scores) or `"bhqk,bhkd->bhqd"`; no
        ellipsis, no repeated label within an operand, and no label in one operand
        only that the output lacks (a `ValueError`).
    - `lhs`, `rhs`: floating-point arrays.
    - `recipe`, `key`, `axis_name`: as for `quantized_dot_general`.

    **Returns:**

    The einsum's value, its axes in the output's order.

    !!! Example

        ```python
        q = jax.random.normal(jax.random.key(0), (2, 4, 16, 32))
        k = jax.random.normal(jax.random.key(1), (2, 4, 16, 32))
        s = eqxrules.quantized_einsum(
            "bhqd,bhkd->bhqk", q, k, recipe=eqxrules.recipes.mxfp8()
        )
        ```
    """
    name = "quantized_einsum"
    if not isinstance(subscripts, str):
        raise TypeError(
            f"`{name}`: `subscripts` (={subscripts!r}) must be a string, as "
            "`'bij,bjk->bik'`."
        )
    operands = {"lhs": lhs, "rhs": rhs}
    products, random = check_call(name, recipe, operands, key, axis_name)
    dims, permutation = _einsum_dims(subscripts, jnp.ndim(lhs), jnp.ndim(rhs))
    op = _dot_op(name, lhs, rhs, dims)
    y = run(op, products, lhs, rhs, key, random, axis_name)
    return jnp.transpose(y, permutation)


__all__ = ["quantized_einsum"]
