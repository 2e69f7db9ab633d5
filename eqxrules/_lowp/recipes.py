r"""Training recipes: which quantiser each operand of each of a linear layer's three
products gets. Data only; [`quantized_dot`][eqxrules.quantized_dot] reads it through
`products()`. The public face, with the table of the products, is
`eqxrules.recipes`."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import equinox as eqx
import jax.tree_util as jtu

from .._catalogue import Rule
from .._hyper import Check, at_least, check_fields, hyperparameter, integer, one_of
from .._rules.blocks import BlockQuantizer, MXQuantize, scale_rule
from .._rules.floats import FloatQuantize, element_format
from .._rules.nvfp4 import NVFP4Quantize


def _is_quantizer(v: Any) -> bool:
    return (
        isinstance(v, Rule)
        and (v.elementwise or isinstance(v, BlockQuantizer))
        and not jtu.tree_leaves(eqx.filter(v, eqx.is_array))
    )


quantizer = Check(
    "be a quantiser of eqxrules with no array fields (an elementwise rule or a "
    "block quantiser: `eqxrules.MXQuantize(format='e4m3')`, say) or None",
    lambda v, _: _is_quantizer(v),
    TypeError,
    ("e4m3", 3),
)
boolean = Check("be a bool", lambda v, _: isinstance(v, bool), TypeError, (1,))
power_of_two = Check(
    "be a power of two >= 2",
    lambda v, _: v >= 2 and (v & (v - 1)) == 0,
    bad=(12, 1),
    after=(integer,),
)


class Product(eqx.Module):
    r"""How one of the three products of [`quantized_dot`][eqxrules.quantized_dot]
    is computed: $Q_\mathrm{lhs}(\mathrm{lhs}) \cdot Q_\mathrm{rhs}(\mathrm{rhs})$,
    each operand quantised with its blocks along the dimension the product reduces,
    after an optional random Hadamard transform of both operands along it.

    **Arguments:**

    - `lhs`, `rhs`: the operands' quantisers: rules of eqxrules without array
        fields, elementwise ([`FloatQuantize`][eqxrules.FloatQuantize]) or blocked
        ([`MXQuantize`][eqxrules.MXQuantize],
        [`NVFP4Quantize`][eqxrules.NVFP4Quantize]: their `axis` is set to the
        reduced dimension, square blocks, `axis=(0, 1)`, kept as they are);
        `None` leaves the operand as it is.
    - `hadamard`: the block size $n$ (a power of two) of the random Hadamard
        transform applied to both operands before quantising, or `None`. Each
        block of $n$ along the reduced dimension becomes $R^\top v$ with
        $R = D H_n / \sqrt n$: $H_n$ Sylvester's Hadamard matrix, $D$ the
        diagonal of $n$ random signs drawn from the product's key, the same for
        both operands, so that $R R^\top = I$ leaves the unquantised product
        unchanged.
    """

    lhs: Any = hyperparameter(None, quantizer, allow_none=True)
    rhs: Any = hyperparameter(None, quantizer, allow_none=True)
    hadamard: int | None = hyperparameter(None, power_of_two, allow_none=True)

    def __check_init__(self) -> None:
        check_fields(self, "Product")


product_check = Check(
    "be an `eqxrules.recipes.Product`",
    lambda v, _: isinstance(v, Product),
    TypeError,
    (None, "fwd"),
)


class Recipe(eqx.Module):
    """The base of every recipe: a subclass gives its three products with
    `products()`. [`quantized_dot`][eqxrules.quantized_dot] reads nothing else."""

    @abc.abstractmethod
    def products(self) -> Custom:
        """The three products, as a [`Custom`][eqxrules.recipes.Custom] recipe."""


class Custom(Recipe):
    r"""A recipe given product by product (AQT's shape): each of the three products
    its own operand quantisers and Hadamard transform. Built with no arguments,
    every operand is left as it is: [`quantized_dot`][eqxrules.quantized_dot] is
    then `jnp.dot` ([`identity`][eqxrules.recipes.identity]).

    **Arguments:**

    - `fwd`: the forward product $y = x\,w$, reduced along $K$: `lhs` quantises
        $x$, `rhs` $w$.
    - `dx`: the input-gradient product $\bar x = \bar y\,w^\top$, reduced along
        $N$: `lhs` quantises $\bar y$, `rhs` $w$.
    - `dw`: the weight-gradient product $\bar w = x^\top \bar y$, reduced along the
        batch $M$: `lhs` quantises $x$, `rhs` $\bar y$.

    !!! Example

        ```python
        e4m3 = eqxrules.MXQuantize(format="e4m3")
        recipe = eqxrules.recipes.Custom(
            fwd=eqxrules.recipes.Product(e4m3, e4m3),  # backward left in float32
        )
        ```
    """

    fwd: Product = hyperparameter(Product(), product_check)
    dx: Product = hyperparameter(Product(), product_check)
    dw: Product = hyperparameter(Product(), product_check)

    def __check_init__(self) -> None:
        check_fields(self, "Custom")

    def products(self) -> Custom:
        """This recipe itself."""
        return self


def block_lengths(product: Product) -> list[tuple[str, int]]:
    """`(part, length)` for each part of `product` that needs the reduced dimension
    to be a multiple of `length`: blocked quantisers and the Hadamard transform."""
    out = [
        (side, q.block_size)
        for side, q in (("lhs", product.lhs), ("rhs", product.rhs))
        if isinstance(q, BlockQuantizer)
    ]
    if product.hadamard is not None:
        out.append(("hadamard", product.hadamard))
    return out


def reads_key(products: Custom) -> list[str]:
    """The parts of `products` that draw random numbers, as `"dw.hadamard"`,
    `"dx.lhs"`: empty if none needs a key."""
    parts = []
    for name in ("fwd", "dx", "dw"):
        p: Product = getattr(products, name)
        parts += [
            f"{name}.{side}"
            for side, q in (("lhs", p.lhs), ("rhs", p.rhs))
            if q is not None and q.needs_key()
        ]
        if p.hadamard is not None:
            parts.append(f"{name}.hadamard")
    return parts


class MXFP8(Recipe):
    r"""MXFP8 training (Transformer Engine's `MXFP8BlockScaling`; NVIDIA,
    "Recipes for pre-training LLMs with MXFP8", arXiv 2506.08027): every operand
    of every product in [`MXQuantize`][eqxrules.MXQuantize] blocks of
    `block_size` along the dimension that product reduces (so $x$, $w$ and
    $\bar y$ are each quantised twice, once per product they enter, from their
    float values), power of two (E8M0) scales, rounding to nearest.

    The scales are rounded up by default, $X = 2^{\lceil \log_2(a/M) \rceil}$
    for a block of amax $a$ and element maximum $M$, as in NVIDIA's recipe,
    JAX's `scaled_dot_general` and qwix: the OCP rule,
    $X = 2^{\lfloor \log_2 a \rfloor - e_\max}$, clips the largest elements
    of a block whose amax has a larger significand than $M$ (above 1.75 for
    E4M3: by up to 12.5%), and the paper reports that it can diverge.

    **Arguments:**

    - `format`: the element format of $x$ and $w$: `"e4m3"` (the default) or
        another of [`FloatQuantize`][eqxrules.FloatQuantize]'s.
    - `gradient_format`: that of $\bar y$; `"e4m3"` by default (Transformer
        Engine's `HYBRID` is `"e5m2"`).
    - `block_size`: elements per block, 32 in the OCP MX specification.
    - `scale_rounding`: `"ceil"` (the default: nothing saturates) or `"floor"`
        (the OCP specification's rule).
    """

    format: str = hyperparameter("e4m3", element_format)
    gradient_format: str = hyperparameter("e4m3", element_format)
    block_size: int = hyperparameter(32, at_least(1, integer))
    scale_rounding: str = hyperparameter("ceil", scale_rule)

    def __check_init__(self) -> None:
        check_fields(self, "MXFP8")

    def products(self) -> Custom:
        """Every operand in MX blocks along its product's reduced dimension."""
        q, g = (
            MXQuantize(
                format=f, block_size=self.block_size, scale_rounding=self.scale_rounding
            )
            for f in (self.format, self.gradient_format)
        )
        return Custom(fwd=Product(q, q), dx=Product(g, q), dw=Product(q, g))


class FP8(Recipe):
    r"""FP8 training with current scaling (Transformer Engine's
    `Float8CurrentScaling`, its `HYBRID` formats): every operand of every product
    in [`FloatQuantize`][eqxrules.FloatQuantize] with `scale="amax"`, one float32
    scale per tensor from its current largest magnitude, rounding to nearest. A
    per-tensor scale is the same whichever dimension a product reduces, so $x$ is
    quantised alike in the forward and weight-gradient products.

    **Arguments:**

    - `format`: the element format of $x$ and $w$, `"e4m3"` by default.
    - `gradient_format`: that of $\bar y$, `"e5m2"` by default (its range).
    """

    format: str = hyperparameter("e4m3", element_format)
    gradient_format: str = hyperparameter("e5m2", element_format)

    def __check_init__(self) -> None:
        check_fields(self, "FP8")

    def products(self) -> Custom:
        """Every operand scaled by its own tensor's amax."""
        q = FloatQuantize(format=self.format, scale="amax")
        g = FloatQuantize(format=self.gradient_format, scale="amax")
        return Custom(fwd=Product(q, q), dx=Product(g, q), dw=Product(q, g))


class NVFP4(Recipe):
    r"""NVFP4 training, Transformer Engine's `NVFP4BlockScaling` (NVIDIA, "Pretraining
    large language models with NVFP4", 2025): every operand in
    [`NVFP4Quantize`][eqxrules.NVFP4Quantize] (FP4 elements, an E4M3 scale per
    block of 16, a float32 scale per tensor from its current amax), with three
    techniques, each a field:

    - the weight in 16×16 blocks, so that one quantised weight serves the forward
        and the input-gradient products (`square_weight_blocks`);
    - stochastic rounding of the gradient $\bar y$, in both products it enters
        (`gradient_rounding`); everything else rounds to nearest;
    - a random Hadamard transform of both operands of the weight-gradient product
        along the batch (`hadamard`).

    Activations and gradients are in blocks of 1×16 along each product's reduced
    dimension.

    **Arguments:**

    - `square_weight_blocks`: 16×16 weight blocks (`True`, the default) or 1×16
        blocks along each product's reduced dimension (`False`).
    - `gradient_rounding`: `"stochastic"` (the default) or `"nearest"`.
    - `hadamard`: the Hadamard block size on the weight-gradient product (16), or
        `None` for no transform.
    - `four_over_six`: `False` (the default), or `True` for every operand in
        [`NVFP4Quantize(four_over_six=True)`][eqxrules.NVFP4Quantize]: each block
        scaled to 4 or to 6, whichever errs less (Four Over Six, arXiv
        2512.02010; Transformer Engine's `nvfp4_4over6`).

    !!! Example

        ```python
        ablation = dataclasses.replace(
            eqxrules.recipes.nvfp4(), gradient_rounding="nearest", hadamard=None
        )
        ```
    """

    square_weight_blocks: bool = hyperparameter(True, boolean)
    gradient_rounding: str = hyperparameter(
        "stochastic", one_of("nearest", "stochastic")
    )
    hadamard: int | None = hyperparameter(16, power_of_two, allow_none=True)
    four_over_six: bool = hyperparameter(False, boolean)

    def __check_init__(self) -> None:
        check_fields(self, "NVFP4")

    def products(self) -> Custom:
        """The three products of Transformer Engine's NVFP4 recipe."""
        a = NVFP4Quantize(four_over_six=self.four_over_six)
        g = dataclasses.replace(a, rounding=self.gradient_rounding)
        w = dataclasses.replace(a, axis=(0, 1)) if self.square_weight_blocks else a
        return Custom(
            fwd=Product(a, w),
            dx=Product(g, w),
            dw=Product(a, g, hadamard=self.hadamard),
        )


def mxfp8() -> MXFP8:
    """[`MXFP8`][eqxrules.recipes.MXFP8] with its defaults: E4M3 elements in blocks
    of 32 with E8M0 scales, rounding to nearest."""
    return MXFP8()


def fp8() -> FP8:
    """[`FP8`][eqxrules.recipes.FP8] with its defaults: one float32 scale per
    tensor from its current amax, E4M3 for $x$ and $w$, E5M2 for gradients."""
    return FP8()


def nvfp4() -> NVFP4:
    """[`NVFP4`][eqxrules.recipes.NVFP4] with its defaults, Transformer Engine's
    recipe: 16×16 weight blocks, 1×16 activation and gradient blocks, stochastic
    rounding of gradients, a 16-point random Hadamard transform on the
    weight-gradient product's operands."""
    return NVFP4()


def identity() -> Custom:
    """A recipe that quantises nothing: [`quantized_dot`][eqxrules.quantized_dot]
    with it is `jnp.dot`, value and VJP, bit for bit (tested on the CPU)."""
    return Custom()
