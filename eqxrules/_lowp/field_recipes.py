r"""The recipes the field trains with beside Transformer Engine's (`recipes`):
DeepSeek-V3's fine-grained FP8, torchao's row-wise FP8, and MXFP4 with NVFP4's
techniques. Data only, as `recipes`; the public face is `eqxrules.recipes`."""

from __future__ import annotations

from .._hyper import at_least, check_fields, hyperparameter, integer, one_of
from .._rules.blocks import MXQuantize, scale_rule
from .._rules.fine_grained import BlockFloatQuantize, RowFloatQuantize
from .._rules.floats import element_format
from .recipes import Custom, Product, Recipe, boolean, power_of_two


class FP8Blockwise(Recipe):
    r"""DeepSeek-V3's fine-grained FP8 training (arXiv 2412.19437, §3.3): every
    operand in E4M3 under float32 scales of small tiles and blocks
    ([`BlockFloatQuantize`][eqxrules.BlockFloatQuantize]), rounding to nearest.
    For a tile or block $b$ of amax $a$:

    $$s = a / 448 \ \text{(float32, not a power of two)}, \qquad
    q = s \cdot \operatorname{round}_{\mathrm{e4m3}}\!\big(
    \operatorname{clip}(b / s, -448, 448)\big)$$

    with $B$ = `block_size` (128):

    | product | `lhs` | `rhs` |
    |---|---|---|
    | `fwd` $y = x\,w$ | $x$ in 1×$B$ tiles along $K$ | $w$ in $B$×$B$ blocks |
    | `dx` $\bar x = \bar y\,w^\top$ | $\bar y$ in 1×$B$ tiles along $N$ | the same $B$×$B$ blocks of $w$ |
    | `dw` $\bar w = x^\top \bar y$ | $x$ in $B$×1 tiles along the batch $M$ | $\bar y$ in $B$×1 tiles along $M$ |

    Each tile runs along what its product contracts, so that its scale factors
    out of each partial sum of $B$ terms (the hardware applies it there, in the
    accumulation); the weight's square blocks are one quantised weight for both
    products it enters. A token's activations and gradients are scaled within
    the token: nothing leaks between tokens, where one scale per tensor
    ([`fp8`][eqxrules.recipes.fp8]) lets a spike in one token change every
    other's product.

    **Arguments:**

    - `block_size`: $B$, 128 by default. Square blocks need the products'
        contracted dimensions of the weight (its $K$ and $N$) to be multiples
        of it or the products to pad them; the tiles are padded with zeros.
    - `square_weight_blocks`: $B$×$B$ weight blocks (`True`, the default), or
        1×$B$ tiles along each product's contraction (`False`).
    """

    block_size: int = hyperparameter(128, at_least(1, integer))
    square_weight_blocks: bool = hyperparameter(True, boolean)

    def __check_init__(self) -> None:
        check_fields(self, "FP8Blockwise")

    def products(self) -> Custom:
        """Tiles along each product's contraction, square weight blocks."""
        a = BlockFloatQuantize(format="e4m3", block_size=self.block_size)
        w = BlockFloatQuantize(format="e4m3", block_size=self.block_size, axis=(0, 1))
        w = w if self.square_weight_blocks else a
        return Custom(fwd=Product(a, w), dx=Product(a, w), dw=Product(a, a))


class FP8Rowwise(Recipe):
    r"""Row-wise FP8 training (torchao's `Float8LinearRecipeName.ROWWISE`, its
    scales rounded to powers of two): every operand of every product in
    [`RowFloatQuantize`][eqxrules.RowFloatQuantize], one scale per row of what
    that product contracts, rounding to nearest. For a row $b$ of amax $a$ and
    $M$ the format's largest value (448 for E4M3):

    $$X = 2^{\lceil \log_2 (a / M) \rceil}, \qquad
    q = X \cdot \operatorname{round}_{\mathrm{fmt}}\!\big(
    \operatorname{clip}(b / X, -M, M)\big)$$

    So $x$ has one scale per token in the forward product and one per feature
    (over the batch) in the weight-gradient product; $w$ one per output column
    in the forward product, one per input row in the input-gradient product;
    $\bar y$ one per token, then one per output feature. A scale is the least
    power of two under which nothing saturates, and multiplying by it is exact.

    **Arguments:**

    - `format`: the element format of every operand, `"e4m3"` by default.
    """

    format: str = hyperparameter("e4m3", element_format)

    def __check_init__(self) -> None:
        check_fields(self, "FP8Rowwise")

    def products(self) -> Custom:
        """One power-of-two scale per row of what each product contracts."""
        q = RowFloatQuantize(format=self.format)
        return Custom(fwd=Product(q, q), dx=Product(q, q), dw=Product(q, q))


class MXFP4(Recipe):
    r"""MXFP4 training: every operand in OCP MX blocks of 32 along what its
    product contracts, E2M1 elements and E8M0 (power-of-two) scales
    ([`MXQuantize`][eqxrules.MXQuantize]), with two of
    [`nvfp4`][eqxrules.recipes.nvfp4]'s techniques, which Tseng et al.
    ("Training LLMs with MXFP4", arXiv 2502.20586) train MXFP4 with, each a
    field:

    - stochastic rounding of the gradient $\bar y$ in both products it enters
        (`gradient_rounding`); everything else rounds to nearest;
    - a random Hadamard transform of both operands of the weight-gradient
        product along the batch (`hadamard`), in blocks of 32: each rotation
        spreads a block's outliers over the elements that share its scale.

    The scales are rounded up, $X = 2^{\lceil \log_2 (a / 6) \rceil}$ for a
    block of amax $a$ (`scale_rounding="ceil"`): stochastic rounding is unbiased
    only where nothing saturates, and the OCP rule,
    $X = 2^{\lfloor \log_2 a \rfloor - 2}$, clips every block whose amax has a
    significand above 1.5 to 6, by up to 25%, every such block the same way
    (a bias no draw undoes). MX has no tensor scale, so nothing leaks between
    tokens in the forward product.

    **Arguments:**

    - `gradient_rounding`: `"stochastic"` (the default) or `"nearest"`.
    - `hadamard`: the Hadamard block size on the weight-gradient product (32), or
        `None` for no transform.
    - `scale_rounding`: `"ceil"` (the default) or `"floor"` (the OCP rule).
    """

    gradient_rounding: str = hyperparameter(
        "stochastic", one_of("nearest", "stochastic")
    )
    hadamard: int | None = hyperparameter(32, power_of_two, allow_none=True)
    scale_rounding: str = hyperparameter("ceil", scale_rule)

    def __check_init__(self) -> None:
        check_fields(self, "MXFP4")

    def products(self) -> Custom:
        """E2M1 in MX blocks of 32 along each product's contraction."""
        a = MXQuantize(format="e2m1", scale_rounding=self.scale_rounding)
        g = MXQuantize(
            format="e2m1",
            scale_rounding=self.scale_rounding,
            rounding=self.gradient_rounding,
        )
        return Custom(
            fwd=Product(a, a),
            dx=Product(g, a),
            dw=Product(a, g, hadamard=self.hadamard),
        )


def fp8_blockwise() -> FP8Blockwise:
    """[`FP8Blockwise`][eqxrules.recipes.FP8Blockwise] with its defaults,
    DeepSeek-V3's recipe: E4M3 everywhere, 1×128 tiles of activations and
    gradients along each product's contraction, 128×128 weight blocks, float32
    scales amax/448, rounding to nearest."""
    return FP8Blockwise()


def fp8_rowwise() -> FP8Rowwise:
    """[`FP8Rowwise`][eqxrules.recipes.FP8Rowwise] with its defaults: E4M3, one
    power-of-two scale per row of what each product contracts."""
    return FP8Rowwise()


def mxfp4() -> MXFP4:
    """[`MXFP4`][eqxrules.recipes.MXFP4] with its defaults: E2M1 in OCP blocks of
    32 with E8M0 scales rounded up, stochastic rounding of gradients, a 32-point
    random Hadamard transform on the weight-gradient product's operands."""
    return MXFP4()
