"""The data and the model that `lowp_training.py` trains in low precision: a
character-level transformer language model on the Python standard library's own
source files, and the settings every row of that example shares.

The model (`CharTransformer`): byte embeddings and learned positions, pre-norm
blocks (causal self-attention, its queries, keys and values from one fused
projection as in GPT-2, then an MLP with a GELU), a final layer norm, and a
readout tied to the embedding matrix (GPT-2's too). It is written per window and
per token and mapped with `jax.vmap` over both, each axis named (`BATCH`,
`TOKENS`): a quantised layer's products span both names (`axis_name`), so each
runs on the whole batch's tokens as one matrix product, as hardware recipes take
them. Its linear layers are `eqx.nn.Linear`s, 4 per block, which
`eqxrules.quantize(model, recipe=...)` replaces; the attention's own products
(`q·kᵀ`, `p·v`) take a recipe of their own (`eqxrules.quantized_einsum`) or stay
in float32.

The data: the `*.py` files of a fixed list of standard library packages
(`PACKAGES`, their test directories left out), found under
`sysconfig.get_paths()["stdlib"]`, sorted by path and concatenated; so about 0.8 MB
with CPython 3.11 (another Python has other files). The vocabulary is the 256 byte
values; these files are ASCII, so a byte is a character. The text is cut into
chunks of 2,048 bytes; every tenth chunk is validation, the rest training.

Run: `python examples/lowp_training_model.py [--quick]` describes the data and the
model of the full (or quick) settings: the files, the parameters, and the loss of
the untrained model on the validation windows (near ln 256 ≈ 5.545 nats per
character, a model that predicts every byte alike). Needs the `examples` extra
(`optax`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import pathlib
import platform
import sys
import sysconfig
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray

import eqxrules
from eqxrules import recipes

PACKAGES = ("collections", "concurrent", "http", "json", "logging", "unittest")
CHUNK = 2048  # bytes; every tenth chunk is validation


@dataclasses.dataclass(frozen=True)
class Settings:
    """The model and its training: the same for every row. Every width is a
    multiple of 32, so MX blocks of 32 and NVFP4 blocks of 16 (and its 16×16
    weight blocks) divide every product's reduced dimension; so does the batch of
    the weight-gradient product, `batch · context` tokens."""

    width: int = 64
    heads: int = 4
    depth: int = 2
    hidden: int = 256
    context: int = 64
    batch: int = 32
    steps: int = 300
    learning_rate: float = 1e-2
    warmup: int = 20
    validation_windows: int = 512
    seeds: tuple[int, ...] = (0, 1, 2)


FULL = Settings()
QUICK = Settings(
    width=32, heads=2, depth=1, hidden=64, context=32, batch=8, steps=12,
    warmup=2, validation_windows=32, seeds=(0,),
)  # fmt: skip


# The data.


def source_files() -> list[pathlib.Path]:
    """The sorted `*.py` files of `PACKAGES` in this Python's standard library,
    without test directories (some distributions leave them out)."""
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [
        f
        for package in PACKAGES
        for f in (stdlib / package).rglob("*.py")
        if not {"test", "tests"} & set(f.relative_to(stdlib).parts[:-1])
    ]
    if not files:
        raise FileNotFoundError(f"no `*.py` files of {PACKAGES} under {stdlib}")
    return sorted(files, key=lambda f: f.relative_to(stdlib).as_posix())


def corpus() -> tuple[np.ndarray, np.ndarray, dict]:
    """`(train, validation, about)`: the training and validation bytes, and what
    they were made from (files, bytes, SHA-256, whether every byte is ASCII)."""
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = source_files()
    text = b"".join(f.read_bytes() for f in files)
    data = np.frombuffer(text, np.uint8)
    chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
    validation = np.concatenate(chunks[9::10])
    train = np.concatenate([c for i, c in enumerate(chunks) if i % 10 != 9])
    about = dict(
        stdlib=str(stdlib),
        python=platform.python_version(),
        files=[f.relative_to(stdlib).as_posix() for f in files],
        bytes=len(data),
        train_bytes=len(train),
        validation_bytes=len(validation),
        sha256=hashlib.sha256(text).hexdigest(),
        ascii=text.isascii(),
    )
    return train, validation, about


def windows(data: np.ndarray, starts: np.ndarray, length: int) -> Array:
    return jnp.asarray(np.stack([data[s : s + length] for s in starts]), jnp.int32)


def validation_set(validation_bytes: np.ndarray, s: Settings) -> Array:
    """`s.validation_windows` windows of `s.context + 1` bytes, evenly spaced over
    the validation text."""
    last = len(validation_bytes) - s.context - 1
    starts = np.linspace(0, last, s.validation_windows).astype(int)
    return windows(validation_bytes, starts, s.context + 1)


# The model.


# The model is written per window and per token, mapped with `jax.vmap`: the
# windows of a batch (`loss_fn`) and each window's tokens (`per_token`). Both axes
# are named, and the quantised layers' products span both (`axis_name`), so each
# runs on the whole batch's tokens, as one matrix product.
BATCH, TOKENS = "batch", "tokens"


def per_token(layer: Any) -> Any:
    """`layer` mapped over a window's tokens."""
    return jax.vmap(layer, axis_name=TOKENS)


class Attention(eqx.Module):
    """Causal multi-head self-attention: one `Linear` gives the queries, keys and
    values (GPT-2's fused projection), another the output."""

    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    heads: int = eqx.field(static=True)
    products: recipes.Recipe | None = eqx.field(static=True)

    def __init__(
        self,
        s: Settings,
        products: recipes.Recipe | None = None,
        *,
        key: PRNGKeyArray,
    ):
        k1, k2 = jax.random.split(key)
        self.qkv = eqx.nn.Linear(s.width, 3 * s.width, use_bias=False, key=k1)
        self.out = eqx.nn.Linear(s.width, s.width, use_bias=False, key=k2)
        self.heads = s.heads
        self.products = products

    def __call__(self, x: Float[Array, "T D"]) -> Float[Array, "T D"]:
        heads = per_token(self.qkv)(x).reshape(x.shape[0], 3, self.heads, -1)
        q, k, v = heads[:, 0], heads[:, 1], heads[:, 2]
        if self.products is None:
            attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        else:  # q·kᵀ and p·v with `products`: each of their three products
            r = self.products
            scores = eqxrules.quantized_einsum(
                "qhd,khd->hqk", q, k, recipe=r, axis_name=BATCH
            )
            causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
            scores = jnp.where(causal, scores / math.sqrt(q.shape[-1]), -jnp.inf)
            p = jax.nn.softmax(scores, axis=-1)
            attended = eqxrules.quantized_einsum(
                "hqk,khd->qhd", p, v, recipe=r, axis_name=BATCH
            )
        return per_token(self.out)(attended.reshape(x.shape))


class Block(eqx.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP."""

    attention_norm: eqx.nn.LayerNorm
    attention: Attention
    mlp_norm: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear

    def __init__(
        self, s: Settings, attention: recipes.Recipe | None, *, key: PRNGKeyArray
    ):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attention_norm = eqx.nn.LayerNorm(s.width)
        self.attention = Attention(s, attention, key=k1)
        self.mlp_norm = eqx.nn.LayerNorm(s.width)
        self.mlp_in = eqx.nn.Linear(s.width, s.hidden, key=k2)
        self.mlp_out = eqx.nn.Linear(s.hidden, s.width, key=k3)

    def __call__(self, x: Float[Array, "T D"]) -> Float[Array, "T D"]:
        x = x + self.attention(jax.vmap(self.attention_norm)(x))
        h = jax.vmap(self.mlp_norm)(x)
        return x + per_token(self.mlp_out)(jax.nn.gelu(per_token(self.mlp_in)(h)))


class CharTransformer(eqx.Module):
    """Bytes in, the next byte's logits out, for one window `[T]`."""

    embedding: eqx.nn.Embedding
    position: Array
    blocks: tuple[Block, ...]
    norm: eqx.nn.LayerNorm

    def __init__(
        self,
        s: Settings,
        attention: recipes.Recipe | None = None,
        *,
        key: PRNGKeyArray,
    ):
        k_embed, k_pos, *k_blocks = jax.random.split(key, 2 + s.depth)
        # Rows of norm about 1, so that the tied readout's logits start near 1.
        scale = 1 / math.sqrt(s.width)
        weight = scale * jax.random.normal(k_embed, (256, s.width))
        self.embedding = eqx.nn.Embedding(weight=weight)
        self.position = scale * jax.random.normal(k_pos, (s.context, s.width))
        self.blocks = tuple(Block(s, attention, key=k) for k in k_blocks)
        self.norm = eqx.nn.LayerNorm(s.width)

    def __call__(self, tokens: Int[Array, " T"]) -> Float[Array, "T 256"]:
        x = jax.vmap(self.embedding)(tokens) + self.position[: tokens.shape[0]]
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.norm)(x) @ self.embedding.weight.T


def main(quick: bool = False) -> dict:
    """Print and return what the settings (`QUICK` or `FULL`) make: the corpus
    (`about` of `corpus()`), the model's parameter count, and the untrained
    model's mean loss on the validation windows, in nats per character."""
    s = QUICK if quick else FULL
    _, validation, about = corpus()
    model = CharTransformer(s, key=jax.random.key(0))
    parameters = sum(
        v.size for v in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))
    )
    batch = validation_set(validation, s)
    logits = jax.vmap(model, axis_name=BATCH)(batch[:, :-1])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:])
    result = dict(parameters=int(parameters), loss=float(loss.mean()), corpus=about)
    print(
        f"{len(about['files'])} files of Python {about['python']}'s standard library, "
        f"{about['bytes']:,} bytes ({about['validation_bytes']:,} for validation); "
        f"a model of width {s.width} and depth {s.depth}: {parameters:,} parameters, "
        f"untrained loss {result['loss']:.3f} nats per character "
        f"(ln 256 = {math.log(256):.3f})"
    )
    return result


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
