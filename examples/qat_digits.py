"""Quantisation-aware training on scikit-learn's 8×8 digits: learned step sizes (LSQ,
PACT) against fixed-range quantisation, at 4 and 2 bits.

One MLP (64 → 32 → 32 → 10, ReLU: narrow, so that the bits matter), trained with
Adam for 30 epochs from the same initialisations in every row (three seeds; the
table shows the mean test accuracy and the spread). A quantised row wraps each
`Linear` with `eqxrules.quantize`: the weight and the layer's input go through the
row's quantisers. For the learned ones, `quantize` fits each layer's weight step
to its own weights (per output channel: `axis=0`), `eqxrules.calibrate` fits each
input step (or PACT's `alpha`) to a training batch, and from then on the steps
are ordinary leaves of the model, trained by optax with the weights. The
fixed-range rows use `SteQuantize` on [-1, 1] for weights and [0, 1] for inputs
(pixels and ReLU outputs).

The float-format rows (issue 14) use `MXQuantize` (blocks of 32, one power-of-two
scale each: MXFP8 is e4m3 elements, MXFP4 e2m1) and `NVFP4Quantize` (blocks of 16,
e4m3 scales) with their blocks along each layer's reduction dimension, 64 for the
first layer and 32 for the others, so every block size divides; the last layer's
10 outputs are not blocked. Beside the QAT figure (trained with the quantisers
from the same initialisations) they show post-training quantisation: the float32
row's trained model, per seed, quantised and evaluated without further training.

Each row is one declarative `Row`: a name and the two quantisers. Adding a
quantiser to the comparison is one line in `ROWS`.

Run: `python examples/qat_digits.py [--quick | --record]`. Needs the `examples` extra
(`optax`, `scikit-learn`). `--record` (full mode) also writes the figures, with when
and where they were measured, to `qat_digits.json` beside this file: the README's
tables are generated from it (`python scripts/update_readme.py`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array
from sklearn.datasets import load_digits

import eqxrules


@dataclasses.dataclass(frozen=True)
class Row:
    """One configuration: `quantize(model, kernel_quantizer=weights,
    input_quantizer=inputs)`, or the float model if both are `None`."""

    name: str
    weights: Any = None
    inputs: Any = None
    ptq: bool = False  # also report the trained float32 model quantised as is


def lsq_weights(bits: int) -> eqxrules.LSQ:
    # The step given is a placeholder: `quantize` fits one per output channel.
    return eqxrules.LSQ(1.0, bits=bits, axis=0)


def lsq_inputs(bits: int) -> eqxrules.LSQ:
    # Inputs are pixels in [0, 1] and ReLU outputs: unsigned levels.
    return eqxrules.LSQ(1.0, bits=bits, signed=False)


def fixed(bits: int, lo: float, hi: float) -> eqxrules.SteQuantize:
    return eqxrules.SteQuantize(bits=bits, lo=lo, hi=hi)


def mx(element_format: str) -> eqxrules.MXQuantize:
    # Blocks of 32 along each layer's reduction dimension (64, 32, 32 here).
    return eqxrules.MXQuantize(format=element_format, block_size=32)


ROWS = [
    Row("float32"),
    Row("LSQ W4A4", lsq_weights(4), lsq_inputs(4)),
    Row("LSQ W2A2", lsq_weights(2), lsq_inputs(2)),
    Row("fixed-range SteQuantize W4A4", fixed(4, -1.0, 1.0), fixed(4, 0.0, 1.0)),
    Row("fixed-range SteQuantize W2A2", fixed(2, -1.0, 1.0), fixed(2, 0.0, 1.0)),
    Row("LSQ W2 + PACT A2", lsq_weights(2), eqxrules.PACT(1.0, bits=2)),
    Row("MXFP8 W8A8", mx("e4m3"), mx("e4m3"), ptq=True),
    Row("MXFP4 W4 + MXFP8 A8", mx("e2m1"), mx("e4m3"), ptq=True),
    Row("NVFP4 W4", eqxrules.NVFP4Quantize(), None, ptq=True),
]


def load(seed: int = 0):
    data, target = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(data))
    x = jnp.asarray(data[order] / 16.0, jnp.float32)
    y = jnp.asarray(target[order], jnp.int32)
    n_train = int(0.75 * len(x))
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def build(row: Row, width: int, x_calibration: Array, seed: int) -> Any:
    return quantized(
        row, eqx.nn.MLP(64, 10, width, 2, key=jax.random.key(seed)), x_calibration
    )


def quantized(row: Row, model: Any, x_calibration: Array) -> Any:
    """`model` with `row`'s quantisers (as is for the float row)."""
    if row.weights is None and row.inputs is None:
        return model
    model = eqxrules.quantize(
        model, kernel_quantizer=row.weights, input_quantizer=row.inputs
    )
    return eqxrules.calibrate(model, x_calibration)


def first_step(model: Any) -> float | None:
    """The first layer's learned input step (or PACT's alpha), if it has one."""
    q = getattr(model.layers[0], "input_quantizer", None)
    value = getattr(q, "step", getattr(q, "alpha", None))
    return None if not eqx.is_array(value) else float(value)


def loss_fn(model: Any, x: Array, y: Array) -> Array:
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@eqx.filter_jit
def accuracy(model: Any, x: Array, y: Array) -> Array:
    return jnp.mean(jnp.argmax(jax.vmap(model)(x), axis=-1) == y)


@eqx.filter_jit
def step(model: Any, state: Any, x: Array, y: Array, optim: Any):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, state = optim.update(grads, state, params)
    return eqx.apply_updates(model, updates), state, loss


def train(row: Row, data, optim, *, seed: int, epochs: int, width: int, batch: int):
    """Train `row`'s model from seed `seed`: `{"accuracy", "losses",
    "step_trajectory"}`."""
    (x_train, y_train), (x_test, y_test) = data
    model = build(row, width, x_train[:256], seed)
    state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    rng = np.random.default_rng(seed + 1)
    trajectory = [first_step(model)]
    losses: list[float] = []
    acc = 0.0
    for epoch in range(1, epochs + 1):
        order = rng.permutation(len(x_train))
        total = 0.0
        for i in range(len(x_train) // batch):
            idx = order[i * batch : (i + 1) * batch]
            model, state, loss = step(model, state, x_train[idx], y_train[idx], optim)
            total += float(loss)
        losses.append(total / (len(x_train) // batch))
        acc = float(accuracy(model, x_test, y_test))
        trajectory.append(first_step(model))
        learned = "" if trajectory[-1] is None else f", input step {trajectory[-1]:.4f}"
        print(
            f"{row.name:30s} seed {seed} epoch {epoch:2d}/{epochs}: loss "
            f"{losses[-1]:.4f}, test {acc:6.1%}{learned}",
            flush=True,
        )
    return dict(accuracy=acc, losses=losses, step_trajectory=trajectory, model=model)


def main(quick: bool = False) -> dict:
    """Train every row of `ROWS` from each seed and print a table of test
    accuracies (the mean over the seeds, and the lowest and highest).

    **Returns:** `{row name: {"accuracy": mean test accuracy, "accuracies": one
    per seed, and, for the first seed, "losses": mean training loss per epoch,
    "step_trajectory": the first layer's input step at the start and after each
    epoch (None for a fixed quantiser)}}`, and `"seconds"`.
    """
    start = time.perf_counter()
    epochs, width, batch = (2, 32, 128) if quick else (30, 32, 32)
    seeds = (0,) if quick else (0, 1, 2)
    data = load()
    if quick:  # two batches an epoch: quick mode checks that every row runs
        (x_train, y_train), test = data
        data = (x_train[: 2 * batch], y_train[: 2 * batch]), test
    n_steps = epochs * (len(data[0][0]) // batch)
    optim = optax.adam(optax.cosine_decay_schedule(2e-3, n_steps))
    (x_train, _), (x_test, y_test) = data
    results: dict[str, Any] = {}
    float_models: list[Any] = []  # the float32 row's trained model, per seed
    for row in ROWS:
        runs = [
            train(row, data, optim, seed=s, epochs=epochs, width=width, batch=batch)
            for s in seeds
        ]
        if row.weights is None and row.inputs is None:
            float_models = [r["model"] for r in runs]
        accs = [r["accuracy"] for r in runs]
        results[row.name] = dict(
            {k: v for k, v in runs[0].items() if k != "model"},
            accuracy=float(np.mean(accs)),
            accuracies=accs,
        )
        if row.ptq:  # post-training: the float model, quantised, no training
            ptq = [
                float(accuracy(quantized(row, m, x_train[:256]), x_test, y_test))
                for m in float_models
            ]
            results[row.name].update(ptq_accuracy=float(np.mean(ptq)), ptq=ptq)
    print(
        f"\ntest accuracy, mean over seeds {seeds} (lowest, highest):\n\n"
        "| configuration | post-training | trained (QAT) |\n|---|---|---|"
    )
    for row in ROWS:
        r = results[row.name]
        post = _cell(r["ptq"]) if row.ptq else "—"
        print(f"| {row.name} | {post} | {_cell(r['accuracies'])} |")
    results["seconds"] = time.perf_counter() - start
    print(f"wall time {results['seconds']:.1f} s")
    return results


def _cell(accs: list[float]) -> str:
    spread = f" ({min(accs):.1%}, {max(accs):.1%})" if len(accs) > 1 else ""
    return f"{np.mean(accs):.1%}{spread}"


RECORD = pathlib.Path(__file__).with_suffix(".json")


def record(results: dict, load_before: float) -> dict:
    """The figures of a full run, as `qat_digits.json` keeps them: per row (in
    `ROWS` order) the test accuracy of each seed, trained and, for a `ptq` row,
    post-training; and the run's wall time (compilation included), date, load
    average and versions."""
    return dict(
        command="python examples/qat_digits.py --record",
        date=datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"
        ),
        load_average=[round(load_before, 2), round(os.getloadavg()[0], 2)],
        versions={
            "jax": jax.__version__,
            "equinox": eqx.__version__,
            "optax": optax.__version__,
            "eqxrules": eqxrules.__version__,
        },
        seconds=round(results["seconds"], 1),
        rows=[
            dict(
                name=row.name,
                trained=results[row.name]["accuracies"],
                post_training=results[row.name].get("ptq"),
            )
            for row in ROWS
        ],
    )


if __name__ == "__main__":
    if "--record" in sys.argv:
        load_before = os.getloadavg()[0]
        figures = record(main(), load_before)
        RECORD.write_text(json.dumps(figures, indent=1) + "\n")
        print(f"wrote {RECORD}")
    else:
        main(quick="--quick" in sys.argv)
