r"""The random Hadamard transform (RHT): a block-diagonal orthonormal rotation that
spreads outliers across a block before quantisation.

For a block size $n$ (a power of two), $H_n$ is the Sylvester Hadamard matrix
($H_1 = [1]$, $H_{2m} = \begin{bmatrix} H_m & H_m \\ H_m & -H_m \end{bmatrix}$,
symmetric, entries $\pm 1$) and $D = \operatorname{diag}(s)$ holds $n$ random signs
drawn from a key. A vector $v$ of the reduced dimension, split into blocks of $n$,
becomes, block by block,

$$v \mapsto R^\top v, \qquad R = D\,H_n / \sqrt{n}, \qquad R R^\top = I.$$

Applied to both operands of a product along the reduced dimension, with the same
signs, it leaves the product unchanged:
$\sum_j (R^\top a)_j (R^\top b)_j = a^\top R R^\top b = a^\top b$ (up to float
rounding). That is what [`quantized_dot`][eqxrules.quantized_dot] does before
quantising the operands of a product whose recipe asks for it (Transformer Engine's
NVFP4 recipe: the weight-gradient product, $n = 16$).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray


def hadamard_matrix(n: int) -> np.ndarray:
    """The Sylvester Hadamard matrix of order `n` (a power of two), entries ±1."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def random_signs(key: PRNGKeyArray, n: int) -> Array:
    """The diagonal of $D$: `n` independent signs, each ±1 with probability 1/2."""
    return jax.random.rademacher(key, (n,), jnp.float32)


def rotate(a: Array, axis: int, signs: Array) -> Array:
    """$R^\\top v$ for every block of `len(signs)` consecutive elements of the float32
    `a` along `axis` (whose length that divides)."""
    n = signs.shape[0]
    moved = jnp.moveaxis(a, axis, -1)
    blocks = moved.reshape(*moved.shape[:-1], moved.shape[-1] // n, n)
    # `H (s ⊙ v) / √n`, with H symmetric. HIGHEST: a TPU or GPU would otherwise
    # round the operands to bfloat16 or TF32, and the rotation would no longer be
    # orthonormal to float32 precision.
    h = jnp.asarray(hadamard_matrix(n))
    out = jnp.matmul(blocks * signs, h, precision=jax.lax.Precision.HIGHEST)
    out = out * np.float32(1 / math.sqrt(n))
    return jnp.moveaxis(out.reshape(moved.shape), -1, axis)
