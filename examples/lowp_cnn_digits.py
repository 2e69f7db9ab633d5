"""A small convolutional network trained in low precision: FP8, MXFP8 and NVFP4
recipes against float32, on scikit-learn's 8×8 digits.

The model (`CNN`): a 3×3 convolution from the image's one channel to 32 (`conv1`),
a 3×3 convolution of stride 2 from 32 channels to 32 (`conv2`, 8×8 to 4×4), a
linear layer from the 512 features to 32 (`hidden`) and a linear classifier to the
10 digits (`classifier`), with ReLUs between. A row's recipes enter through
`eqxrules.quantize(cnn, recipe=...)` with a function of each layer's path: every
convolution becomes a `QuantizedConv` and every linear layer a `QuantizedLinear`,
whose three products each (forward, input gradient, weight gradient) are quantised
as the layer's recipe says.

Block recipes need channel counts their blocks divide: MXFP8's blocks of 32 run
along a layer's input channels (forward product) and its output channels
(input-gradient product), NVFP4's blocks of 16 likewise (its weights in 16×16
blocks). Two layers of this network have a side no block divides: `conv1`'s one
input channel and the classifier's 10 outputs. So in every quantised row those
two layers take `recipes.fp8()` (E4M3 and E5M2 with one scale per tensor, no
blocks), and the row's recipe is that of `conv2` and `hidden`. A convolution
refuses a random Hadamard transform (its operands share no contracted dimension
to rotate along), so the nvfp4 row's `conv2` takes `nvfp4()` without it, while
`hidden` takes `nvfp4()` whole (stochastic rounding of gradients, a 16-point
Hadamard transform on its weight-gradient product). The printed table names each
layer's recipe.

Every row starts from the same initialisation and sees the same batches, per seed
(three seeds); the batch is mapped with `jax.vmap(..., axis_name="batch")` and
the layers are quantised with `axis_name="batch"`, so each quantised layer's
products run on the whole batch (one scale per tensor or per block over the batch),
and the model is wrapped in `eqxrules.Keyed`, which gives each quantised layer a
fresh key at every step (NVFP4's stochastic rounding draws from it). The split is
fixed: 75% of the digits for training, the rest for testing. Adam (learning rate
3e-3, cosine decay) for 15 epochs of batches of 64, chosen once for float32.

Run: `python examples/lowp_cnn_digits.py [--quick | --record]`. Needs the
`examples` extra (`optax`, `scikit-learn`). Full mode (4 rows × 3 seeds) takes
about 80 seconds on two CPU cores; `--quick` (one seed, 20 steps: it checks that
every row trains, not the figures) runs in the test suite. `--record` (full mode)
also writes the figures to `lowp_cnn_digits.json` beside this file: the README's
examples row is generated from it (`python scripts/update_readme.py`).
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
from jaxtyping import Array, Float, PRNGKeyArray
from sklearn.datasets import load_digits

import eqxrules
from eqxrules import recipes

# The layers no block divides (one input channel; ten outputs) take this recipe in
# every quantised row.
EDGE = recipes.fp8()
# `nvfp4()` for a convolution: without the random Hadamard transform it refuses.
NVFP4_CONV = dataclasses.replace(recipes.nvfp4(), hadamard=None)
LAYERS = ("conv1", "conv2", "hidden", "classifier")


@dataclasses.dataclass(frozen=True)
class Row:
    """One configuration: `per_layer` maps each layer's path (`LAYERS`) to its
    recipe; `None` leaves the whole model in float32."""

    name: str
    per_layer: dict[str, recipes.Recipe] | None = None

    def recipe(self, path: str) -> recipes.Recipe | None:
        """The recipe `quantize` gives the layer at `path`."""
        return None if self.per_layer is None else self.per_layer[path]


def blocked(recipe: recipes.Recipe, conv: recipes.Recipe | None = None) -> dict:
    """`recipe` for `hidden` (and for `conv2`, unless `conv` is given), `EDGE` for
    the first convolution and the classifier."""
    conv = recipe if conv is None else conv
    return dict(conv1=EDGE, conv2=conv, hidden=recipe, classifier=EDGE)


ROWS = [
    Row("float32"),
    Row("fp8", blocked(recipes.fp8())),
    Row("mxfp8", blocked(recipes.mxfp8())),
    Row("nvfp4", blocked(recipes.nvfp4(), conv=NVFP4_CONV)),
]


@dataclasses.dataclass(frozen=True)
class Settings:
    """The training: the same for every row."""

    epochs: int = 15
    batch: int = 64
    learning_rate: float = 3e-3
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int | None = None  # stop after this many steps (quick mode)


FULL = Settings()
QUICK = Settings(epochs=1, seeds=(0,), steps=20)


def load(seed: int = 0) -> tuple[tuple[Array, Array], tuple[Array, Array]]:
    """`((x_train, y_train), (x_test, y_test))`: images `[N, 1, 8, 8]` in [0, 1]
    and their digits, split 75/25 after a fixed shuffle."""
    data, target = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(data))
    x = jnp.asarray(data[order].reshape(-1, 1, 8, 8) / 16.0, jnp.float32)
    y = jnp.asarray(target[order], jnp.int32)
    n_train = int(0.75 * len(x))
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


class CNN(eqx.Module):
    """One image `[1, 8, 8]` in, the ten digits' logits out."""

    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    hidden: eqx.nn.Linear
    classifier: eqx.nn.Linear

    def __init__(self, *, key: PRNGKeyArray):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.conv1 = eqx.nn.Conv2d(1, 32, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(32, 32, 3, stride=2, padding=1, key=k2)
        self.hidden = eqx.nn.Linear(32 * 4 * 4, 32, key=k3)
        self.classifier = eqx.nn.Linear(32, 10, key=k4)

    def __call__(self, x: Float[Array, "1 8 8"]) -> Float[Array, " 10"]:
        x = jax.nn.relu(self.conv1(x))
        x = jax.nn.relu(self.conv2(x))
        return self.classifier(jax.nn.relu(self.hidden(jnp.ravel(x))))


def build(row: Row, seed: int) -> eqxrules.Keyed:
    """The row's model from seed `seed`, wrapped in `Keyed` (which gives each
    quantised layer its own key at every call; the float32 model has none)."""
    model = CNN(key=jax.random.key(seed))
    if row.per_layer is not None:
        # Each layer's products span the batch that `loss_fn` maps (its name).
        model = eqxrules.quantize(model, recipe=row.recipe, axis_name="batch")
    return eqxrules.Keyed(model)


def weights(tree: Any) -> list[Array]:
    """The weight of each layer of a `CNN` (or of its gradients), in `LAYERS`
    order, inside a `Keyed` and a `QuantizedConv`/`QuantizedLinear` or not."""
    model = tree.model
    out = []
    for name in LAYERS:
        layer = getattr(model, name)
        layer = getattr(layer, "conv", getattr(layer, "linear", layer))
        out.append(layer.weight)
    return out


def loss_fn(model: eqxrules.Keyed, x: Array, y: Array, key: PRNGKeyArray) -> Array:
    """Mean cross-entropy over the batch. The layers' `axis_name` names this `vmap`,
    so each layer's products run on the batch, as one product, with one key."""
    logits = jax.vmap(lambda image: model(image, key=key), axis_name="batch")(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@eqx.filter_jit
def step(model, state, x, y, key, optim):
    """One optimiser step: the new model and state, the loss, and the norm of
    each layer's weight gradient (to show that every one gets one)."""
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y, key)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, state = optim.update(grads, state, params)
    norms = jnp.stack([jnp.linalg.norm(g) for g in weights(grads)])
    return eqx.apply_updates(model, updates), state, loss, norms


@eqx.filter_jit
def accuracy(model: eqxrules.Keyed, x: Array, y: Array, key: PRNGKeyArray) -> Array:
    logits = jax.vmap(lambda image: model(image, key=key), axis_name="batch")(x)
    return jnp.mean(jnp.argmax(logits, axis=-1) == y)


def train(row: Row, s: Settings, data: tuple, *, seed: int) -> dict:
    """Train `row`'s model from seed `seed`: `{"accuracy", "losses", "gradients",
    "seconds", "model"}`: the test accuracy, the training loss of each step, the
    norm of each layer's weight gradient at the first step."""
    start = time.perf_counter()
    (x_train, y_train), (x_test, y_test) = data
    per_epoch = len(x_train) // s.batch
    n_steps = s.epochs * per_epoch if s.steps is None else s.steps
    optim = optax.adam(optax.cosine_decay_schedule(s.learning_rate, n_steps))
    model = build(row, seed)
    state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    rng = np.random.default_rng(seed)  # the same batches for every row
    keys = jax.random.split(jax.random.key(1000 + seed), n_steps + 1)
    losses: list[float] = []
    gradients: list[float] = []
    for i in range(n_steps):
        if i % per_epoch == 0:
            order = rng.permutation(len(x_train))
        idx = order[(i % per_epoch) * s.batch : (i % per_epoch + 1) * s.batch]
        model, state, loss, norms = step(
            model, state, x_train[idx], y_train[idx], keys[i], optim
        )
        losses.append(float(loss))
        if i == 0:
            gradients = [float(g) for g in norms]
    acc = float(accuracy(model, x_test, y_test, keys[-1]))
    seconds = time.perf_counter() - start
    print(
        f"{row.name:8s} seed {seed}: train loss {losses[0]:.3f} -> "
        f"{np.mean(losses[-per_epoch:]):.3f}, test accuracy {acc:.1%} "
        f"({seconds:.0f} s)",
        flush=True,
    )
    return dict(
        accuracy=acc, losses=losses, gradients=gradients, seconds=seconds, model=model
    )


def recipe_name(recipe: recipes.Recipe | None) -> str:
    """A short name for the recipes of `ROWS`, for the table."""
    known = {
        "float32": None,
        "fp8": recipes.fp8(),
        "mxfp8": recipes.mxfp8(),
        "nvfp4": recipes.nvfp4(),
        "nvfp4 without RHT": NVFP4_CONV,
    }
    return next((name for name, r in known.items() if r == recipe), repr(recipe))


def main(quick: bool = False) -> dict:
    """Train every row of `ROWS` from each seed and print a table of test
    accuracies (the mean over the seeds, the lowest and highest) with each
    layer's recipe.

    **Returns:** `{row name: {"accuracies": one per seed, "seconds": per seed,
    and for the first seed "losses": the training loss per step, "gradients":
    the norm of each layer's weight gradient at the first step (in `LAYERS`
    order), "model": the trained model}}`, with `"seconds"` and `"settings"`.
    """
    start = time.perf_counter()
    s = QUICK if quick else FULL
    data = load()
    results: dict[str, Any] = {}
    for row in ROWS:
        runs = [train(row, s, data, seed=seed) for seed in s.seeds]
        results[row.name] = dict(
            accuracies=[r["accuracy"] for r in runs],
            seconds=[r["seconds"] for r in runs],
            losses=runs[0]["losses"],
            gradients=runs[0]["gradients"],
            model=runs[0]["model"],
        )
    print(
        f"\ntest accuracy, mean over seeds {s.seeds} (lowest, highest):\n\n"
        f"| row | {' | '.join(LAYERS)} | test accuracy |\n"
        f"|---|{'---|' * len(LAYERS)}---|"
    )
    for row in ROWS:
        names = " | ".join(recipe_name(row.recipe(path)) for path in LAYERS)
        print(f"| {row.name} | {names} | {_cell(results[row.name]['accuracies'])} |")
    results.update(seconds=time.perf_counter() - start, settings=dataclasses.asdict(s))
    print(f"wall time {results['seconds']:.1f} s")
    return results


def _cell(accs: list[float]) -> str:
    spread = f" ({min(accs):.1%}, {max(accs):.1%})" if len(accs) > 1 else ""
    return f"{np.mean(accs):.1%}{spread}"


RECORD = pathlib.Path(__file__).with_suffix(".json")


def record(results: dict, load_before: float) -> dict:
    """The figures of a full run, as `lowp_cnn_digits.json` keeps them: per row (in
    `ROWS` order) each layer's recipe, the test accuracy of each seed, their mean,
    lowest and highest, and the seconds of each seed's run (compilation
    included); the settings, and the run's wall time, date, load average and
    versions."""
    rows = []
    for row in ROWS:
        accs = results[row.name]["accuracies"]
        rows.append(
            dict(
                name=row.name,
                recipes={path: recipe_name(row.recipe(path)) for path in LAYERS},
                accuracies=accs,
                mean=float(np.mean(accs)),
                min=min(accs),
                max=max(accs),
                seconds=[round(t, 1) for t in results[row.name]["seconds"]],
            )
        )
    return dict(
        command="python examples/lowp_cnn_digits.py --record",
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
