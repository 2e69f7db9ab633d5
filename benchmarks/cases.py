"""Scenarios: how each catalogue rule is put inside a realistic forward+backward."""

from __future__ import annotations

import dataclasses
import functools as ft
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

import eqxrules

from . import learned, networks as nets
from .baselines import build_variants
from .config import Sizes


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


def rule_label(rule: Any) -> str:
    """`Name(field=value, ...)` for the fields a reader can take in at a glance."""
    fields = []
    for f in dataclasses.fields(rule):
        v = getattr(rule, f.name)
        if isinstance(v, (int, float, str, bool)) or v is None:
            fields.append(f"{f.name}={v!r}")
        elif callable(v):
            fields.append(f"{f.name}={getattr(v, '__name__', type(v).__name__)}")
    return f"{type(rule).__name__}({', '.join(fields)})"


def classify(rule: Any, kw: dict[str, Any], width: int) -> str:
    """`"blocked"` for a block quantiser (it quantises along a layer's reduction
    dimension), `"mlp"` if the rule maps a `(batch, width)` float array to one of
    the same shape and dtype (it can quantise weights and activations), `"twohead"`
    if it is moreover the identity in value (gradient shaping), else `"batched"`."""
    x = jnp.asarray(np.random.default_rng(5).standard_normal((16, width)), jnp.float32)
    if hasattr(rule, "for_reduction_axis"):
        return "blocked"
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


def domain_batch(entry: Any, batch: int) -> Any:
    """`batch` inputs drawn from the entry's domain (an `eqxrules.Args` of them,
    each from its own domain, for a rule of several inputs; a mask half true)."""
    return _batch(entry.domain, batch, jax.random.key(7))


def _batch(dom: Any, batch: int, key: Any) -> Any:
    if isinstance(dom, eqxrules.Inputs):
        keys = jax.random.split(key, len(dom.domains))
        return eqxrules.Args(_batch(d, batch, k) for d, k in zip(dom.domains, keys))
    if isinstance(dom, eqxrules.Mask):
        return jax.random.bernoulli(key, 0.5, (batch, *dom.shape))
    return jax.random.uniform(key, (batch, *dom.shape), minval=dom.low, maxval=dom.high)


def elements(x: Any) -> int:
    """The floating-point elements of an input (of each input, for `Args`)."""
    return sum(int(a.size) for a in jtu.tree_leaves(x) if eqx.is_inexact_array(a))


def cases_for(
    entry: Any, sizes: Sizes, examples: Sequence[int], cnn: bool = True
) -> list[Case]:
    out = []
    all_examples = entry.examples(jax.random.key(0))
    for i in examples:
        if i >= len(all_examples):
            continue
        rule = all_examples[i]
        if hasattr(rule, "for_reduction_axis"):
            # As `quantize` puts it: along the last (reduction) axis of `(out, in)`
            # weights and `(batch, in)` inputs.
            rule = dataclasses.replace(rule, axis=-1)
        kw = rule.call_kwargs(jax.random.key(1))
        dyn, _ = eqx.partition(rule, eqx.is_inexact_array)
        variants = build_variants(rule, kw)
        kind = classify(rule, kw, sizes.width)
        label = rule_label(rule)
        if learned.is_learned(rule):
            out.append(_qat_case(entry.name, i, label, rule, variants, sizes))
        elif kind == "mlp":
            out.append(_mlp_case(entry.name, i, label, variants, dyn, sizes))
            if cnn:
                out.append(_cnn_case(entry.name, i, label, variants, dyn, sizes))
        elif kind == "blocked":
            out.append(_block_mlp_case(entry.name, i, label, variants, dyn, sizes))
        elif kind == "twohead":
            out.append(_twohead_case(entry.name, i, label, variants, dyn, sizes))
        else:
            out.append(_batched_case(entry, i, label, rule, variants, sizes))
    return out


def _qat_case(name, i, label, rule, variants, sizes) -> Case:
    """A learned quantiser: its step is trained, so it is a parameter."""
    scenario, losses, params, data, n_act = learned.qat_case_parts(
        rule, variants, sizes
    )
    return Case(name, i, label, scenario, losses, params, data, n_act)


def _mlp_case(name, i, label, variants, dyn, sizes) -> Case:
    x, y = nets.digits_batch(sizes.batch)
    dims = nets.mlp_dims(sizes)
    n_act = sizes.batch * sizes.width * sizes.depth + sum(
        a * b for a, b in zip(dims[:-1], dims[1:])
    )
    return Case(
        name,
        i,
        label,
        f"binarised MLP {sizes.depth}x{sizes.width}, batch {sizes.batch}",
        {v: nets.binarised_mlp_loss(ft.partial(fn, dyn)) for v, fn in variants.items()},
        nets.mlp_weights(sizes),
        (x, y),
        n_act,
    )


def _block_mlp_case(name, i, label, variants, dyn, sizes) -> Case:
    """A block quantiser (MX, NVFP4) on every weight and every layer's input of a
    ReLU MLP 64 → width → ... → 10, its blocks along each layer's reduction
    dimension (the last axis of `(out, in)` weights and of `(batch, in)` inputs),
    as `quantize` puts them."""
    x, y = nets.digits_batch(sizes.batch)
    dims = nets.mlp_dims(sizes)
    rng = np.random.default_rng(0)
    ws = [
        jnp.asarray(rng.uniform(-1, 1, (b, a)).astype(np.float32) / np.sqrt(a))
        for a, b in zip(dims[:-1], dims[1:])
    ]

    def make(fn):
        q = ft.partial(fn, dyn)

        def loss(ws, data):
            x, y = data
            h = x / 16
            for w in ws[:-1]:
                h = jax.nn.relu(q(h) @ q(w).T)
            return nets.cross_entropy(q(h) @ q(ws[-1]).T, y)

        return loss

    n_act = sizes.batch * (64 + sizes.width * sizes.depth) + sum(w.size for w in ws)
    return Case(
        name,
        i,
        label,
        f"block-quantised MLP {sizes.depth}x{sizes.width}, batch {sizes.batch}",
        {v: make(fn) for v, fn in variants.items()},
        ws,
        (x, y),
        n_act,
        notes="blocks along each layer's reduction dimension",
    )


def _twohead_case(name, i, label, variants, dyn, sizes) -> Case:
    x, y = nets.digits_batch(sizes.batch)
    dom = (y % 2).astype(jnp.int32)
    return Case(
        name,
        i,
        label,
        f"two-head net, width {sizes.width}, batch {sizes.batch}",
        {v: nets.twohead_loss(ft.partial(fn, dyn)) for v, fn in variants.items()},
        nets.twohead_params(sizes),
        (x, y, dom),
        sizes.batch * sizes.width,
    )


def _cnn_case(name, i, label, variants, dyn, sizes) -> Case:
    cnn = nets.small_cnn()
    images, y = nets.digits_batch(sizes.cnn_batch)
    images = images.reshape(-1, 8, 8) / 16

    def quantized_loss(fn):
        def loss(model, data):
            images, y = data
            logits = jax.vmap(model)(images[:, None])
            return nets.cross_entropy(logits, y)

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
            return nets.cross_entropy(nets.plain_cnn_forward(model, q, images), y)

        return loss

    cnn_params, cnn_static = eqx.partition(cnn, eqx.is_inexact_array)
    losses = {"eqxrules": quantized_loss(variants["eqxrules"])}
    for v, fn in variants.items():
        if v != "eqxrules":
            losses[v] = plain_loss(fn)
    losses["quantized_hand"] = quantized_loss(variants["hand"])
    if "formula_0_1_0" in variants:  # through `Quantized` too, like eqxrules
        losses["formula_0_1_0"] = quantized_loss(variants["formula_0_1_0"])
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


def _batched_case(entry, i, label, rule, variants, sizes) -> Case:
    """The rule's own example (a wrapper around a small sub-model, a softmax over a
    small axis...) on a batch of inputs from its domain, differentiated with respect
    to the rule's arrays and the inputs."""
    xs = domain_batch(entry, sizes.batch)
    dyn, _ = eqx.partition(rule, eqx.is_inexact_array)
    shapes = jax.eval_shape(
        lambda d, xs: jax.vmap(lambda x: variants["eqxrules"](d, x))(xs), dyn, xs
    )
    cts = jtu.tree_map(
        lambda s: jax.random.normal(jax.random.key(8), s.shape, s.dtype), shapes
    )

    # Differentiated in the rule's arrays and the floating-point inputs; a
    # boolean input (a mask) is held as data.
    xs, fixed = eqx.partition(xs, eqx.is_inexact_array)

    def make(fn):
        def loss(params, data):
            d, xs = params
            out = jax.vmap(lambda x: fn(d, x))(eqx.combine(xs, fixed))
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
        elements(xs),
    )


def scaled_model_cases(sizes: Sizes) -> list[Case]:
    """`ScaledModel` around an MLP, trained: gradients with respect to the MLP's
    parameters only (the input is data, so its tangent is a symbolic zero)."""
    mlp = eqx.nn.MLP(
        64, 10, sizes.width, sizes.depth, activation=jax.nn.relu, key=jax.random.key(3)
    )
    x, y = nets.digits_batch(sizes.batch)
    cases = []
    for mode in ("exact", "skip_scale", "stop_input"):
        rule = eqxrules.ScaledModel(mlp, 16.0, mode=mode)
        params, static = eqx.partition(rule, eqx.is_inexact_array)
        variants = build_variants(rule, {})

        def make(fn):
            def loss(params, data):
                x, y = data
                return nets.cross_entropy(jax.vmap(lambda x: fn(params, x))(x), y)

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
