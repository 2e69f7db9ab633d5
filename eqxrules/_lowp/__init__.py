"""Low-precision training: [`quantized_dot`][eqxrules.quantized_dot] (one custom VJP
that reads a recipe), the recipes (data, in `recipes`), the random Hadamard transform
(`hadamard`), and the layer that puts them into an `eqx.nn.Linear` (`layer`). The
formats' rounding, nearest and stochastic, lives with the quantisers in
`eqxrules._rules.floats`."""
