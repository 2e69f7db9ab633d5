r"""[`quantized_conv`][eqxrules.quantized_conv]: `lax.conv_general_dilated` on the
quantised core (`core.Bilinear` with an `ops.Conv` operation)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .dot import check_call, length_error, run
from .ops import Conv
from .recipes import Custom, Recipe

_NAME = "quantized_conv"


def _ints(name: str, argument: str, value: Any, n: int) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        out = tuple(int(v) for v in value)
    except TypeError as e:
        raise TypeError(
            f"`{name}`: `{argument}` (={value!r}) must be a sequence of {n} ints."
        ) from e
    if len(out) != n or any(v < 1 for v in out):
        raise ValueError(
            f"`{name}`: `{argument}` (={value!r}) must be {n} positive ints, one per "
            "spatial dimension."
        )
    return out


def _padding(name: str, padding: Any, n: int) -> Any:
    if isinstance(padding, str):
        return padding
    try:
        pairs = tuple((int(lo), int(hi)) for lo, hi in padding)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"`{name}`: `padding` (={padding!r}) must be 'SAME', 'VALID' or a "
            f"sequence of {n} (low, high) pairs of ints."
        ) from e
    if len(pairs) != n:
        raise ValueError(
            f"`{name}`: `padding` (={padding!r}) must have {n} (low, high) pairs, "
            "one per spatial dimension."
        )
    return pairs


def conv_op(
    name: str,
    lhs: Any,
    rhs: Any,
    window_strides: Sequence[int],
    padding: Any,
    lhs_dilation: Sequence[int] | None,
    rhs_dilation: Sequence[int] | None,
    dimension_numbers: Any,
    feature_group_count: int,
) -> Conv:
    """The operation, every argument checked (a `TypeError` or `ValueError` naming
    `name`, with `lax.conv_general_dilated`'s own reason where it refuses them)."""
    shapes = [jax.ShapeDtypeStruct(jnp.shape(v), jnp.float32) for v in (lhs, rhs)]
    n = len(shapes[0].shape) - 2
    if n not in (1, 2, 3) or len(shapes[1].shape) != n + 2:
        raise ValueError(
            f"`{name}`: `lhs` (shape {shapes[0].shape}) and `rhs` (shape "
            f"{shapes[1].shape}) must have the same rank, 3, 4 or 5 (1, 2 or 3 "
            "spatial dimensions, a batch and a feature dimension)."
        )
    if not isinstance(feature_group_count, int) or isinstance(
        feature_group_count, bool
    ):
        raise TypeError(
            f"`{name}`: `feature_group_count` (={feature_group_count!r}) must be "
            "an int."
        )
    try:
        dims = jax.lax.conv_dimension_numbers(
            shapes[0].shape, shapes[1].shape, dimension_numbers
        )
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"`{name}`: `dimension_numbers` (={dimension_numbers!r}) do not fit "
            f"`lhs` (shape {shapes[0].shape}) and `rhs` (shape {shapes[1].shape}): {e}"
        ) from e
    op = Conv(
        _ints(name, "window_strides", window_strides, n) or (),
        _padding(name, padding, n),
        _ints(name, "lhs_dilation", lhs_dilation, n),
        _ints(name, "rhs_dilation", rhs_dilation, n),
        (tuple(dims.lhs_spec), tuple(dims.rhs_spec), tuple(dims.out_spec)),
        feature_group_count,
        name=name,
    )
    try:
        jax.eval_shape(op, *shapes)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"`{name}`: `lax.conv_general_dilated` refuses these arguments for "
            f"`lhs` (shape {shapes[0].shape}) and `rhs` (shape {shapes[1].shape}): {e}"
        ) from e
    return op


def check_conv(name: str, op: Conv, products: Custom, rhs_shape: Sequence[int]):
    """A `ValueError` naming `name` unless the forward product's blocks divide the
    input features and the input-gradient product's the output features (features:
    not padded), and no product asks for a Hadamard transform."""
    _, rhs_spec, _ = op.dimension_numbers
    n_out, n_in = rhs_shape[rhs_spec[0]], rhs_shape[rhs_spec[1]]
    for spec, which, length, dimension, operands in (
        (
            products.fwd,
            "forward",
            n_in,
            "the input features",
            ("the input", "the kernel"),
        ),
        (
            products.dx,
            "input-gradient",
            n_out,
            "the output features",
            ("the output's cotangent", "the kernel"),
        ),
    ):
        message = length_error(spec, which, length, dimension, operands)
        if message is not None:
            raise ValueError(f"`{name}`: {message}.")
    for which, spec in (
        ("fwd", products.fwd),
        ("dx", products.dx),
        ("dw", products.dw),
    ):
        if spec.hadamard is not None:
            raise ValueError(
                f"`{name}`: the recipe's `{which}` product asks for a random "
                f"Hadamard transform (`hadamard`={spec.hadamard}), which a "
                "convolution's products cannot take: the transform must rotate "
                "both operands of a product along the same contracted dimension, "
                "and a convolution's weight-gradient product pairs each input "
                "position with many output positions (one per kernel offset). Use "
                "a recipe without it, e.g. `dataclasses.replace(recipes.nvfp4(), "
                "hadamard=None)`."
            )


def quantized_conv(
    lhs: Float[Array, ...],
    rhs: Float[Array, ...],
    window_strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    *,
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    recipe: Recipe,
    key: PRNGKeyArray | None = None,
    axis_name: Hashable | tuple[Hashable, ...] | None = None,
) -> Float[Array, ...]:
    r"""`jax.lax.conv_general_dilated` (1-D, 2-D or 3-D) with each operand of each
    of its three products, forward and backward, quantised as `recipe` says.

    With $x$ = `lhs` (batch $n$, input features $c$, positions $p$), $w$ = `rhs`
    (output features $o$, input features $c$, kernel offsets $k$) and
    $y = x \star w$, $y_{n o p} = \sum_{c, k} x_{n c (p + k)}\, w_{o c k}$ (with
    strides, dilations and padding as given):

    $$y = Q^{\mathrm{fwd}}(x) \star Q^{\mathrm{fwd}}(w)
    \quad \text{(blocks along the input features } c\text{)},$$

    $$\bar x = (\,\cdot \star Q^{\mathrm{dx}}(w))^\top\, Q^{\mathrm{dx}}(\bar y)
    \quad \text{(along the output features } o\text{)},$$

    $$\bar w = (Q^{\mathrm{dw}}(x) \star \cdot\,)^\top\, Q^{\mathrm{dw}}(\bar y)
    \quad \text{(along the batch and positions } (n, p)\text{)},$$

    the gradient products being the convolution's own transposes (its VJP) on the
    quantised operands: $\bar w_{o c k} = \sum_{n, p} x_{n c (p + k)}\, \bar y_{n o
    p}$. `dx`'s `lhs` quantises $\bar y$ and its `rhs` $w$; `dw`'s `lhs` quantises
    $x$ and its `rhs` $\bar y$.

    Conventions:

    - **The weight-gradient product** blocks $x$ along $x$'s own batch and
        spatial positions, and $\bar y$ along its own: each operand's batch and
        spatial dimensions (in the order of the dimension numbers, batch first),
        moved to the front and flattened row-major, not im2col patches.
    - **Ragged positions:** a length of those that a block does not divide is
        padded with zeros at the end before quantising (the partial block is the
        last), which changes no scale; the padding is then sliced off and the
        convolution's transpose sums over the real positions. The feature
        dimensions are not padded: a block that does not divide the input
        features (forward) or the output features (input gradient) is a
        `ValueError`.
    - **Square blocks** (`NVFP4Quantize(axis=(0, 1))`, the NVFP4 recipe's weight)
        cover the kernel's output and input features, whatever its layout, so
        that one quantised kernel serves the forward and input-gradient products.
    - **No Hadamard transform:** a recipe with one (`recipes.nvfp4()`'s
        weight-gradient product) is a `ValueError`; see its message.
    - **With the identity recipe,** the value and both cotangents equal
        `lax.conv_general_dilated`'s bit for bit (tested on the CPU).
    - **Under `jax.vmap`** it is what `vmap` means, as for
        [`quantized_dot`][eqxrules.quantized_dot]: each example its own call.
        With `axis_name` naming that `vmap`, a mapped `lhs` joins the batch
        dimension, so the per-tensor scales and the weight-gradient blocks see
        the whole batch, as one call on it would (a mapped `rhs` is then a
        `ValueError`); under `jax.shard_map` over a mesh axis of that name, the
        blocks stay within each device's rows and per-tensor scales span the
        devices.

    Quantisation and products are computed in float32; the value has the dtype of
    the plain convolution, each cotangent its primal's. Reverse mode only.

    **Arguments:**

    - `lhs`: the input, e.g. `[N, C, H, W]` (the layout `dimension_numbers` gives).
    - `rhs`: the kernel, e.g. `[O, C / feature_group_count, kh, kw]`.
    - `window_strides`, `padding`, `lhs_dilation`, `rhs_dilation`,
        `dimension_numbers`, `feature_group_count`: as for
        `jax.lax.conv_general_dilated`.
    - `recipe`: an [`eqxrules.recipes.Recipe`][].
    - `key`: a PRNG key, required when the recipe rounds stochastically (split in
        three, one per product, and each product's in three, as for
        [`quantized_dot_general`][eqxrules.quantized_dot_general]).
    - `axis_name`: `None`, or the name (or tuple of names) of mapped axes the
        products span, as for [`quantized_dot`][eqxrules.quantized_dot].

    **Returns:**

    The convolution's value.

    !!! Example

        ```python
        x = jax.random.normal(jax.random.key(0), (8, 32, 16, 16))
        w = jax.random.normal(jax.random.key(1), (64, 32, 3, 3)) / 16
        y = eqxrules.quantized_conv(
            x, w, (1, 1), "SAME", recipe=eqxrules.recipes.mxfp8()
        )  # [8, 64, 16, 16]
        ```
    """
    name = _NAME
    operands = {"lhs": lhs, "rhs": rhs}
    products, random = check_call(name, recipe, operands, key, axis_name)
    op = conv_op(
        name,
        lhs,
        rhs,
        window_strides,
        padding,
        lhs_dilation,
        rhs_dilation,
        dimension_numbers,
        feature_group_count,
    )
    check_conv(name, op, products, jnp.shape(rhs))
    return run(op, products, lhs, rhs, key, random, axis_name)


__all__ = ["quantized_conv"]
