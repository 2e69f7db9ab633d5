"""Training recipes for [`quantized_dot`][eqxrules.quantized_dot]: which quantiser each
operand of each of a linear layer's three products gets (forward, input gradient,
weight gradient), as immutable, validated data.

- [`mxfp8`][eqxrules.recipes.mxfp8], [`nvfp4`][eqxrules.recipes.nvfp4]: Transformer
    Engine's recipes, as [`MXFP8`][eqxrules.recipes.MXFP8] and
    [`NVFP4`][eqxrules.recipes.NVFP4], each technique a field;
- [`identity`][eqxrules.recipes.identity]: nothing quantised (`jnp.dot`);
- [`Custom`][eqxrules.recipes.Custom]: any recipe, product by product
    ([`Product`][eqxrules.recipes.Product]).

Change a part with `dataclasses.replace`:

```python
recipe = dataclasses.replace(eqxrules.recipes.nvfp4(), hadamard=None)
```
"""

from ._lowp.recipes import (
    MXFP8 as MXFP8,
    NVFP4 as NVFP4,
    Custom as Custom,
    Product as Product,
    Recipe as Recipe,
    identity as identity,
    mxfp8 as mxfp8,
    nvfp4 as nvfp4,
)

__all__ = [
    "MXFP8",
    "NVFP4",
    "Custom",
    "Product",
    "Recipe",
    "identity",
    "mxfp8",
    "nvfp4",
]
