r"""Training recipes for [`quantized_dot`][eqxrules.quantized_dot]: which quantiser
each operand of each of a linear layer's three products gets, as immutable,
validated data (`eqx.Module`s whose fields are static), in the shape of AQT's
config. Every recipe gives its three products through `products()`, as a
[`Custom`][eqxrules.recipes.Custom] recipe with one
[`Product`][eqxrules.recipes.Product] for each of

| product | value | operands (`lhs`, `rhs`) | reduced (blocked) along |
|---|---|---|---|
| `fwd` | $y = x\,w$ | $x$, $w$ | $K$ |
| `dx` | $\bar x = \bar y\,w^\top$ | $\bar y$, $w$ | $N$ |
| `dw` | $\bar w = x^\top \bar y$ | $x$, $\bar y$ | the batch $M$ |

- [`fp8`][eqxrules.recipes.fp8], [`mxfp8`][eqxrules.recipes.mxfp8],
    [`nvfp4`][eqxrules.recipes.nvfp4]: Transformer Engine's recipes, as
    [`FP8`][eqxrules.recipes.FP8], [`MXFP8`][eqxrules.recipes.MXFP8] and
    [`NVFP4`][eqxrules.recipes.NVFP4], each technique a field;
- [`fp8_blockwise`][eqxrules.recipes.fp8_blockwise] (DeepSeek-V3's fine-grained
    FP8), [`fp8_rowwise`][eqxrules.recipes.fp8_rowwise] (torchao's row-wise FP8),
    [`mxfp4`][eqxrules.recipes.mxfp4]: the field's other recipes, as
    [`FP8Blockwise`][eqxrules.recipes.FP8Blockwise],
    [`FP8Rowwise`][eqxrules.recipes.FP8Rowwise] and
    [`MXFP4`][eqxrules.recipes.MXFP4];
- [`identity`][eqxrules.recipes.identity]: nothing quantised (`jnp.dot`);
- [`Custom`][eqxrules.recipes.Custom]: any recipe, product by product.

Change a part with `dataclasses.replace`:

```python
recipe = dataclasses.replace(eqxrules.recipes.nvfp4(), hadamard=None)
```
"""

from ._lowp.field_recipes import (
    MXFP4 as MXFP4,
    FP8Blockwise as FP8Blockwise,
    FP8Rowwise as FP8Rowwise,
    fp8_blockwise as fp8_blockwise,
    fp8_rowwise as fp8_rowwise,
    mxfp4 as mxfp4,
)
from ._lowp.recipes import (
    FP8 as FP8,
    MXFP8 as MXFP8,
    NVFP4 as NVFP4,
    Custom as Custom,
    Product as Product,
    Recipe as Recipe,
    fp8 as fp8,
    identity as identity,
    mxfp8 as mxfp8,
    nvfp4 as nvfp4,
)

__all__ = [
    "FP8",
    "MXFP4",
    "MXFP8",
    "NVFP4",
    "Custom",
    "FP8Blockwise",
    "FP8Rowwise",
    "Product",
    "Recipe",
    "fp8",
    "fp8_blockwise",
    "fp8_rowwise",
    "identity",
    "mxfp4",
    "mxfp8",
    "nvfp4",
]
