"""A character-level transformer language model trained in low precision: the
recipes of Transformer Engine (FP8, MXFP8, NVFP4) and of the field (DeepSeek-V3's
fine-grained FP8, row-wise FP8, MXFP4, NVFP4 with Four Over Six) against float32,
on the Python standard library's own source files.

The model and the data are in `lowp_training_model.py` beside this file: 2 pre-norm
blocks of width 64 with 4 heads, a readout tied to the byte embedding, 0.8 MB of
ASCII source (so the loss is in nats per character). A row's recipe enters through
`eqxrules.quantize(model, recipe=...)`, which replaces every `eqx.nn.Linear` by a
`QuantizedLinear`: the query-key-value and output projections and the MLP's two
layers, 4 per block, 8 in all. Their three products each (forward, input gradient,
weight gradient) are quantised as the recipe says. As in Transformer Engine, the
rest stays in float32: the embedding and the tied readout, layer norms, the
attention's own products (`q·kᵀ`, the softmax, its product with `v`), the residual
additions, and the optimiser; but for the ablation rows (below), one of which
quantises the attention's two products too (`eqxrules.quantized_einsum`), and one
of which keeps the last block's linear layers in `mxfp8()` (a recipe per layer,
as a function of its path).

Each step trains on a batch of windows drawn at random from the training text;
the validation loss is the mean over a fixed set of windows of the validation
text, computed with the row's recipe (the quantised forward the model was trained
with). Every row starts from the same initialisation and sees the same batches,
per seed; a recipe that draws random numbers (stochastic rounding, the Hadamard
transform) gets a fresh key at every step, through `eqxrules.Keyed`. The settings
were chosen once, for float32, and every row uses them: the model's size and the
steps to fit the time, the learning rate the best for float32 on seed 0 of those
tried (1e-3 to 4e-2).

Run: `python examples/lowp_training.py [--quick | --record]`. Needs the `examples`
extra (`optax`). Full mode (15 rows × 3 seeds) takes about 45 minutes on two
shared CPU cores, the rows that round stochastically and rotate about twice as
long as the others; `--quick` (one seed, a one-block model, 12 steps: it checks
that every row trains, not the figures) runs in the test suite. `--record` (full
mode) also writes the figures, the settings and the files to `lowp_training.json`
beside this file: the README's table is generated from it
(`python scripts/update_readme.py`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import platform
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, PRNGKeyArray
from lowp_training_model import (
    BATCH,
    FULL,
    QUICK,
    TOKENS,
    CharTransformer,
    Settings,
    corpus,
    validation_set,
    windows,
)

import eqxrules
from eqxrules import recipes


@dataclasses.dataclass(frozen=True)
class LastBlock:
    """A recipe per layer: `last` for the linear layers of the model's last block,
    `rest` for the others (the NVFP4 paper's practice, its last layers in a higher
    precision)."""

    rest: recipes.Recipe
    last: recipes.Recipe

    def for_depth(self, depth: int) -> Any:
        """The function of a layer's path that `quantize` takes, for a model of
        `depth` blocks."""
        last = f"blocks[{depth - 1}]."
        return lambda path: self.last if path.startswith(last) else self.rest


@dataclasses.dataclass(frozen=True)
class Row:
    """One configuration: `quantize(model, recipe=recipe)` (a recipe, or one per
    layer), or float32 if `None`; `attention`: the recipe of the attention's own
    products `q·kᵀ` and `p·v` (`None`: float32); `target`: the largest gap to
    float32's validation loss, in percent, that issue 19 asks of it (`None`:
    reported as measured)."""

    name: str
    recipe: recipes.Recipe | LastBlock | None = None
    target: float | None = None
    attention: recipes.Recipe | None = None


_NVFP4 = recipes.nvfp4()
ROWS = [
    Row("float32"),
    Row("fp8", recipes.fp8(), target=1.0),
    Row("mxfp8", recipes.mxfp8(), target=1.0),
    # Issue 26 §6 retired issue 19's 4% target for `nvfp4()`: its gap at this width
    # is its FP4 forward product's (the rows below), reported as measured.
    Row("nvfp4", _NVFP4),
    Row(
        "nvfp4 without SR and RHT",
        dataclasses.replace(_NVFP4, gradient_rounding="nearest", hadamard=None),
    ),
    # Where `nvfp4()`'s gap comes from: its forward product alone (the gradient
    # products in float32), then its two gradient products alone.
    Row("nvfp4 forward only", recipes.Custom(fwd=_NVFP4.products().fwd)),
    Row(
        "nvfp4 gradients only",
        recipes.Custom(dx=_NVFP4.products().dx, dw=_NVFP4.products().dw),
        target=0.5,  # issue 26 §6
    ),
    # Ablations (issue 26 §6): 1x16 weight blocks instead of 16x16; the last
    # block's linear layers in mxfp8(); mxfp8() with the attention's q·kᵀ and p·v
    # quantised too (in mxfp8(), which draws no key).
    Row("nvfp4, 1x16 weight blocks", recipes.NVFP4(square_weight_blocks=False)),
    Row("nvfp4, last block in mxfp8", LastBlock(_NVFP4, recipes.mxfp8())),
    Row("mxfp8, attention products too", recipes.mxfp8(), attention=recipes.mxfp8()),
    # The field's recipes (issue 41 §3), reported as measured. mxfp8() rounds its
    # scales up; here the OCP rule, which saturates. DeepSeek-V3's tiles of 128 are
    # wider than this model (64): blocks of 32, the MX block, float32 scales.
    Row("mxfp8, OCP floor scales", recipes.MXFP8(scale_rounding="floor")),
    Row("fp8_blockwise, blocks of 32", recipes.FP8Blockwise(block_size=32)),
    Row("fp8_rowwise", recipes.fp8_rowwise()),
    Row("mxfp4", recipes.mxfp4()),
    Row("nvfp4 with 4/6", recipes.NVFP4(four_over_six=True)),
]


def build(row: Row, s: Settings, seed: int) -> eqxrules.Keyed:
    """The row's model from seed `seed`, wrapped in `Keyed` (which gives each
    `QuantizedLinear` its own key at every call; the float32 model has none)."""
    model = CharTransformer(s, row.attention, key=jax.random.key(seed))
    if row.recipe is not None:
        recipe = layer_recipes(row, s)
        model = eqxrules.quantize(model, recipe=recipe, axis_name=(BATCH, TOKENS))
    return eqxrules.Keyed(model)


def layer_recipes(row: Row, s: Settings) -> Any:
    """What `quantize` takes for `row` in a model of `s`: its recipe, or its
    function of each layer's path."""
    if isinstance(row.recipe, LastBlock):
        return row.recipe.for_depth(s.depth)
    return row.recipe


def layers(tree: Any, kind: type) -> list[Any]:
    """The nodes of `tree` of type `kind` (`eqx.nn.Linear`, whether or not inside a
    `QuantizedLinear`; `eqxrules.QuantizedLinear`), in the order of its leaves."""
    found = jax.tree_util.tree_leaves(tree, is_leaf=lambda n: isinstance(n, kind))
    return [n for n in found if isinstance(n, kind)]


# Training.


def loss_fn(model: eqxrules.Keyed, batch: Array, key: PRNGKeyArray) -> Array:
    """Mean next-byte cross-entropy over `batch` `[B, T + 1]`, in nats. One key for
    the whole batch: a layer's products run on the batch, as one matrix product."""
    logits = jax.vmap(lambda t: model(t, key=key), axis_name=BATCH)(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@eqx.filter_jit
def step(model, state, batch, key, optim):
    """One optimiser step: the new model and state, the loss, and the norm of
    each linear layer's weight gradient (to show that every one gets one)."""
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch, key)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, state = optim.update(grads, state, params)
    norms = jnp.stack([jnp.linalg.norm(g.weight) for g in layers(grads, eqx.nn.Linear)])
    return eqx.apply_updates(model, updates), state, loss, norms


evaluate = eqx.filter_jit(loss_fn)


def optimiser(s: Settings) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, s.learning_rate, s.warmup, s.steps, end_value=s.learning_rate / 10
    )
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))


def train(row: Row, s: Settings, data: tuple, *, seed: int) -> dict:
    """Train `row`'s model from seed `seed`: `{"validation", "losses",
    "gradients", "seconds", "model"}`: the validation loss, the training loss of
    each step, the norm of each linear layer's weight gradient at the first."""
    start = time.perf_counter()
    train_bytes, validation = data
    model = build(row, s, seed)
    optim = optimiser(s)
    state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    rng = np.random.default_rng(seed)  # the same batches for every row
    keys = jax.random.split(jax.random.key(1000 + seed), s.steps + 1)
    losses, gradients = [], []
    for i in range(s.steps):
        starts = rng.integers(0, len(train_bytes) - s.context - 1, s.batch)
        batch = windows(train_bytes, starts, s.context + 1)
        model, state, loss, norms = step(model, state, batch, keys[i], optim)
        losses.append(float(loss))
        if i == 0:
            gradients = [float(g) for g in norms]
    loss = float(evaluate(model, validation, keys[-1]))
    seconds = time.perf_counter() - start
    print(
        f"{row.name:26s} seed {seed}: train loss {losses[0]:.3f} -> "
        f"{np.mean(losses[-10:]):.3f}, validation {loss:.4f} nats/char "
        f"({seconds:.0f} s)",
        flush=True,
    )
    return dict(
        validation=loss,
        losses=losses,
        gradients=gradients,
        seconds=seconds,
        model=model,
    )


def main(quick: bool = False) -> dict:
    """Train every row of `ROWS` from each seed and print a table of validation
    losses (the mean over the seeds, the lowest and highest, and the gap to
    float32's mean).

    **Returns:** `{row name: {"validation": one loss per seed, "seconds": per
    seed, and for the first seed "losses": the training loss per step,
    "gradients": the norm of each linear layer's weight gradient at the first
    step, "model": the trained model}}`, with `"seconds"`, `"settings"` and
    `"corpus"`.
    """
    start = time.perf_counter()
    s = QUICK if quick else FULL
    train_bytes, validation_bytes, about = corpus()
    data = (train_bytes, validation_set(validation_bytes, s))
    results: dict[str, Any] = {}
    for row in ROWS:
        runs = [train(row, s, data, seed=seed) for seed in s.seeds]
        results[row.name] = dict(
            validation=[r["validation"] for r in runs],
            losses=runs[0]["losses"],
            gradients=runs[0]["gradients"],
            seconds=[r["seconds"] for r in runs],
            model=runs[0]["model"],
        )
    reference = float(np.mean(results["float32"]["validation"]))
    print(
        f"\nvalidation loss, nats per character, mean over seeds {s.seeds} "
        "(lowest, highest):\n\n| recipe | validation loss | vs float32 | target |\n"
        "|---|---|---|---|"
    )
    for row in ROWS:
        losses = results[row.name]["validation"]
        gap = 100 * (np.mean(losses) / reference - 1)
        target = "—"
        if row.target is not None:  # a verdict on the full run's figures only
            target = f"within {row.target:g}%"
            if not quick:
                target += ": met" if gap <= row.target else ": missed"
        print(f"| {row.name} | {_cell(losses)} | {gap:+.2f}% | {target} |")
    results.update(
        seconds=time.perf_counter() - start,
        settings=dataclasses.asdict(s),
        corpus=about,
    )
    print(f"wall time {results['seconds']:.1f} s")
    return results


def _cell(losses: list[float]) -> str:
    spread = f" ({min(losses):.4f}, {max(losses):.4f})" if len(losses) > 1 else ""
    return f"{np.mean(losses):.4f}{spread}"


RECORD = pathlib.Path(__file__).with_suffix(".json")


def record(results: dict, load_before: float) -> dict:
    """The figures of a full run, as `lowp_training.json` keeps them: per row (in
    `ROWS` order) the recipe, the validation loss of each seed, their mean, lowest
    and highest, the gap of the mean to float32's in percent and its target, and
    the seconds of each seed's run (compilation included); the settings, the
    files, and the run's wall time, date, load average and versions."""
    reference = float(np.mean(results["float32"]["validation"]))
    rows = []
    for row in ROWS:
        r = results[row.name]
        mean = float(np.mean(r["validation"]))
        rows.append(
            dict(
                name=row.name,
                recipe=repr(row.recipe) if row.recipe is not None else None,
                attention=repr(row.attention) if row.attention is not None else None,
                validation=r["validation"],
                mean=mean,
                min=min(r["validation"]),
                max=max(r["validation"]),
                gap_percent=100 * (mean / reference - 1),
                target_percent=row.target,
                seconds=[round(t, 1) for t in r["seconds"]],
            )
        )
    return dict(
        command="python examples/lowp_training.py --record",
        date=datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"
        ),
        load_average=[round(load_before, 2), round(os.getloadavg()[0], 2)],
        cpus=os.cpu_count(),
        versions={
            "python": platform.python_version(),
            "jax": jax.__version__,
            "equinox": eqx.__version__,
            "optax": optax.__version__,
            "eqxrules": eqxrules.__version__,
        },
        seconds=round(results["seconds"], 1),
        settings=results["settings"],
        corpus=results["corpus"],
        rows=rows,
    )


if __name__ == "__main__":
    if "--record" in sys.argv:
        load_before = os.getloadavg()[0]
        figures = record(main(), load_before)
        RECORD.write_text(json.dumps(figures, indent=1) + "\n")
        print(f"wrote {RECORD}")
    else:
        main(quick="--quick" in sys.argv)
