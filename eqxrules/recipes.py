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
- [`identity`][eqxrules.recipes.identity]: nothing quantised (`jnp.dot`);
- [`Custom`][eqxrules.recipes.Custom]: any recipe, product by product.

Change a part with `dataclasses.replace`:

```python
recipe = dataclasses.replace(eqxrules.recipes.nvfp4(), hadamard=None)
```
"""

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
    "MXFP8",
    "NVFP4",
    "Custom",
    "Product",
    "Recipe",
    "fp8",
    "identity",
    "mxfp8",
    "nvfp4",
]
