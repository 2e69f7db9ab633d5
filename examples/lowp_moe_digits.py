r"""A small mixture-of-experts (MoE) layer trained in low precision: its experts'
products in FP8 and MXFP8 against float32, on scikit-learn's 8×8 digits, with
`eqxrules.quantized_ragged_dot`.

The model (`Model`): an MLP whose hidden layer is a MoE layer (`MoE`). Each image
is one token of 64 pixels. A float32 router (`eqx.nn.Linear`, 64 → 4 logits)
sends each token to its top 2 of 4 experts, with gates $g_{t,e} =
p_{t,e} / (p_{t,e_1} + p_{t,e_2})$, the softmax $p_t$ of its logits renormalised
over its two choices. Each expert is a feed-forward network, 64 → 128 (ReLU) →
64. The layer's output is $\sum_{e \in \text{top-2}(t)} g_{t,e}\,
\text{FFN}_e(x_t)$, and a float32 linear classifier maps it to the ten digits.

The experts run as two grouped products, `quantized_ragged_dot(rows, w, sizes,
recipe=...)` (`jax.lax.ragged_dot` in the float32 row): each token appears once per
chosen expert (2N rows for N tokens), the rows sorted by expert with
`jnp.argsort`, and `sizes` the number of rows of each expert, which routing
decides at run time (traced: one compiled step serves every split). Each grouped
product's three products (forward, input gradient, weight gradient) are quantised
as the row's recipe says, each expert's rows and weight a tensor of its own:
`fp8()` scales each expert's rows by their own amax; `mxfp8()` blocks them along
the features (32 at a time, which 64 and 128 divide), and the weight-gradient
product along each expert's own rows. The router and the classifier stay
in float32 (the router's logits decide the routing, and 10 outputs are no multiple
of MXFP8's blocks).

The loss is the cross-entropy plus `BALANCE` times the load-balancing loss of
Switch Transformer and GShard, $E \sum_e f_e P_e$ over the $E = 4$ experts: $f_e$
the share of the batch's 2N routing slots that go to expert $e$ (no gradient),
$P_e$ the mean router probability of $e$ (its gradient pushes the router towards
balance). It is 1 when the routing is uniform. The printed table gives each
expert's share of the test set's routing slots, from the trained model.

A MoE layer routes a batch of tokens, so it is written on the batch, with no
`vmap`: each expert's per-tensor scales (`fp8()`) and weight-gradient blocks span
the batch's tokens routed to it. Every row starts from the same initialisation and
sees the same batches, per seed (three seeds). The split is fixed: 75% of the
digits for training, the rest for testing. Adam (learning rate 3e-3, cosine
decay) for 30 epochs of batches of 64, chosen once for float32.

Run: `python examples/lowp_moe_digits.py [--quick | --record]`. Needs the
`examples` extra (`optax`, `scikit-learn`). Full mode (3 rows × 3 seeds) takes
about a minute and a half on two shared CPU cores; `--quick` (one seed, 20 steps: it checks that
every row trains, not the figures) runs in the test suite. `--record` (full mode)
also writes the figures to `lowp_moe_digits.json` beside this file: the README's
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
from jaxtyping import Array, Float, Int, PRNGKeyArray
from sklearn.datasets import load_digits

import eqxrules
from eqxrules import recipes

EXPERTS = 4
TOP_K = 2
# The load-balancing loss's weight (Switch Transformer's 1e-2).
BALANCE = 0.01
# The weights whose gradient norms `train` reports, in this order: the router, each
# expert's two matrices, the classifier.
WEIGHTS = (
    "router",
    *(f"w_in[{e}]" for e in range(EXPERTS)),
    *(f"w_out[{e}]" for e in range(EXPERTS)),
    "classifier",
)


@dataclasses.dataclass(frozen=True)
class Row:
    """One configuration: the recipe of the experts' products; `None` computes
    them in float32 (`jax.lax.ragged_dot`)."""

    name: str
    recipe: recipes.Recipe | None = None


ROWS = [Row("float32"), Row("fp8", recipes.fp8()), Row("mxfp8", recipes.mxfp8())]


@dataclasses.dataclass(frozen=True)
class Settings:
    """The training: the same for every row."""

    epochs: int = 30
    batch: int = 64
    learning_rate: float = 3e-3
    hidden: int = 128
    out: int = 64
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int | None = None  # stop after this many steps (quick mode)


FULL = Settings()
QUICK = Settings(epochs=1, seeds=(0,), steps=20)


def load(seed: int = 0) -> tuple[tuple[Array, Array], tuple[Array, Array]]:
    """`((x_train, y_train), (x_test, y_test))`: images `[N, 64]` in [0, 1] and
    their digits, split 75/25 after a fixed shuffle."""
    data, target = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(data))
    x = jnp.asarray(data[order] / 16.0, jnp.float32)
    y = jnp.asarray(target[order], jnp.int32)
    n_train = int(0.75 * len(x))
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def _uniform(key: PRNGKeyArray, shape: tuple[int, ...], fan_in: int) -> Array:
    """`eqx.nn.Linear`'s initialisation: uniform on ±1/√fan_in."""
    bound = 1 / np.sqrt(fan_in)
    return jax.random.uniform(key, shape, minval=-bound, maxval=bound)


def dispatch(experts: Int[Array, "n k"]) -> tuple[Array, Array]:
    """`(order, sizes)`: the routing slots (`experts` flattened, token by token)
    sorted by expert, as `ragged_dot` needs its rows, and the number of slots of
    each expert (traced)."""
    flat = experts.reshape(-1)
    return jnp.argsort(flat, stable=True), jnp.bincount(flat, length=EXPERTS)


def load_balance(probs: Float[Array, "n e"], sizes: Int[Array, " e"]) -> Array:
    r"""The load-balancing loss of Switch Transformer and GShard, $E \sum_e f_e
    P_e$: $f_e$ the share of the routing slots that go to expert $e$ (`sizes`,
    counted: no gradient), $P_e$ the mean router probability of $e$ (through which
    the loss reaches the router)."""
    f = sizes / (TOP_K * len(probs))
    return EXPERTS * jnp.sum(f * jnp.mean(probs, axis=0))


class MoE(eqx.Module):
    """A mixture-of-experts layer: top-`TOP_K` routing over `EXPERTS` experts, each
    a feed-forward network `d → hidden (ReLU) → out`, computed on a batch of
    tokens `[N, d]`."""

    router: eqx.nn.Linear
    w_in: Float[Array, "e d h"]
    b_in: Float[Array, "e h"]
    w_out: Float[Array, "e h o"]
    b_out: Float[Array, "e o"]
    recipe: recipes.Recipe | None

    def __init__(
        self,
        d: int,
        hidden: int,
        out: int,
        *,
        recipe: recipes.Recipe | None,
        key: PRNGKeyArray,
    ):
        kr, k1, k2, k3, k4 = jax.random.split(key, 5)
        self.router = eqx.nn.Linear(d, EXPERTS, key=kr)
        self.w_in = _uniform(k1, (EXPERTS, d, hidden), d)
        self.b_in = _uniform(k2, (EXPERTS, hidden), d)
        self.w_out = _uniform(k3, (EXPERTS, hidden, out), hidden)
        self.b_out = _uniform(k4, (EXPERTS, out), hidden)
        self.recipe = recipe

    def route(self, x: Float[Array, "n d"]) -> tuple[Array, Array, Array]:
        """`(probs [N, E], experts [N, k], gates [N, k])`: the router's softmax,
        each token's top-k experts, and their probabilities renormalised."""
        probs = jax.nn.softmax(jax.vmap(self.router)(x), axis=-1)
        top, experts = jax.lax.top_k(probs, TOP_K)
        return probs, experts, top / jnp.sum(top, axis=-1, keepdims=True)

    def grouped(self, rows: Array, w: Array, sizes: Array) -> Array:
        """`rows` (sorted by expert, `sizes` of each) times each expert's `w`:
        quantised as the recipe says, or in float32 without one."""
        if self.recipe is None:
            return jax.lax.ragged_dot(rows, w, sizes)
        return eqxrules.quantized_ragged_dot(rows, w, sizes, recipe=self.recipe)

    def __call__(self, x: Float[Array, "n d"]) -> tuple[Array, Array]:
        r"""`(y [N, out], balance)`: the layer's output, and the load-balancing loss
        $E \sum_e f_e P_e$ of the batch."""
        probs, experts, gates = self.route(x)
        order, sizes = dispatch(experts)
        token = order // TOP_K  # slot t·k + j is token t's j-th choice
        expert = experts.reshape(-1)[order]
        h = jax.nn.relu(self.grouped(x[token], self.w_in, sizes) + self.b_in[expert])
        y = self.grouped(h, self.w_out, sizes) + self.b_out[expert]
        # Back to token order, each token's slots weighted by their gates.
        slots = jnp.zeros_like(y).at[order].set(y).reshape(len(x), TOP_K, -1)
        out = jnp.sum(gates[..., None] * slots, axis=1)
        return out, load_balance(probs, sizes)


class Model(eqx.Module):
    """A batch of images `[N, 64]` in, `(logits [N, 10], balance)` out."""

    moe: MoE
    classifier: eqx.nn.Linear

    def __init__(
        self, s: Settings, recipe: recipes.Recipe | None, *, key: PRNGKeyArray
    ):
        k1, k2 = jax.random.split(key)
        self.moe = MoE(64, s.hidden, s.out, recipe=recipe, key=k1)
        self.classifier = eqx.nn.Linear(s.out, 10, key=k2)

    def __call__(self, x: Float[Array, "n 64"]) -> tuple[Array, Array]:
        y, balance = self.moe(x)
        return jax.vmap(self.classifier)(y), balance


def build(row: Row, s: Settings, seed: int) -> Model:
    """The row's model from seed `seed` (the same weights for every row)."""
    return Model(s, row.recipe, key=jax.random.key(seed))


def weights(tree: Model) -> list[Array]:
    """The weights of `WEIGHTS`, in order, of a `Model` (or of its gradients)."""
    moe = tree.moe
    return [
        moe.router.weight,
        *moe.w_in,
        *moe.w_out,
        tree.classifier.weight,
    ]


def loss_fn(model: Model, x: Array, y: Array) -> tuple[Array, Array]:
    """The mean cross-entropy plus `BALANCE` times the load-balancing loss; the
    cross-entropy alone as auxiliary output."""
    logits, balance = model(x)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return ce + BALANCE * balance, ce


@eqx.filter_jit
def step(model, state, x, y, optim):
    """One optimiser step: the new model and state, the cross-entropy, and the norm
    of each weight's gradient (`WEIGHTS`: each expert gets its own)."""
    (_, ce), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, x, y)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, state = optim.update(grads, state, params)
    norms = jnp.stack([jnp.linalg.norm(g) for g in weights(grads)])
    return eqx.apply_updates(model, updates), state, ce, norms


@eqx.filter_jit
def evaluate(model: Model, x: Array, y: Array) -> tuple[Array, Array]:
    """`(accuracy, counts)`: the test accuracy, and the number of routing slots
    of `x` that go to each expert."""
    logits, _ = model(x)
    _, experts, _ = model.moe.route(x)
    counts = jnp.bincount(experts.reshape(-1), length=EXPERTS)
    return jnp.mean(jnp.argmax(logits, axis=-1) == y), counts


def train(row: Row, s: Settings, data: tuple, *, seed: int) -> dict:
    """Train `row`'s model from seed `seed`: `{"accuracy", "loads", "losses",
    "gradients", "seconds", "model"}`: the test accuracy, each expert's share of
    the test set's routing slots, the cross-entropy of each step, the norm of each
    weight's gradient (`WEIGHTS`) at the first step."""
    start = time.perf_counter()
    (x_train, y_train), (x_test, y_test) = data
    per_epoch = len(x_train) // s.batch
    n_steps = s.epochs * per_epoch if s.steps is None else s.steps
    optim = optax.adam(optax.cosine_decay_schedule(s.learning_rate, n_steps))
    model = build(row, s, seed)
    state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    rng = np.random.default_rng(seed)  # the same batches for every row
    losses: list[float] = []
    gradients: list[float] = []
    for i in range(n_steps):
        if i % per_epoch == 0:
            order = rng.permutation(len(x_train))
        idx = order[(i % per_epoch) * s.batch : (i % per_epoch + 1) * s.batch]
        model, state, loss, norms = step(
            model, state, x_train[idx], y_train[idx], optim
        )
        losses.append(float(loss))
        if i == 0:
            gradients = [float(g) for g in norms]
    acc, counts = evaluate(model, x_test, y_test)
    seconds = time.perf_counter() - start
    loads = [int(c) / int(counts.sum()) for c in counts]
    print(
        f"{row.name:8s} seed {seed}: train loss {losses[0]:.3f} -> "
        f"{np.mean(losses[-per_epoch:]):.3f}, test accuracy {float(acc):.1%}, "
        f"expert loads {' '.join(f'{v:.0%}' for v in loads)} ({seconds:.0f} s)",
        flush=True,
    )
    return dict(
        accuracy=float(acc),
        loads=loads,
        losses=losses,
        gradients=gradients,
        seconds=seconds,
        model=model,
    )


def main(quick: bool = False) -> dict:
    """Train every row of `ROWS` from each seed and print a table of test
    accuracies (the mean over the seeds, the lowest and highest) and the experts'
    shares of the test set's routing slots (over every seed, lowest to highest).

    **Returns:** `{row name: {"accuracies": one per seed, "loads": each expert's
    share per seed, "seconds": per seed, and for the first seed "losses": the
    cross-entropy per step, "gradients": the norm of each weight's gradient at the
    first step (in `WEIGHTS` order), "model": the trained model}}`, with
    `"seconds"`, `"settings"` and `"test_images"` (their number).
    """
    start = time.perf_counter()
    s = QUICK if quick else FULL
    data = load()
    results: dict[str, Any] = {}
    for row in ROWS:
        runs = [train(row, s, data, seed=seed) for seed in s.seeds]
        results[row.name] = dict(
            accuracies=[r["accuracy"] for r in runs],
            loads=[r["loads"] for r in runs],
            seconds=[r["seconds"] for r in runs],
            losses=runs[0]["losses"],
            gradients=runs[0]["gradients"],
            model=runs[0]["model"],
        )
    print(
        f"\ntest accuracy, mean over seeds {s.seeds} (lowest, highest):\n\n"
        "| row | experts' products | test accuracy | expert loads |\n|---|---|---|---|"
    )
    for row in ROWS:
        r = results[row.name]
        print(
            f"| {row.name} | {recipe_name(row.recipe)} | {_cell(r['accuracies'])} | "
            f"{_loads(r['loads'])} |"
        )
    results.update(
        seconds=time.perf_counter() - start,
        settings=dataclasses.asdict(s),
        test_images=len(data[1][1]),
    )
    print(f"wall time {results['seconds']:.1f} s")
    return results


def recipe_name(recipe: recipes.Recipe | None) -> str:
    """A short name for the recipes of `ROWS`, for the table."""
    known = {"float32": None, "fp8()": recipes.fp8(), "mxfp8()": recipes.mxfp8()}
    return next((name for name, r in known.items() if r == recipe), repr(recipe))


def _cell(accs: list[float]) -> str:
    spread = f" ({min(accs):.1%}, {max(accs):.1%})" if len(accs) > 1 else ""
    return f"{np.mean(accs):.1%}{spread}"


def _loads(loads: list[list[float]]) -> str:
    shares = np.asarray(loads)
    return f"{shares.min():.0%} to {shares.max():.0%}"


RECORD = pathlib.Path(__file__).with_suffix(".json")


def record(results: dict, load_before: float) -> dict:
    """The figures of a full run, as `lowp_moe_digits.json` keeps them: per row (in
    `ROWS` order) the experts' recipe, the test accuracy of each seed, their mean,
    lowest and highest, each seed's expert loads, and the seconds of each seed's
    run (compilation included); the settings, the layer's shape, the number of
    test images, and the run's wall time, date, load average and versions."""
    rows = []
    for row in ROWS:
        r = results[row.name]
        accs = r["accuracies"]
        rows.append(
            dict(
                name=row.name,
                recipe=recipe_name(row.recipe),
                accuracies=accs,
                mean=float(np.mean(accs)),
                min=min(accs),
                max=max(accs),
                loads=r["loads"],
                seconds=[round(t, 1) for t in r["seconds"]],
            )
        )
    return dict(
        command="python examples/lowp_moe_digits.py --record",
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
        experts=EXPERTS,
        top_k=TOP_K,
        balance=BALANCE,
        test_images=results["test_images"],
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
