"""Performance figures for eqxrules (issue 6), written to `benchmarks/RESULTS.md`.

    python benchmarks/run.py [--quick] [--json] [--suite] [--only SECTIONS]
                             [--rules NAMES] [--out PATH]

Sections (all by default, `suite` only with `--suite`):

- `overhead`: every catalogue rule inside a jitted forward+backward (a binarised or
  quantised MLP, a small CNN through `Quantized`, a two-head net for the rules whose
  value is the identity, `ScaledModel` around an MLP, and a batch of the rule's own
  examples for the rest), against a plain `jax.custom_jvp`/`custom_vjp` with the
  rule's own maths, one written from the rule's reference functions, and the
  `stop_gradient` trick. XLA `cost_analysis()` flops and bytes and
  `memory_analysis()` temp bytes (deterministic), and wall time as the median of
  interleaved A/B pairs.
- `trick`: the binarised MLP against the `stop_gradient` trick: flops, wall time and
  how much of the gradient the trick changes.
- `residuals`: bytes saved for the backward pass per activation element, outside jit
  (`saved_residuals`) and inside it (`memory_analysis` of the jitted forward).
- `trace`: trace, lowering and compile time of a 64-layer binarised net.
- `checker`: `check_rule` against `jax.test_util.check_grads` on a ~1M-parameter MLP,
  each timed in fresh processes (cold) and on repeated calls (warm).
- `throughput`: a binarised-MLP training step in examples/s, against the
  memory-bandwidth floor (bytes XLA moves over the measured copy bandwidth).
- `suite`: wall time of `python -m pytest` and of `python -m eqxrules`.

Nothing needs a GPU: on any device the script records `device_kind` and runs the
same measurements.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import difflib
import functools as ft
import json
import math
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

try:
    import eqxrules
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    import eqxrules

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = "python benchmarks/run.py"
_sg = jax.lax.stop_gradient


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Problem sizes. `FULL` is the issue's configuration; `QUICK` is for developing."""

    width: int  # hidden width of the binarised MLP
    depth: int  # hidden layers of the binarised MLP
    batch: int
    cnn_batch: int
    deep_layers: int  # the trace/compile net
    deep_width: int
    deep_batch: int
    checker_width: int  # the checker's MLP (about 1M parameters at 512)
    checker_depth: int
    checker_in: int
    checker_batch: int
    pairs: int  # interleaved A/B pairs for wall time
    trace_pairs: int
    checker_pairs: int  # fresh-process pairs for the checker
    checker_warm: int  # warm calls per process
    seeds: int  # seeds for the gradient difference
    target_s: float  # wall time of one timed measurement
    copy_mib: int
    train_steps: int


FULL = Sizes(
    width=512,
    depth=8,
    batch=1024,
    cnn_batch=256,
    deep_layers=64,
    deep_width=256,
    deep_batch=64,
    checker_width=512,
    checker_depth=4,
    checker_in=384,
    checker_batch=32,
    pairs=9,
    trace_pairs=11,
    checker_pairs=3,
    checker_warm=3,
    seeds=5,
    target_s=0.2,
    copy_mib=256,
    train_steps=20,
)
QUICK = Sizes(
    width=64,
    depth=3,
    batch=128,
    cnn_batch=16,
    deep_layers=64,
    deep_width=32,
    deep_batch=8,
    checker_width=128,
    checker_depth=3,
    checker_in=64,
    checker_batch=8,
    pairs=3,
    trace_pairs=2,
    checker_pairs=1,
    checker_warm=2,
    seeds=2,
    target_s=0.02,
    copy_mib=16,
    train_steps=5,
)

SECTIONS = ("overhead", "trick", "residuals", "trace", "checker", "throughput")
VARIANTS = ("eqxrules", "hand", "hand_ref", "trick")
VARIANT_NAMES = {
    "eqxrules": "eqxrules",
    "hand": "hand-written, same maths",
    "hand_ref": "hand-written from the references",
    "trick": "stop_gradient trick",
    "quantized_hand": "`Quantized` + hand-written rule",
}


# ---------------------------------------------------------------------------
# Measuring


def xla_figures(fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """Compile `jax.jit(fn)` for `args`: XLA's own flops, bytes accessed and temp
    bytes, and the compiled executable."""
    compiled = jax.jit(fn).lower(*args).compile()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    memory = compiled.memory_analysis()
    return dict(
        flops=float(cost.get("flops", float("nan"))),
        bytes=float(cost.get("bytes accessed", float("nan"))),
        temp=int(memory.temp_size_in_bytes),
        compiled=compiled,
    )


def _time(fn: Callable[..., Any], args: tuple[Any, ...], reps: int) -> float:
    start = time.perf_counter()
    out = None
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps


def interleaved(
    fa: Callable[..., Any],
    fb: Callable[..., Any],
    args: tuple[Any, ...],
    pairs: int,
    target_s: float,
) -> dict[str, float]:
    """Wall time of `fa` over `fb` as the median of `pairs` interleaved A/B pairs
    (the order alternates, so drifting machine load hits both alike)."""
    jax.block_until_ready(fa(*args))
    jax.block_until_ready(fb(*args))
    single = min(_time(fa, args, 1), _time(fb, args, 1))
    reps = max(1, math.ceil(target_s / max(single, 1e-6)))
    ratios, ta, tb = [], [], []
    for i in range(pairs):
        if i % 2 == 0:
            a, b = _time(fa, args, reps), _time(fb, args, reps)
        else:
            b, a = _time(fb, args, reps), _time(fa, args, reps)
        ratios.append(a / b)
        ta.append(a)
        tb.append(b)
    return dict(
        median=statistics.median(ratios),
        min=min(ratios),
        max=max(ratios),
        a_s=statistics.median(ta),
        b_s=statistics.median(tb),
        pairs=pairs,
        reps=reps,
    )


def _nbytes(tree: Any) -> int:
    return sum(
        int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
        for x in jtu.tree_leaves(tree)
    )


def _saved_residuals(f: Callable[..., Any], *args: Any) -> list[tuple[Any, str]]:
    # Public as `jax.ad_checkpoint.saved_residuals` in older JAX; only its printing
    # twin is public in JAX 0.10.
    try:
        from jax.ad_checkpoint import saved_residuals  # type: ignore[attr-defined]
    except ImportError:
        from jax._src.ad_checkpoint import saved_residuals
    return saved_residuals(f, *args)


def _hlo_ops(compiled: Any) -> dict[str, int]:
    """Opcode counts of an optimised HLO module, fusions' insides included."""
    counts: dict[str, int] = {}
    for line in compiled.as_text().splitlines():
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = [^ ]+ ([a-z\-]+)\(", line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def normalised_hlo(text: str) -> list[str]:
    """The instructions of an HLO module, with numbering and source locations
    dropped, so that two modules computing the same thing compare equal."""
    out = []
    for line in text.splitlines():
        if " = " not in line or line.lstrip().startswith("HloModule"):
            continue
        line = re.sub(r", metadata=\{[^}]*\}", "", line)
        line = re.sub(r"\.\d+\b", "", line)
        out.append(line.strip())
    return out


def same_program(a: Any, b: Any) -> bool:
    """Whether two compiled modules hold the same instructions on the same shapes,
    whatever their names and order (the order is the schedule, which can change the
    temp bytes)."""

    def strip(text: str) -> collections.Counter:
        return collections.Counter(
            re.sub(r"%[\w.\-]+", "%", line) for line in normalised_hlo(text)
        )

    return strip(a.as_text()) == strip(b.as_text())


def hlo_diff(a: Any, b: Any, limit: int = 12) -> str:
    """A short account of how two compiled modules differ: opcode counts, then the
    first lines of a unified diff (names normalised)."""
    ca, cb = _hlo_ops(a), _hlo_ops(b)
    ops = sorted(
        f"{k}: {ca.get(k, 0)} vs {cb.get(k, 0)}"
        for k in set(ca) | set(cb)
        if ca.get(k, 0) != cb.get(k, 0)
    )

    diff = list(
        difflib.unified_diff(
            normalised_hlo(a.as_text()),
            normalised_hlo(b.as_text()),
            lineterm="",
            n=0,
        )
    )[2 : 2 + limit]
    return (
        "opcode counts (eqxrules vs baseline): "
        + ("; ".join(ops) or "identical")
        + ("\n" + "\n".join(diff) if diff else "")
    )


# ---------------------------------------------------------------------------
# The baselines, built generically from a rule


def _instantiate(t: Any, like: Any) -> Any:
    """A JVP rule's tangent with `None` (symbolic zero) made explicit zeros, as a
    plain `jax.custom_jvp` rule must return."""
    if t is None:
        return jtu.tree_map(jnp.zeros_like, like)
    return jtu.tree_map(
        lambda t, o: jnp.zeros_like(o) if t is None else t,
        t,
        like,
        is_leaf=lambda v: v is None,
    )


def build_variants(rule: Any, kwargs: dict[str, Any]) -> dict[str, Callable]:
    """`{variant: fn(dyn, x)}` for one rule instance, where `dyn` holds the rule's
    floating-point arrays (a wrapped sub-model's parameters, say):

    - `eqxrules`: the rule as shipped, `rule(x)`;
    - `hand`: a plain `jax.custom_jvp` (or `custom_vjp`) calling the rule's own
      `primal` and `tangent` (`fwd`/`bwd`): what the mechanism must cost no more than;
    - `hand_ref`: a plain `jax.custom_jvp` whose value is `reference_forward` and whose
      tangent is `jax.jvp` of `reference_derivative` (or a `custom_vjp` calling
      `reference_vjp`): the rule written by hand from its independent references;
    - `trick`: `d + stop_gradient(f - d)` with `f = reference_forward` and
      `d = reference_derivative`, where the rule has a `reference_derivative`.
    """
    _, static = eqx.partition(rule, eqx.is_inexact_array)
    kw = dict(kwargs)

    def rebuild(dyn: Any) -> Any:
        return eqx.combine(dyn, static)

    def ours(dyn, x):
        return rebuild(dyn)(x, **kw)

    variants: dict[str, Callable] = {"eqxrules": ours}
    if isinstance(rule, eqxrules.JVPRule):
        variants["hand"] = _hand_jvp(rebuild, kw)
    else:
        variants["hand"] = _hand_vjp(rebuild, kw)
    has_derivative = (
        type(rule).reference_derivative is not eqxrules.Rule.reference_derivative
    )
    if has_derivative:
        variants["hand_ref"] = _ref_jvp(rebuild, kw)

        def trick(dyn, x):
            r = rebuild(dyn)
            d = r.reference_derivative(x, **kw)
            f = r.reference_forward(x, **kw)
            return jtu.tree_map(lambda d, f: d + _sg(f - d), d, f)

        variants["trick"] = trick
    else:
        variants["hand_ref"] = _ref_vjp(rebuild, kw)
    return variants


def _hand_jvp(rebuild: Callable, kw: dict[str, Any]) -> Callable:
    @jax.custom_jvp
    def f(dyn, x):
        return rebuild(dyn).primal(x, **kw)

    @f.defjvp
    def f_jvp(primals, tangents):
        dyn, x = primals
        t_dyn, t_x = tangents
        rule = rebuild(dyn)
        out = rule.primal(x, **kw)
        return out, _instantiate(rule.tangent((x,), (t_x,), t_dyn, out, **kw), out)

    return f


def _hand_vjp(rebuild: Callable, kw: dict[str, Any]) -> Callable:
    # Saves exactly what the rule's `fwd` returns, plus `x` only if its `bwd` reads
    # the arguments (as a careful hand-written `custom_vjp` would).
    shapes: dict[str, Any] = {}

    def make(lean: bool) -> Callable:
        @jax.custom_vjp
        def f(dyn, x):
            return rebuild(dyn).primal(x, **kw)

        def fwd(dyn, x):
            out, res = rebuild(dyn).fwd(x, **kw)
            shapes["x"] = jax.eval_shape(lambda: x)
            return out, (res, dyn, None if lean else x)

        def bwd(saved, ct):
            res, dyn, x = saved
            (ct_x,) = rebuild(dyn).bwd(res, ct, (x,), **kw)
            if ct_x is None:
                ct_x = jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["x"])
            return jtu.tree_map(jnp.zeros_like, dyn), ct_x

        f.defvjp(fwd, bwd)
        return f

    lean, full = make(True), make(False)

    def f(dyn, x):
        try:
            jax.eval_shape(jax.grad(lambda x: _total(lean(dyn, x))), x)
        except Exception:
            return full(dyn, x)
        return lean(dyn, x)

    return f


def _ref_jvp(rebuild: Callable, kw: dict[str, Any]) -> Callable:
    @jax.custom_jvp
    def f(dyn, x):
        return rebuild(dyn).reference_forward(x, **kw)

    @f.defjvp
    def f_jvp(primals, tangents):
        dyn, x = primals
        out = rebuild(dyn).reference_forward(x, **kw)
        _, t = jax.jvp(
            lambda d, x: rebuild(d).reference_derivative(x, **kw), primals, tangents
        )
        return out, t

    return f


def _ref_vjp(rebuild: Callable, kw: dict[str, Any]) -> Callable:
    @jax.custom_vjp
    def f(dyn, x):
        return rebuild(dyn).reference_forward(x, **kw)

    def fwd(dyn, x):
        return rebuild(dyn).reference_forward(x, **kw), (dyn, x)

    def bwd(saved, ct):
        dyn, x = saved
        _, ct_x = rebuild(dyn).reference_vjp(ct, x, **kw)
        return jtu.tree_map(jnp.zeros_like, dyn), ct_x

    f.defvjp(fwd, bwd)
    return f


def _total(tree: Any) -> Any:
    return sum(
        jnp.sum(x.astype(jnp.float32))
        for x in jtu.tree_leaves(tree)
        if eqx.is_inexact_array(x)
    )


# ---------------------------------------------------------------------------
# Data and networks


@ft.cache
def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits (integer pixels 0..16), or random integer
    images of the same shape if scikit-learn is not installed."""
    try:
        from sklearn.datasets import load_digits

        d = load_digits()
        return d.data.astype(np.float32), d.target.astype(np.int32)
    except ImportError:
        rng = np.random.default_rng(0)
        return (
            rng.integers(0, 17, (1797, 64)).astype(np.float32),
            rng.integers(0, 10, 1797).astype(np.int32),
        )


def digits_batch(batch: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    x, y = _digits()
    idx = np.random.default_rng(seed).integers(0, len(x), batch)
    return jnp.asarray(x[idx]), jnp.asarray(y[idx])


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def _uniform_weights(dims: Sequence[int], seed: int) -> list:
    # Drawn with NumPy: eager `jax.random` would compile a program per shape.
    rng = np.random.default_rng(seed)
    return [
        jnp.asarray(rng.uniform(-1.0, 1.0, (a, b)).astype(np.float32) / math.sqrt(a))
        for a, b in zip(dims[:-1], dims[1:])
    ]


def mlp_weights(sizes: Sizes, seed: int = 0, width: int | None = None) -> list:
    width = width or sizes.width
    return _uniform_weights([64] + [width] * sizes.depth + [10], seed)


def binarised_mlp_loss(act: Callable[[jax.Array], jax.Array]) -> Callable:
    """A fully quantised MLP: `act` (the rule) on every weight and every hidden
    pre-activation, no biases; softmax cross-entropy."""

    def loss(ws, data):
        x, y = data
        h = x
        for w in ws[:-1]:
            h = act(h @ act(w))
        logits = h @ act(ws[-1]) / math.sqrt(ws[-1].shape[0])
        return _cross_entropy(logits, y)

    return loss


def twohead_params(sizes: Sizes, seed: int = 0) -> dict[str, Any]:
    w = sizes.width
    dims = dict(trunk1=(64, w), trunk2=(w, w), task=(w, 10), dom1=(w, w), dom2=(w, 2))
    rng = np.random.default_rng(seed)
    return {
        name: jnp.asarray(
            rng.standard_normal(shape).astype(np.float32) / math.sqrt(shape[0])
        )
        for name, shape in dims.items()
    }


def twohead_loss(shape: Callable[[jax.Array], jax.Array]) -> Callable:
    """A domain-adversarial net: a trunk, a task head, and a domain head behind
    `shape` (the rule: gradient reversal, scaling, clipping...)."""

    def loss(p, data):
        x, y, dom = data
        h = jnp.tanh(jnp.tanh((x / 16) @ p["trunk1"]) @ p["trunk2"])
        z = jnp.tanh(shape(h) @ p["dom1"]) @ p["dom2"]
        return _cross_entropy(h @ p["task"], y) + _cross_entropy(z, dom)

    return loss


def small_cnn(seed: int = 0) -> eqx.nn.Sequential:
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return eqx.nn.Sequential(
        [
            eqx.nn.Conv2d(1, 16, 3, padding=1, key=k1),
            eqx.nn.Conv2d(16, 32, 3, padding=1, key=k2),
            eqx.nn.Lambda(jnp.ravel),
            eqx.nn.Linear(32 * 8 * 8, 10, key=k3),
        ]
    )


def _plain_cnn_forward(cnn: Any, q: Callable, images: jax.Array) -> jax.Array:
    """The same CNN written with `lax.conv_general_dilated` on the whole batch and
    the quantiser `q` applied by hand: the hand-written counterpart of
    `quantize(cnn, kernel_quantizer=q, input_quantizer=q)`."""
    conv1, conv2, _, lin = cnn.layers
    # The input quantiser sees one example at a time, as under `jax.vmap(model)`:
    # for a rule that reduces over axes (or draws noise) that is the same maths.
    h = images[:, None]
    for conv in (conv1, conv2):
        h = (
            jax.lax.conv_general_dilated(
                jax.vmap(q)(h), q(conv.weight), (1, 1), ((1, 1), (1, 1))
            )
            + conv.bias[None]
        )
    h = h.reshape(h.shape[0], -1)
    return jax.vmap(q)(h) @ q(lin.weight).T + lin.bias


# ---------------------------------------------------------------------------
# Scenarios: how each catalogue rule is put inside a realistic forward+backward


@dataclasses.dataclass
class Case:
    """One rule example in one network: `losses[variant]` maps `(params, data)` to
    a scalar, differentiated with respect to `params`."""

    entry: str
    example: int
    rule: str  # repr-ish of the example
    scenario: str
    losses: dict[str, Callable]
    params: Any
    data: Any
    activation_elements: int
    notes: str = ""


def _rule_label(rule: Any) -> str:
    fields = []
    for f in dataclasses.fields(rule):
        v = getattr(rule, f.name)
        if isinstance(v, (int, float, str, bool)) or v is None:
            fields.append(f"{f.name}={v!r}")
        elif callable(v):
            fields.append(f"{f.name}={getattr(v, '__name__', type(v).__name__)}")
    return f"{type(rule).__name__}({', '.join(fields)})"


def classify(rule: Any, kw: dict[str, Any], width: int) -> str:
    """`"mlp"` if the rule maps a `(batch, width)` float array to one of the same
    shape and dtype (it can quantise weights and activations), `"twohead"` if it is
    moreover the identity in value (gradient shaping), else `"batched"`."""
    x = jnp.asarray(np.random.default_rng(5).standard_normal((16, width)), jnp.float32)
    try:
        out = jax.eval_shape(lambda x: rule(x, **kw), x)
    except Exception:
        return "batched"
    if not (
        isinstance(out, jax.ShapeDtypeStruct)
        and out.shape == x.shape
        and out.dtype == x.dtype
    ):
        return "batched"
    if bool(jnp.all(rule(x, **kw) == x)):
        return "twohead"
    return "mlp"


def cases_for(
    entry: Any, sizes: Sizes, examples: Sequence[int], cnn: bool = True
) -> list[Case]:
    out = []
    all_examples = entry.examples(jax.random.key(0))
    for i in examples:
        if i >= len(all_examples):
            continue
        rule = all_examples[i]
        kw = rule.call_kwargs(jax.random.key(1))
        dyn, _ = eqx.partition(rule, eqx.is_inexact_array)
        variants = build_variants(rule, kw)
        kind = classify(rule, kw, sizes.width)
        label = _rule_label(rule)
        if kind == "mlp":
            x, y = digits_batch(sizes.batch)
            n_act = sizes.batch * sizes.width * sizes.depth + sum(
                a * b for a, b in _mlp_dims(sizes)
            )
            out.append(
                Case(
                    entry.name,
                    i,
                    label,
                    f"binarised MLP {sizes.depth}x{sizes.width}, batch {sizes.batch}",
                    {
                        v: binarised_mlp_loss(ft.partial(fn, dyn))
                        for v, fn in variants.items()
                    },
                    mlp_weights(sizes),
                    (x, y),
                    n_act,
                )
            )
            if cnn:
                out.append(_cnn_case(entry.name, i, label, variants, dyn, sizes))
        elif kind == "twohead":
            x, y = digits_batch(sizes.batch)
            dom = (y % 2).astype(jnp.int32)
            out.append(
                Case(
                    entry.name,
                    i,
                    label,
                    f"two-head net, width {sizes.width}, batch {sizes.batch}",
                    {
                        v: twohead_loss(ft.partial(fn, dyn))
                        for v, fn in variants.items()
                    },
                    twohead_params(sizes),
                    (x, y, dom),
                    sizes.batch * sizes.width,
                )
            )
        else:
            out.append(_batched_case(entry, i, label, rule, kw, variants, sizes))
    return out


def _mlp_dims(sizes: Sizes) -> list[tuple[int, int]]:
    dims = [64] + [sizes.width] * sizes.depth + [10]
    return list(zip(dims[:-1], dims[1:]))


def _cnn_case(name, i, label, variants, dyn, sizes) -> Case:
    cnn = small_cnn()
    images, y = digits_batch(sizes.cnn_batch)
    images = images.reshape(-1, 8, 8) / 16

    def quantized_loss(fn):
        def loss(model, data):
            images, y = data
            logits = jax.vmap(model)(images[:, None])
            return _cross_entropy(logits, y)

        q = ft.partial(fn, dyn)
        return lambda params, data: loss(
            eqxrules.quantize(
                eqx.combine(params, cnn_static), kernel_quantizer=q, input_quantizer=q
            ),
            data,
        )

    def plain_loss(fn):
        q = ft.partial(fn, dyn)

        def loss(params, data):
            images, y = data
            model = eqx.combine(params, cnn_static)
            return _cross_entropy(_plain_cnn_forward(model, q, images), y)

        return loss

    cnn_params, cnn_static = eqx.partition(cnn, eqx.is_inexact_array)
    losses = {"eqxrules": quantized_loss(variants["eqxrules"])}
    for v, fn in variants.items():
        if v != "eqxrules":
            losses[v] = plain_loss(fn)
    losses["quantized_hand"] = quantized_loss(variants["hand"])
    n_act = sizes.cnn_batch * (64 + 16 * 64 + 32 * 64) + sum(
        x.size for x in jtu.tree_leaves(cnn_params) if x.ndim > 1
    )
    return Case(
        name,
        i,
        label,
        f"CNN via `quantize` (2 conv + linear, 8x8 digits), batch {sizes.cnn_batch}",
        losses,
        cnn_params,
        (images, y),
        n_act,
        notes="baselines use plain `lax.conv_general_dilated` layers",
    )


def _batched_case(entry, i, label, rule, kw, variants, sizes) -> Case:
    """The rule's own example (a wrapper around a small sub-model, a softmax over a
    small axis...) on a batch of inputs from its domain, differentiated with respect
    to the rule's arrays and the inputs."""
    dom = entry.domain
    xs = jax.random.uniform(
        jax.random.key(7), (sizes.batch, *dom.shape), minval=dom.low, maxval=dom.high
    )
    dyn, _ = eqx.partition(rule, eqx.is_inexact_array)
    shapes = jax.eval_shape(
        lambda d, xs: jax.vmap(lambda x: variants["eqxrules"](d, x))(xs), dyn, xs
    )
    cts = jtu.tree_map(
        lambda s: jax.random.normal(jax.random.key(8), s.shape, s.dtype), shapes
    )

    def make(fn):
        def loss(params, data):
            d, xs = params
            out = jax.vmap(lambda x: fn(d, x))(xs)
            return sum(
                jnp.sum(o * c)
                for o, c in zip(jtu.tree_leaves(out), jtu.tree_leaves(data))
            )

        return loss

    return Case(
        entry.name,
        i,
        label,
        f"the rule's example, vmapped over a batch of {sizes.batch}",
        {v: make(fn) for v, fn in variants.items()},
        (dyn, xs),
        cts,
        int(xs.size),
    )


def scaled_model_cases(sizes: Sizes) -> list[Case]:
    """`ScaledModel` around an MLP, trained: gradients with respect to the MLP's
    parameters only (the input is data, so its tangent is a symbolic zero)."""
    mlp = eqx.nn.MLP(
        64, 10, sizes.width, sizes.depth, activation=jax.nn.relu, key=jax.random.key(3)
    )
    x, y = digits_batch(sizes.batch)
    cases = []
    for mode in ("exact", "skip_scale", "stop_input"):
        rule = eqxrules.ScaledModel(mlp, 16.0, mode=mode)
        params, static = eqx.partition(rule, eqx.is_inexact_array)
        variants = build_variants(rule, {})

        def make(fn):
            def loss(params, data):
                x, y = data
                return _cross_entropy(jax.vmap(lambda x: fn(params, x))(x), y)

            return loss

        cases.append(
            Case(
                "scaled_call",
                -1,
                f"ScaledModel(MLP 64-{sizes.width}x{sizes.depth}-10, 16.0, mode={mode!r})",
                f"ScaledModel around an MLP, batch {sizes.batch}",
                {v: make(fn) for v, fn in variants.items()},
                params,
                (x, y),
                sizes.batch * sizes.width * sizes.depth,
            )
        )
    return cases


# ---------------------------------------------------------------------------
# Section 1: overhead per rule


def _grad_fn(loss: Callable) -> Callable:
    return jax.value_and_grad(loss)


def run_overhead(
    sizes: Sizes, entries: Sequence[Any], all_examples: bool, log: Callable
) -> dict[str, Any]:
    cases: list[Case] = []
    for entry in entries:
        n = len(entry.examples(jax.random.key(0)))
        if entry.name == "scaled_call":
            cases += scaled_model_cases(sizes)
            continue
        cases += cases_for(entry, sizes, range(n) if all_examples else [0])
    rows = []
    for case in cases:
        log(f"  {case.entry} #{case.example}: {case.scenario}")
        figures: dict[str, Any] = {}
        errors: dict[str, str] = {}
        for v, loss in case.losses.items():
            try:
                figures[v] = xla_figures(_grad_fn(loss), case.params, case.data)
            except Exception as e:  # a baseline that cannot express this rule
                errors[v] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        ours = figures.get("eqxrules")
        row: dict[str, Any] = dict(
            entry=case.entry,
            example=case.example,
            rule=case.rule,
            scenario=case.scenario,
            notes=case.notes,
            errors=errors,
            activation_elements=case.activation_elements,
            figures={
                v: {k: f[k] for k in ("flops", "bytes", "temp")}
                for v, f in figures.items()
            },
            wall={},
            hlo_diff={},
            same_program={},
        )
        if ours is not None:
            for v in ("hand", "quantized_hand"):
                if v in figures:
                    row["same_program"][v] = same_program(
                        ours["compiled"], figures[v]["compiled"]
                    )
            for v, f in figures.items():
                if v == "eqxrules":
                    continue
                if v in ("hand", "quantized_hand") and (
                    f["flops"] != ours["flops"] or f["temp"] != ours["temp"]
                ):
                    row["hlo_diff"][v] = hlo_diff(ours["compiled"], f["compiled"])
            # Wall time for the first example of each rule (every ScaledModel mode).
            first = case.example <= 0
            if first:
                for v in ("hand", "hand_ref", "trick"):
                    if v in figures:
                        row["wall"][v] = interleaved(
                            ours["compiled"],
                            figures[v]["compiled"],
                            (case.params, case.data),
                            sizes.pairs,
                            sizes.target_s,
                        )
        rows.append(row)
    return dict(rows=rows)


# ---------------------------------------------------------------------------
# Section 1b: the binarised MLP against the stop_gradient trick


def textbook_trick(clip_value: float) -> Callable:
    """What people write instead of a sign STE:
    `clip(x, -c, c) + stop_gradient(sign(x) - clip(x, -c, c))`."""

    def f(x):
        c = jnp.clip(x, -clip_value, clip_value)
        return c + _sg(jnp.where(x >= 0, 1.0, -1.0).astype(x.dtype) - c)

    return f


def run_trick(sizes: Sizes, binariser: Any, log: Callable) -> dict[str, Any]:
    rule = binariser
    kw = rule.call_kwargs(jax.random.key(1))
    variants = build_variants(rule, kw)
    dyn, _ = eqx.partition(rule, eqx.is_inexact_array)
    clip = getattr(rule, "clip_value", 1.0) or 1.0
    acts = {
        "eqxrules": ft.partial(variants["eqxrules"], dyn),
        "hand": ft.partial(variants["hand"], dyn),
        "trick": ft.partial(variants["trick"], dyn),
        "textbook": textbook_trick(clip),
    }
    ws = mlp_weights(sizes)
    data = digits_batch(sizes.batch)
    figures = {
        v: xla_figures(_grad_fn(binarised_mlp_loss(a)), ws, data)
        for v, a in acts.items()
    }
    wall = {
        v: interleaved(
            figures["eqxrules"]["compiled"],
            figures[v]["compiled"],
            (ws, data),
            sizes.pairs,
            sizes.target_s,
        )
        for v in ("trick", "textbook")
    }
    log("  gradient differences")
    grads = []
    for width in (sizes.width, sizes.width - 1):
        for seed in range(sizes.seeds):
            grads.append(_gradient_difference(acts, sizes, width, seed, clip))
    return dict(
        rule=_rule_label(rule),
        figures={
            v: {k: f[k] for k in ("flops", "bytes", "temp")} for v, f in figures.items()
        },
        wall=wall,
        gradients=grads,
    )


def _gradient_difference(acts, sizes, width, seed, clip) -> dict[str, Any]:
    ws = mlp_weights(sizes, seed=seed, width=width)
    data = digits_batch(sizes.batch, seed=seed)

    def with_preacts(act):
        def loss(ws, data):
            x, y = data
            h, pre = x, []
            for w in ws[:-1]:
                z = h @ act(w)
                pre.append(z)
                h = act(z)
            logits = h @ act(ws[-1]) / math.sqrt(ws[-1].shape[0])
            return _cross_entropy(logits, y), (pre, h)

        return jax.jit(jax.grad(loss, has_aux=True))

    g0, (pre, h0) = with_preacts(acts["eqxrules"])(ws, data)
    on_boundary = float(
        np.mean(np.concatenate([np.abs(np.ravel(p)) == clip for p in pre]))
    )
    out: dict[str, Any] = dict(width=width, seed=seed, on_boundary=on_boundary)
    norm = math.sqrt(sum(float(jnp.sum(g**2)) for g in g0))
    for v in ("trick", "textbook"):
        g1, (_, h1) = with_preacts(acts[v])(ws, data)
        diff = math.sqrt(sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(g0, g1)))
        out[v] = dict(
            relative=diff / norm if norm else float("nan"),
            per_layer=[
                float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(a), 1e-30))
                for a, b in zip(g0, g1)
            ],
            value_mismatch=float(jnp.mean(h0 != h1)),
        )
    return out


# ---------------------------------------------------------------------------
# Section 2: residual memory


def _needed_bytes(entry: Any, rule: Any, kw: dict[str, Any], x: jax.Array) -> Any:
    """What an elementwise rule's backward needs per element: nothing if its slope is
    constant, a bool mask (1 byte) if the slope is 0 or 1, else one value of the
    input's dtype. `None` for rules that are not elementwise."""
    if not entry.elementwise or not entry.forward_mode:
        return None
    _, slope = jax.jvp(lambda x: rule(x, **kw), (x,), (jnp.ones_like(x),))
    s = np.asarray(slope)
    if np.all(s == s.flat[0]):
        return 0
    if np.all((s == 0) | (s == 1)):
        return 1
    return jnp.dtype(x.dtype).itemsize


def run_residuals(
    sizes: Sizes, entries: Sequence[Any], all_examples: bool, log: Callable
) -> dict[str, Any]:
    rows = []
    for entry in entries:
        examples = entry.examples(jax.random.key(0))
        for i, rule in enumerate(examples if all_examples else examples[:1]):
            kw = rule.call_kwargs(jax.random.key(1))
            dyn, _ = eqx.partition(rule, eqx.is_inexact_array)
            kind = classify(rule, kw, sizes.width)
            if kind == "batched":
                dom = entry.domain
                x = jax.random.uniform(
                    jax.random.key(7),
                    (sizes.batch, *dom.shape),
                    minval=dom.low,
                    maxval=dom.high,
                )
                wrap = lambda fn: lambda x: jax.vmap(lambda e: fn(dyn, e))(x)  # noqa: E731
            else:
                x = 1.5 * jax.random.normal(
                    jax.random.key(7), (sizes.batch, sizes.width)
                )
                wrap = lambda fn: ft.partial(fn, dyn)  # noqa: E731
            row: dict[str, Any] = dict(
                entry=entry.name,
                example=i,
                rule=_rule_label(rule),
                elements=int(x.size),
                needed=_needed_bytes(entry, rule, kw, x) if kind != "batched" else None,
                variants={},
            )
            for v, fn in build_variants(rule, kw).items():
                f = wrap(fn)
                try:
                    saved = _saved_residuals(f, x)
                    outside = sum(
                        int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
                        for a, _ in saved
                    )
                    forward = jax.jit(lambda x, f=f: jax.vjp(f, x))
                    mem = forward.lower(x).compile().memory_analysis()
                    primal = _nbytes(jax.eval_shape(f, x))
                    inside = mem.output_size_in_bytes - primal
                except Exception as e:
                    row["variants"][v] = dict(error=f"{type(e).__name__}: {e}"[:160])
                    continue
                row["variants"][v] = dict(
                    outside=outside / x.size,
                    inside=inside / x.size,
                    saved=[
                        f"{a.str_short(short_dtypes=True)} {_short_source(s)}"
                        for a, s in saved
                    ],
                )
            rows.append(row)
            log(f"  {entry.name} #{i}")
    return dict(rows=rows)


def _short_source(s: str) -> str:
    s = re.sub(r"/[^ ]*/", "", s)
    return s[:90]


# ---------------------------------------------------------------------------
# Section 3: trace and compile time


def run_trace(sizes: Sizes, binariser: Any, log: Callable) -> dict[str, Any]:
    kw = binariser.call_kwargs(jax.random.key(1))
    dyn, _ = eqx.partition(binariser, eqx.is_inexact_array)
    variants = build_variants(binariser, kw)
    ws = _uniform_weights([64] + [sizes.deep_width] * sizes.deep_layers + [10], 0)
    data = digits_batch(sizes.deep_batch)

    def stages(v: str) -> dict[str, float]:
        jax.clear_caches()
        loss = binarised_mlp_loss(ft.partial(variants[v], dyn))
        fn = jax.jit(jax.value_and_grad(loss))
        t0 = time.perf_counter()
        traced = fn.trace(ws, data)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        lowered.compile()
        t3 = time.perf_counter()
        return dict(trace=t1 - t0, lower=t2 - t1, compile=t3 - t2, total=t3 - t0)

    stages("eqxrules")  # first-use costs (imports, backend) out of the way
    out: dict[str, Any] = {}
    for v in ("hand", "hand_ref", "trick"):
        ours, theirs = [], []
        for i in range(sizes.trace_pairs):
            if i % 2 == 0:
                ours.append(stages("eqxrules"))
                theirs.append(stages(v))
            else:
                theirs.append(stages(v))
                ours.append(stages("eqxrules"))
        out[v] = {
            k: dict(
                median=statistics.median(a[k] / b[k] for a, b in zip(ours, theirs)),
                min=min(a[k] / b[k] for a, b in zip(ours, theirs)),
                max=max(a[k] / b[k] for a, b in zip(ours, theirs)),
                ours_s=statistics.median(a[k] for a in ours),
                theirs_s=statistics.median(b[k] for b in theirs),
            )
            for k in ("trace", "lower", "compile", "total")
        }
        log(f"  vs {v}: total x{out[v]['total']['median']:.3f}")
    # Where the time goes, deterministically: the size of what is traced and lowered
    # (a rule call that stays a `custom_jvp_call` in the differentiated program is
    # more to trace and lower), and whether XLA ends up with the same program.
    programs = {}
    for v in ("eqxrules", "hand"):
        loss = binarised_mlp_loss(ft.partial(variants[v], dyn))
        traced = jax.jit(jax.value_and_grad(loss)).trace(ws, data)
        text = str(traced.jaxpr)
        programs[v] = dict(
            jaxpr_chars=len(text),
            custom_jvp_calls=text.count("custom_jvp_call"),
            hlo=normalised_hlo(traced.lower().compile().as_text()),
        )
    same_hlo = programs["eqxrules"].pop("hlo") == programs["hand"].pop("hlo")
    return dict(
        rule=_rule_label(binariser),
        layers=sizes.deep_layers,
        width=sizes.deep_width,
        batch=sizes.deep_batch,
        pairs=sizes.trace_pairs,
        ratios=out,
        programs=programs,
        same_optimised_hlo=same_hlo,
    )


# ---------------------------------------------------------------------------
# Section 4: the checker against jax.test_util.check_grads


def checker_problem(sizes: Sizes):
    mlp = eqx.nn.MLP(
        sizes.checker_in,
        10,
        sizes.checker_width,
        sizes.checker_depth,
        activation=jnp.tanh,
        key=jax.random.key(0),
    )
    params, static = eqx.partition(mlp, eqx.is_inexact_array)
    x = jax.random.normal(jax.random.key(1), (sizes.checker_batch, sizes.checker_in))

    def f(params, x):
        return jax.vmap(eqx.combine(params, static))(x)

    n = sum(p.size for p in jtu.tree_leaves(params))
    return f, params, x, n


CHECK_GRADS_TOL = 2e-3
"""`check_grads`' own float32 tolerance, given to `check_rule` too: the default 1e-5
is tighter than float32 reassociation error on a deep MLP (see RESULTS.md)."""


def checker_child(sizes: Sizes, which: str) -> dict[str, Any]:
    """Runs in a fresh process: JAX warmed up on a trivial program, then the first
    call (cold) and `checker_warm` repeated calls (warm) of one checker."""
    from jax.test_util import check_grads

    from eqxrules.testing import check_rule

    jax.jit(lambda a: a + 1)(jnp.ones(3)).block_until_ready()
    f, params, x, n = checker_problem(sizes)
    jax.block_until_ready((params, x))

    def once():
        if which == "check_grads":
            check_grads(f, (params, x), order=1, modes=("fwd", "rev"))
            return None
        report = check_rule(
            f,
            params,
            x,
            finite_differences=True,
            num_directions=2,
            rtol=CHECK_GRADS_TOL,
            atol=CHECK_GRADS_TOL,
        )
        return {r.name: [r.status, r.seconds] for r in report.results}

    times, detail = [], None
    for _ in range(1 + sizes.checker_warm):
        t0 = time.perf_counter()
        detail = once()
        times.append(time.perf_counter() - t0)
    return dict(which=which, params=n, cold=times[0], warm=times[1:], checks=detail)


def run_checker(sizes: Sizes, quick: bool, log: Callable) -> dict[str, Any]:
    runs: dict[str, list] = {"check_grads": [], "check_rule": []}
    for i in range(sizes.checker_pairs):
        order = (
            ("check_grads", "check_rule")
            if i % 2 == 0
            else ("check_rule", "check_grads")
        )
        for which in order:
            cmd = [sys.executable, __file__, "--child", which]
            if quick:
                cmd.append("--quick")
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"checker child {which} failed:\n{proc.stderr[-3000:]}"
                )
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            runs[which].append(result)
            log(f"  {which}: cold {result['cold']:.2f}s warm {result['warm']}")
    cold = [
        a["cold"] / b["cold"] for a, b in zip(runs["check_rule"], runs["check_grads"])
    ]
    warm = [
        statistics.median(a["warm"]) / statistics.median(b["warm"])
        for a, b in zip(runs["check_rule"], runs["check_grads"])
    ]
    return dict(
        params=runs["check_rule"][0]["params"],
        runs=runs,
        cold=dict(median=statistics.median(cold), min=min(cold), max=max(cold)),
        warm=dict(median=statistics.median(warm), min=min(warm), max=max(warm)),
        checks=runs["check_rule"][-1]["checks"],
    )


# ---------------------------------------------------------------------------
# Section 6: training throughput and the memory-bandwidth floor


def copy_bandwidth(mib: int, reps: int = 5) -> float:
    """Bytes per second of a jitted elementwise pass (read + write) over `mib` MiB."""
    a = jnp.ones(mib * 2**20 // 4, jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    jax.block_until_ready(f(a))
    times = [_time(f, (a,), 1) for _ in range(reps)]
    return 2 * a.nbytes / statistics.median(times)


def run_throughput(sizes: Sizes, binariser: Any, log: Callable) -> dict[str, Any]:
    kw = binariser.call_kwargs(jax.random.key(1))
    dyn, _ = eqx.partition(binariser, eqx.is_inexact_array)
    variants = build_variants(binariser, kw)
    ws = mlp_weights(sizes)
    data = digits_batch(sizes.batch)
    try:
        import optax

        opt = optax.adam(1e-3)
        opt_name = "optax.adam"
    except ImportError:
        opt = None
        opt_name = "SGD"
    out: dict[str, Any] = dict(optimizer=opt_name, batch=sizes.batch)
    steps: dict[str, Any] = {}
    for v in ("eqxrules", "hand"):
        loss = binarised_mlp_loss(ft.partial(variants[v], dyn))

        def step(ws, state, data, loss=loss):
            value, g = jax.value_and_grad(loss)(ws, data)
            if opt is None:
                return [w - 1e-3 * gw for w, gw in zip(ws, g)], state, value
            updates, state = opt.update(g, state, ws)
            return optax.apply_updates(ws, updates), state, value

        state = opt.init(ws) if opt is not None else None
        fig = xla_figures(step, ws, state, data)
        steps[v] = (fig, state)
    bw = copy_bandwidth(sizes.copy_mib)
    fig, state = steps["eqxrules"]
    compiled = fig["compiled"]
    args = (ws, state, data)
    jax.block_until_ready(compiled(*args))
    times = [_time(compiled, args, 1) for _ in range(sizes.train_steps)]
    step_s = statistics.median(times)
    floor_s = fig["bytes"] / bw
    out.update(
        step_s=step_s,
        step_min_s=min(times),
        step_max_s=max(times),
        examples_per_s=sizes.batch / step_s,
        bytes=fig["bytes"],
        flops=fig["flops"],
        bandwidth=bw,
        floor_s=floor_s,
        floor_examples_per_s=sizes.batch / floor_s,
        vs_hand=interleaved(
            compiled,
            steps["hand"][0]["compiled"],
            args,
            sizes.pairs,
            sizes.target_s,
        ),
    )
    log(
        f"  {out['examples_per_s']:.0f} examples/s, floor {out['floor_examples_per_s']:.0f}"
    )
    return out


# ---------------------------------------------------------------------------
# Section 5: the suite and the command line


def run_suite(log: Callable) -> dict[str, Any]:
    out = {}
    for name, cmd in (
        ("pytest", [sys.executable, "-m", "pytest"]),
        ("cli", [sys.executable, "-m", "eqxrules"]),
    ):
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        seconds = time.perf_counter() - t0
        lines = [line for line in proc.stdout.strip().splitlines() if line.strip()]
        summary = [
            line for line in lines if re.search(r"\d+ (passed|failed|error)", line)
        ]
        tail = summary or lines
        out[name] = dict(
            command=" ".join(["python"] + cmd[1:]),
            seconds=seconds,
            returncode=proc.returncode,
            last_line=tail[-1] if tail else proc.stderr.strip()[-200:],
            load_before=load,
        )
        log(f"  {name}: {seconds:.1f}s rc={proc.returncode}")
    return out


# ---------------------------------------------------------------------------
# The report


def code_version() -> str:
    """The commit measured, with `+changes` if the working tree differs from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    d = jax.devices()[0]
    return dict(
        cpu=cpu,
        cores=os.cpu_count(),
        device_kind=d.device_kind,
        platform=d.platform,
        devices=len(jax.devices()),
        jax=jax.__version__,
        jaxlib=getattr(__import__("jaxlib"), "__version__", "?"),
        equinox=eqx.__version__,
        python=platform.python_version(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"
        ),
        load_start=os.getloadavg(),
    )


def _ratio(a: float, b: float) -> str:
    if b == 0:
        return "1.000" if a == 0 else "inf"
    return f"{a / b:.4f}"


def _wall(w: dict[str, float] | None) -> str:
    if not w:
        return "-"
    return f"{w['median']:.3f} [{w['min']:.2f}, {w['max']:.2f}]"


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def render(results: dict[str, Any], args: argparse.Namespace) -> str:
    m = results["machine"]
    lines = [
        "# eqxrules performance figures",
        "",
        "Made by `benchmarks/run.py` (issue 6); do not edit by hand.",
        "",
    ]
    if results.get("quick"):
        lines += [
            "> **QUICK RUN** (`--quick`): small sizes for developing the script. "
            "These are not the figures of record.",
            "",
        ]
    lines += [
        "- Commands: "
        + ", ".join(
            f"`{c}`"
            for c in dict.fromkeys(
                results[s]["measured"]["command"]
                for s in (*SECTIONS, "suite")
                if s in results
            )
        ),
        f"- Date: {m['date']} (each section gives when it was measured)",
        f"- Machine: {m['cpu']}, {m['cores']} cores; JAX device "
        f"`{m['device_kind']}` ({m['platform']}, {m['devices']} device(s))",
        f"- Versions: Python {m['python']}, JAX {m['jax']}, jaxlib {m['jaxlib']}, "
        f"Equinox {m['equinox']}",
        "- The CPU is shared with other work (each section gives the load average "
        "before and after it), so wall-clock figures are noisy. The XLA figures (flops, bytes, temp bytes, residual bytes) are "
        "deterministic and are the main figures; wall times are medians of "
        "interleaved A/B pairs, given as `median [min, max]` of the per-pair ratios.",
        "",
        "Ratios are always eqxrules over the baseline: below 1 means eqxrules is "
        "cheaper. Baselines, built generically from each rule:",
        "",
        "- **hand**: a plain `jax.custom_jvp` (`custom_vjp` for reverse-only rules) "
        "calling the rule's own `primal`/`tangent` (`fwd`/`bwd`): the same maths "
        "without `eqx.filter_custom_jvp`, `Module` plumbing or dtype matching. "
        "Equality here is what 'zero overhead' means.",
        "- **hand_ref**: a plain `jax.custom_jvp` whose value is the rule's "
        "`reference_forward` and whose tangent is `jax.jvp` of its "
        "`reference_derivative` (a `custom_vjp` calling `reference_vjp` for "
        "reverse-only rules). The references are written independently of the rule "
        "(e.g. `where(mask, x, 0)` where the rule multiplies by a float mask), so a "
        "difference here is a difference of maths, not of mechanism.",
        "- **trick**: `d + stop_gradient(f - d)` from the same references.",
        "",
    ]
    if "overhead" in results:
        lines += _render_overhead(results["overhead"], args)
    if "trick" in results:
        lines += _render_trick(results["trick"], args)
    if "residuals" in results:
        lines += _render_residuals(results["residuals"], args)
    if "trace" in results:
        lines += _render_trace(results["trace"], args)
    if "checker" in results:
        lines += _render_checker(results["checker"], args)
    if "suite" in results:
        lines += _render_suite(results["suite"])
    lines += _render_gpu(results.get("throughput"), m, args)
    return "\n".join(lines) + "\n"


def _measured(res: dict[str, Any]) -> list[str]:
    m = res.get("measured")
    if not m:
        return []
    code = f" on commit `{m['code']}`" if "code" in m else ""
    return [
        f"Measured {m['date']}{code} by `{m['command']}`; load average "
        f"{m['load'][0]:.1f} before, {m['load'][1]:.1f} after.",
        "",
    ]


def _cmd(args: argparse.Namespace, section: str, extra: str = "") -> str:
    q = " --quick" if args.quick else ""
    return f"`{SCRIPT}{q} --only {section}{extra}`"


def _render_overhead(res: dict[str, Any], args) -> list[str]:
    rows = res["rows"]
    lines = [
        "## 1. Overhead per catalogue rule",
        "",
        *_measured(res),
        f"Command: {_cmd(args, 'overhead')} (one rule: add `--rules NAME`). Each rule "
        "example inside a jitted `value_and_grad` of a realistic network: a fully "
        "binarised/quantised MLP (the rule on every weight and hidden activation) and "
        "a small CNN through `eqxrules.quantize` for rules that map an array to one of "
        "its shape; a two-head (domain-adversarial) net for rules whose value is the "
        "identity; `ScaledModel` around an MLP; the rule's own example vmapped over a "
        "batch for the rest.",
        "",
        "### 1a. XLA figures (deterministic)",
        "",
        "| rule | example | network | flops | temp MiB | flops / hand | bytes / hand "
        "| temp / hand | flops / hand_ref | temp / hand_ref | flops / trick "
        "| temp / trick |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = r["figures"]
        o = f.get("eqxrules")
        if o is None:
            lines.append(
                f"| `{r['entry']}` | {r['rule']} | {r['scenario']} | error: "
                f"{r['errors'].get('eqxrules')} |" + " |" * 8
            )
            continue

        def rat(v, k):
            return _ratio(o[k], f[v][k]) if v in f else "n/a"

        lines.append(
            f"| `{r['entry']}` | {r['rule']} | {r['scenario']} | {o['flops']:.4g} | "
            f"{_mib(o['temp'])} | {rat('hand', 'flops')} | {rat('hand', 'bytes')} | "
            f"{rat('hand', 'temp')} | {rat('hand_ref', 'flops')} | "
            f"{rat('hand_ref', 'temp')} | {rat('trick', 'flops')} | "
            f"{rat('trick', 'temp')} |"
        )
    quantized = [r for r in rows if "quantized_hand" in r["figures"]]
    if quantized:
        lines += [
            "",
            "CNN rows compare `quantize(cnn, ...)` (the `Quantized` layer) with the "
            "rule to plain `lax.conv_general_dilated` layers with the baseline rule. "
            "`Quantized` with the hand-written rule, flops and temp bytes relative to "
            "eqxrules' `Quantized`:",
            "",
            "| rule | flops ratio | temp ratio |",
            "|---|---|---|",
        ]
        for r in quantized:
            o, q = r["figures"]["eqxrules"], r["figures"]["quantized_hand"]
            lines.append(
                f"| `{r['entry']}` {r['rule']} | {_ratio(o['flops'], q['flops'])} | "
                f"{_ratio(o['temp'], q['temp'])} |"
            )
    errors = [(r, v, e) for r in rows for v, e in r["errors"].items()]
    if errors:
        lines += ["", "Baselines that cannot express a rule (so no ratio):", ""]
        lines += [f"- `{r['entry']}` {r['rule']}, {v}: {e}" for r, v, e in errors]
    lines += ["", "### 1b. Wall time (noisy: shared CPU)", ""]
    lines += [
        "eqxrules over the baseline, median [min, max] of interleaved pairs, the "
        "first example of each rule:",
        "",
        "| rule | network | eqxrules ms | vs hand | same instructions as hand "
        "| vs hand_ref | vs trick |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        w = r["wall"]
        if not w:
            continue
        ms = next(iter(w.values()))["a_s"] * 1e3
        sp = r.get("same_program", {})
        same = (
            "-"
            if "hand" not in sp
            else "yes"
            if sp["hand"]
            else "as `Quantized` + hand: yes"
            if sp.get("quantized_hand")
            else "no"
        )
        lines.append(
            f"| `{r['entry']}` {r['rule']} | {r['scenario']} | {ms:.2f} | "
            f"{_wall(w.get('hand'))} | {same} | {_wall(w.get('hand_ref'))} | "
            f"{_wall(w.get('trick'))} |"
        )
    lines += ["", "### 1c. Goals", ""]
    verdicts: dict[str, list] = {"equal": [], "cheaper": [], "costlier": []}
    for r in rows:
        f = r["figures"]
        if "eqxrules" not in f or "hand" not in f:
            continue
        o, h = f["eqxrules"], f["hand"]
        if (o["flops"], o["temp"]) == (h["flops"], h["temp"]):
            verdicts["equal"].append(r)
        elif o["flops"] <= h["flops"] and o["temp"] <= h["temp"]:
            verdicts["cheaper"].append(r)
        else:
            verdicts["costlier"].append(r)
    total = sum(len(v) for v in verdicts.values())
    lines.append(
        f"- Flops and temp bytes against the hand-written rule (same maths): equal "
        f"for {len(verdicts['equal'])} of {total} rule/network pairs, lower for "
        f"{len(verdicts['cheaper'])}, higher for {len(verdicts['costlier'])}."
    )
    for r in verdicts["cheaper"]:
        lines.append(
            f"  - lower: `{r['entry']}` {r['rule']} in {r['scenario']}"
            + (f" ({r['notes']})" if r["notes"] else "")
        )
    for r in verdicts["costlier"]:
        lines += [
            f"  - **higher**: `{r['entry']}` {r['rule']} in {r['scenario']}:",
            "",
            "    ```",
            *("    " + line for line in r["hlo_diff"].get("hand", "").splitlines()),
            "    ```",
        ]
    plain = [r for r in rows if "hand" in r.get("same_program", {})]
    plain = [r for r in plain if "quantized_hand" not in r["same_program"]]
    layered = [r for r in rows if "quantized_hand" in r.get("same_program", {})]
    if plain or layered:
        rescheduled = [
            r
            for r in layered
            if r["same_program"]["hand"]
            and r["figures"]["eqxrules"]["temp"] != r["figures"]["hand"]["temp"]
        ]
        lines.append(
            "- The optimised HLO has the same instructions on the same shapes (names "
            "and order aside) as the hand-written rule's for "
            f"{sum(r['same_program']['hand'] for r in plain)} of {len(plain)} "
            "pairs outside the CNN; in the CNN, as the plain-layer CNN for "
            f"{sum(r['same_program']['hand'] for r in layered)} of {len(layered)} "
            f"({len(rescheduled)} of which XLA schedules differently: the temp-byte "
            "differences above) and as `Quantized` with the hand-written rule for "
            f"{sum(r['same_program']['quantized_hand'] for r in layered)} of "
            f"{len(layered)}. Where the instructions are the same, a wall ratio away "
            "from 1 is noise."
        )
    q = [r for r in rows if "quantized_hand" in r["figures"]]
    if q:
        same = [
            r
            for r in q
            if (r["figures"]["eqxrules"]["flops"], r["figures"]["eqxrules"]["temp"])
            == (
                r["figures"]["quantized_hand"]["flops"],
                r["figures"]["quantized_hand"]["temp"],
            )
        ]
        lines.append(
            f"- In the CNN, `Quantized` with the eqxrules rule against `Quantized` "
            f"with the hand-written rule: equal flops and temp bytes for {len(same)} "
            f"of {len(q)}."
        )
    walls = [r["wall"]["hand"]["median"] for r in rows if "hand" in r["wall"]]
    if walls:
        within = sum(1 for w in walls if w <= 1.02)
        lines.append(
            f"- Wall ratio to hand-written within 1.02: {within} of {len(walls)} "
            f"(median of medians {statistics.median(walls):.3f}, range "
            f"{min(walls):.3f} to {max(walls):.3f})."
        )
    tricks = [r["wall"]["trick"]["median"] for r in rows if "trick" in r["wall"]]
    if tricks:
        lines.append(
            f"- Wall ratio to the trick at most 1.0: "
            f"{sum(1 for w in tricks if w <= 1.0)} of {len(tricks)} (median of "
            f"medians {statistics.median(tricks):.3f}, range {min(tricks):.3f} to "
            f"{max(tricks):.3f})."
        )
    flops_trick = [
        r["figures"]["eqxrules"]["flops"] / r["figures"]["trick"]["flops"]
        for r in rows
        if "trick" in r["figures"] and "eqxrules" in r["figures"]
    ]
    if flops_trick:
        lines.append(
            f"- Flops relative to the trick: at most 1.0 for "
            f"{sum(1 for x in flops_trick if x <= 1.0)} of {len(flops_trick)} "
            f"(range {min(flops_trick):.4f} to {max(flops_trick):.4f})."
        )
    lines.append("")
    return lines


def _render_trick(res: dict[str, Any], args) -> list[str]:
    f = res["figures"]
    o = f["eqxrules"]
    lines = [
        "## 1d. The binarised MLP against the stop_gradient trick",
        "",
        *_measured(res),
        f"Command: {_cmd(args, 'trick')}. {res['rule']} as weight and activation "
        "quantiser of the binarised MLP on scikit-learn's 8x8 digits (integer "
        "pixels, so pre-activations are integers). Two tricks: the generic one from "
        "the rule's references, and the one people write, "
        "`clip(x, -1, 1) + stop_gradient(sign(x) - clip(x, -1, 1))`.",
        "",
        "| baseline | flops / baseline | bytes / baseline | temp / baseline "
        "| wall eqxrules / baseline |",
        "|---|---|---|---|---|",
    ]
    for v, name in (
        ("hand", "hand-written (same maths)"),
        ("trick", "trick from the references"),
        ("textbook", "textbook `clip` trick"),
    ):
        b = f[v]
        lines.append(
            f"| {name} | {_ratio(o['flops'], b['flops'])} | "
            f"{_ratio(o['bytes'], b['bytes'])} | {_ratio(o['temp'], b['temp'])} | "
            f"{_wall(res['wall'].get(v))} |"
        )
    lines += [
        "",
        "How much of the gradient the trick changes, "
        "`||g_trick - g_eqxrules|| / ||g_eqxrules||` over all weights, per seed; "
        "`on ±clip` is the fraction of pre-activations exactly on the clip boundary, "
        "where `jnp.clip`'s derivative is 1/2:",
        "",
        "| width | seed | on ±clip | textbook trick | per layer (textbook) "
        "| forward values differing (textbook) | reference trick |",
        "|---|---|---|---|---|---|---|",
    ]
    for g in res["gradients"]:
        t = g["textbook"]
        lines.append(
            f"| {g['width']} | {g['seed']} | {g['on_boundary']:.4f} | "
            f"{t['relative']:.1%} | "
            f"{', '.join(f'{x:.2f}' for x in t['per_layer'])} | "
            f"{t['value_mismatch']:.2%} | {g['trick']['relative']:.1%} |"
        )
    lines += [
        "",
        "With an even hidden width, a hidden pre-activation (a sum of an even number "
        "of ±1 products) is never ±1, so only the first layer (integer pixels) meets "
        "the boundary; with an odd width every layer does, and the half gradient "
        "compounds through the layers. The trick built from eqxrules' own reference "
        "(`where(mask, x, 0)`, inclusive) gives the same gradient as eqxrules: the "
        "damage is `jnp.clip`'s tie rule, not the trick as such.",
        "",
    ]
    return lines


def _render_residuals(res: dict[str, Any], args) -> list[str]:
    lines = [
        "## 2. Residual memory",
        "",
        *_measured(res),
        f"Command: {_cmd(args, 'residuals')}. Bytes saved for the backward pass per "
        "element of the rule's input: outside jit, the residuals "
        "`saved_residuals` lists for `jax.vjp`; inside jit, what the compiled "
        "forward pass of `jax.vjp` must output besides the value "
        "(`memory_analysis().output_size_in_bytes` minus the value's bytes). "
        "`needed`: what the backward pass needs at least, for elementwise rules "
        "(0 for a constant slope, 1 for a 0/1 mask kept as bool, else one input "
        "value). Inside a whole jitted forward+backward XLA fuses the mask into the "
        "backward pass and saves nothing (§1 temp bytes).",
        "",
        "| rule | example | needed | eqxrules out / in | hand out / in "
        "| hand_ref out / in | trick out / in | eqxrules saves |",
        "|---|---|---|---|---|---|---|---|",
    ]
    flagged = []
    for r in res["rows"]:
        cells = []
        for v in VARIANTS:
            x = r["variants"].get(v)
            if x is None:
                cells.append("n/a")
            elif "error" in x:
                cells.append("error")
            else:
                cells.append(f"{x['outside']:.2f} / {x['inside']:.2f}")
        ours = r["variants"].get("eqxrules", {})
        saved = "; ".join(ours.get("saved", [])) or "nothing"
        needed = "-" if r["needed"] is None else str(r["needed"])
        lines.append(
            f"| `{r['entry']}` | {r['rule']} | {needed} | "
            + " | ".join(cells)
            + f" | {saved} |"
        )
        if (
            r["needed"] is not None
            and "outside" in ours
            and (
                ours["outside"] > r["needed"] + 1e-9
                or ours["inside"] > r["needed"] + 0.01
            )
        ):
            flagged.append(r)
    lines += [""]
    if flagged:
        lines += ["Rules that save more than their backward pass needs:", ""]
        for r in flagged:
            o = r["variants"]["eqxrules"]
            lines.append(
                f"- `{r['entry']}` {r['rule']}: {o['outside']:.2f} B/element "
                f"outside jit, {o['inside']:.2f} inside, where {r['needed']} "
                "would do."
            )
        lines.append("")
    return lines


def _render_trace(res: dict[str, Any], args) -> list[str]:
    lines = [
        "## 3. Trace and compile time",
        "",
        *_measured(res),
        f"Command: {_cmd(args, 'trace')}. `jax.jit(value_and_grad(loss))` of a "
        f"{res['layers']}-layer binarised MLP (width {res['width']}, batch "
        f"{res['batch']}, {res['rule']} on every weight and activation), "
        "`jax.clear_caches()` before each; "
        f"{res['pairs']} interleaved pairs. eqxrules over the baseline:",
        "",
        "| baseline | trace | lower | compile | total | eqxrules total s "
        "| baseline total s |",
        "|---|---|---|---|---|---|---|",
    ]
    for v, r in res["ratios"].items():
        lines.append(
            f"| {VARIANT_NAMES[v]} | {_wall(r['trace'])} | {_wall(r['lower'])} | "
            f"{_wall(r['compile'])} | {_wall(r['total'])} | "
            f"{r['total']['ours_s']:.2f} | {r['total']['theirs_s']:.2f} |"
        )
    t = res["ratios"]["hand"]["total"]["median"]
    lines += [
        "",
        f"Goal (total within 1.15x of hand-written): "
        f"{'met' if t <= 1.15 else 'NOT met'} ({t:.3f}).",
        "",
    ]
    for old in res.get("earlier", []):
        lines += [
            f"An earlier run ({old['date']}"
            + (f", commit `{old['code']}`" if "code" in old else "")
            + f", load {old['load'][0]:.1f}) gave a total "
            f"of {old['total']['median']:.3f} [{old['total']['min']:.2f}, "
            f"{old['total']['max']:.2f}] against hand-written.",
            "",
        ]
    pr = res.get("programs")
    if pr:
        o, h = pr["eqxrules"], pr["hand"]
        lines += [
            "Deterministically: the differentiated program eqxrules traces has "
            f"{o['jaxpr_chars']:,} characters of jaxpr and {o['custom_jvp_calls']} "
            f"`custom_jvp_call`s, the hand-written one {h['jaxpr_chars']:,} and "
            f"{h['custom_jvp_calls']}; the optimised HLO XLA compiles is "
            f"{'identical' if res['same_optimised_hlo'] else 'DIFFERENT'}.",
            "",
        ]
    return lines


def _render_checker(res: dict[str, Any], args) -> list[str]:
    g = res["runs"]["check_grads"]
    r = res["runs"]["check_rule"]
    lines = [
        "## 4. The checker's speed",
        "",
        *_measured(res),
        f"Command: {_cmd(args, 'checker')}. An `eqx.nn.MLP` with {res['params']:,} "
        "parameters (tanh), as `f(params, x)` on a batch. "
        "`jax.test_util.check_grads(f, (params, x), order=1, modes=('fwd', 'rev'))` "
        "checks the JVP and the VJP against central differences along one random "
        "direction each (2 directions). `check_rule(f, params, x, "
        "finite_differences=True, num_directions=2, rtol=2e-3, atol=2e-3)` uses the "
        "same 2 directions (in float64) and `check_grads`' float32 tolerance, and "
        "also runs linearity, transpose, batching, jit, zero-cotangent and dtype "
        "checks. Each timed in a fresh process (JAX already initialised): the first "
        "call (cold: tracing and compiling) and repeated calls (warm). With its "
        "default float32 tolerance (rtol 1e-5) `check_rule` reports `linearity` "
        "failed on this correct MLP: `J(2a - b/2)` and `2Ja - Jb/2` differ by "
        "float32 reassociation (relative 1e-4 to 1e-3 where the sums cancel).",
        "",
        "| | check_grads s | check_rule s | ratio median [min, max] |",
        "|---|---|---|---|",
        f"| cold | {statistics.median(x['cold'] for x in g):.2f} | "
        f"{statistics.median(x['cold'] for x in r):.2f} | {_wall(res['cold'])} |",
        f"| warm | {statistics.median(statistics.median(x['warm']) for x in g):.2f} | "
        f"{statistics.median(statistics.median(x['warm']) for x in r):.2f} | "
        f"{_wall(res['warm'])} |",
        "",
        "check_rule's checks, status and seconds, on the last warm call: "
        + ", ".join(f"{k} {v[0]} {v[1]:.2f}s" for k, v in res["checks"].items()),
        "",
    ]
    return lines


def _render_suite(res: dict[str, Any]) -> list[str]:
    lines = [
        "## 5. The suite and the command line",
        "",
        *_measured(res),
        "Command: `python benchmarks/run.py --suite --only suite` (each run once, in "
        "a subprocess, from the repository root).",
        "",
        "| command | wall s | exit | last line | load before |",
        "|---|---|---|---|---|",
    ]
    for name in ("pytest", "cli"):
        r = res[name]
        lines.append(
            f"| `{r['command']}` | {r['seconds']:.1f} | {r['returncode']} | "
            f"{r['last_line']} | {r['load_before']:.1f} |"
        )
    return lines + [""]


def _render_gpu(res: dict[str, Any] | None, m: dict[str, Any], args) -> list[str]:
    lines = ["## 6. Throughput, and GPU", ""]
    if res is not None:
        lines += _measured(res)
        lines += [
            f"Command: {_cmd(args, 'throughput')}. One training step ({res['optimizer']}) "
            f"of the binarised MLP, batch {res['batch']}, on `{m['device_kind']}`:",
            "",
            f"- {res['examples_per_s']:,.0f} examples/s (step {res['step_s'] * 1e3:.1f} "
            f"ms median, {res['step_min_s'] * 1e3:.1f} to "
            f"{res['step_max_s'] * 1e3:.1f} ms).",
            f"- Memory-bandwidth floor: XLA moves {res['bytes'] / 1e6:,.1f} MB per step; "
            f"measured copy bandwidth {res['bandwidth'] / 1e9:.2f} GB/s, so at least "
            f"{res['floor_s'] * 1e3:.2f} ms per step, at most "
            f"{res['floor_examples_per_s']:,.0f} examples/s. The step reaches "
            f"{res['floor_s'] / res['step_s']:.1%} of that bound "
            f"({res['flops'] / 1e9:.2f} GFLOP per step).",
            f"- Step time eqxrules over hand-written: {_wall(res['vs_hand'])}.",
            "",
        ]
    if m["platform"] != "gpu":
        lines += [
            "**No GPU was available in this session**, so the GPU figures are "
            "pending. On a machine with one, run the same script (nothing in it "
            "needs a GPU, and it records the device kind):",
            "",
            "    python benchmarks/run.py --json --out benchmarks/RESULTS.gpu.md",
            "",
            "which also records the training-step throughput and the bandwidth floor "
            "on that device.",
            "",
        ]
    return lines


# ---------------------------------------------------------------------------


def _entries(names: str | None) -> list[Any]:
    entries = list(eqxrules.catalogue())
    if names:
        wanted = set(names.split(","))
        unknown = wanted - {e.name for e in entries}
        if unknown:
            raise SystemExit(f"unknown rule(s): {', '.join(sorted(unknown))}")
        entries = [e for e in entries if e.name in wanted]
    return entries


def _binariser(name: str) -> Any:
    by_name = {e.name: e for e in eqxrules.catalogue()}
    if name not in by_name:
        raise SystemExit(f"`--binariser` {name!r} is not in the catalogue")
    return by_name[name].examples(jax.random.key(0))[0]


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items() if k != "compiled"}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return x


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, for developing")
    p.add_argument("--json", action="store_true", help="also write the figures as JSON")
    p.add_argument(
        "--suite", action="store_true", help="also time pytest and the CLI (minutes)"
    )
    p.add_argument(
        "--only", help=f"comma-separated sections of {SECTIONS + ('suite',)}"
    )
    p.add_argument("--rules", help="comma-separated catalogue names (default: all)")
    p.add_argument(
        "--all-examples",
        action="store_true",
        help="every example of each rule, not just the first (XLA figures only)",
    )
    p.add_argument("--binariser", default="ste_sign", help="rule of the binarised net")
    p.add_argument(
        "--out",
        help="the report (default `benchmarks/RESULTS.md`, with `--quick` "
        "`benchmarks/RESULTS.quick.md`); the JSON goes next to it, as `.json`",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the other sections of the JSON next to the report, replace the "
        "ones run now, and re-render (implies --json)",
    )
    p.add_argument(
        "--render", action="store_true", help="only re-render the saved JSON"
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = QUICK if args.quick else FULL

    if args.child:
        print(json.dumps(checker_child(sizes, args.child)))
        return 0

    sections = args.only.split(",") if args.only else list(SECTIONS)
    if args.render:
        args.merge, sections = True, []
    if args.suite and "suite" not in sections:
        sections.append("suite")
    unknown = set(sections) - set(SECTIONS) - {"suite"}
    if unknown:
        raise SystemExit(f"unknown section(s): {', '.join(sorted(unknown))}")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    command = "python benchmarks/run.py" + (
        " " + " ".join(sys.argv[1:]) if argv is None and sys.argv[1:] else ""
    )
    name = "RESULTS.quick.md" if args.quick else "RESULTS.md"
    out = pathlib.Path(args.out or ROOT / "benchmarks" / name)
    json_path = out.with_suffix(".json")
    results: dict[str, Any] = {}
    if args.merge and json_path.exists():
        results = json.loads(json_path.read_text())
        if results.get("quick", False) != args.quick:
            raise SystemExit("`--merge`: the saved results are of the other size")
    results.update(machine=machine(), quick=args.quick)
    entries = _entries(args.rules)
    binariser = _binariser(args.binariser)
    started = time.perf_counter()
    for section in sections:
        log(f"[{time.perf_counter() - started:6.0f}s] {section}")
        measured = dict(
            date=datetime.datetime.now(datetime.timezone.utc).strftime(
                "%Y-%m-%d %H:%M UTC"
            ),
            command=command,
            code=code_version(),
            load=[os.getloadavg()[0]],
        )
        if section == "overhead":
            results[section] = run_overhead(sizes, entries, args.all_examples, log)
        elif section == "trick":
            results[section] = run_trick(sizes, binariser, log)
        elif section == "residuals":
            results[section] = run_residuals(sizes, entries, args.all_examples, log)
        elif section == "trace":
            old = results.get(section)
            results[section] = run_trace(sizes, binariser, log)
            if old is not None:
                # Wall-clock ratios move with the load: keep earlier headlines.
                results[section]["earlier"] = [
                    *old.get("earlier", []),
                    dict(old["measured"], total=old["ratios"]["hand"]["total"]),
                ]
        elif section == "checker":
            results[section] = run_checker(sizes, args.quick, log)
        elif section == "throughput":
            results[section] = run_throughput(sizes, binariser, log)
        elif section == "suite":
            results[section] = run_suite(log)
        measured["load"].append(os.getloadavg()[0])
        results[section]["measured"] = measured
    seconds = time.perf_counter() - started
    out.write_text(render(results, args))
    log(f"wrote {out} in {seconds:.0f}s")
    if args.json or args.merge:
        json_path.write_text(json.dumps(_jsonable(results), indent=1))
        log(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
