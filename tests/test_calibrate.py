"""`calibrate` (issue 18): the same fit as 0.2.0's, bit for bit, with one host
callback per layer call instead of one per example and layer (what made it cost
tens of milliseconds an example).

The reference below is 0.2.0's `calibrate`, kept whole: a recorder per layer that
sends each example to the host with `jax.debug.callback` (whose `vmap` rule calls
it once per example), the examples sorted by their bytes, stacked, and the
quantiser fitted with its own `initialised_from`."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import eqxrules


def _calibrate_0_2_0(model, x, *, vmap=True):
    def learned(m):
        nodes = jtu.tree_leaves(m, is_leaf=lambda n: isinstance(n, eqxrules.Quantized))
        return [
            n
            for n in nodes
            if isinstance(n, eqxrules.Quantized)
            and hasattr(n.input_quantizer, "initialised_from")
        ]

    layers = learned(model)
    seen = [[] for _ in layers]

    def recorder(i):
        def record(h):
            jax.debug.callback(lambda a: seen[i].append(np.asarray(a)), h)
            return h

        return record

    recording = eqx.tree_at(
        lambda m: [n.input_quantizer for n in learned(m)],
        model,
        [recorder(i) for i in range(len(layers))],
    )

    def run(x):
        return recording(x)

    jax.block_until_ready(eqx.filter_jit(jax.vmap(run) if vmap else run)(x))
    jax.effects_barrier()
    fitted = []
    for layer, inputs in zip(layers, seen):
        inputs = sorted(inputs, key=lambda a: (a.shape, a.tobytes()))
        if len({a.shape for a in inputs}) == 1:
            samples = jnp.asarray(np.stack(inputs))
        else:
            samples = jnp.asarray(np.concatenate([a.reshape(-1) for a in inputs]))
        fitted.append(layer.input_quantizer.initialised_from(samples))
    return eqx.tree_at(lambda m: [n.input_quantizer for n in learned(m)], model, fitted)


def _digits_mlp(input_quantizer):
    """The digits MLP of examples/qat_digits.py (64 → 32 → 32 → 10, ReLU)."""
    return eqxrules.quantize(
        eqx.nn.MLP(64, 10, 32, 2, key=jax.random.key(0)),
        kernel_quantizer=eqxrules.LSQ(1.0, bits=4, axis=0),
        input_quantizer=input_quantizer,
    )


def _pixels(n):
    # Like the digits: 17 grey levels in [0, 1], so many inputs tie and the sort
    # meets equal elements.
    return jax.random.randint(jax.random.key(1), (n, 64), 0, 17) / 16.0


class _Recurrent(eqx.Module):
    """One `Quantized` layer applied three times in a `lax.scan`: its recorder is
    called inside a loop, three times per example."""

    cell: eqxrules.Quantized

    def __call__(self, x):
        def step(h, _):
            return jnp.tanh(self.cell(h)), None

        return jax.lax.scan(step, x, None, length=3)[0]


class _Batched(eqx.Module):
    """A model that takes the batch and maps over it itself (`vmap=False`)."""

    model: eqx.Module

    def __call__(self, x):
        return jax.vmap(jax.vmap(self.model))(x.reshape(4, -1, x.shape[-1]))


def _recurrent():
    return _Recurrent(
        eqxrules.Quantized(
            eqx.nn.Linear(64, 64, key=jax.random.key(2)),
            input_quantizer=eqxrules.LSQ(1.0, bits=3),
        )
    )


def _lsq():
    return eqxrules.LSQ(1.0, bits=4, signed=False)


# Each case's builder, called by the test that takes it (not at collection: the
# models are built and the pixels sampled with eager JAX ops, seconds in all).
_CASES = {
    "lsq": lambda: (_digits_mlp(_lsq()), _pixels(64), True),
    "pact": lambda: (_digits_mlp(eqxrules.PACT(1.0, bits=2)), _pixels(64), True),
    "lsq-per-channel": lambda: (
        _digits_mlp(eqxrules.LSQ(1.0, bits=4, axis=-1)),
        _pixels(64),
        True,
    ),
    "scan": lambda: (_recurrent(), _pixels(32), True),
    "nested-vmap": lambda: (_Batched(_digits_mlp(_lsq())), _pixels(64), False),
}


def _case(name):
    """`(model, x, vmap)` for the case `name`."""
    return _CASES[name]()


def _bits(model):
    return [
        np.asarray(a).tobytes()
        for a in jtu.tree_leaves(eqx.filter(model, eqx.is_array))
    ]


@pytest.mark.slow
@pytest.mark.first_case_quick
@pytest.mark.parametrize("case", list(_CASES))
def test_calibrate_is_0_2_0_bit_for_bit(case):
    """Every array of the calibrated model (each fitted step, each alpha, the
    weights) has the bits 0.2.0's `calibrate` gave: per tensor, per channel, PACT,
    a layer called in a `lax.scan`, and a model that maps over the batch itself
    (two nested `vmap`s)."""
    model, x, vmap = _case(case)
    got = eqxrules.calibrate(model, x, vmap=vmap)
    want = _calibrate_0_2_0(model, x, vmap=vmap)
    assert _bits(got) == _bits(want)
    assert _bits(got) != _bits(model)  # something was fitted


def test_the_bit_comparison_can_fail():
    """Planted defect: a `calibrate` that fits the examples in the batch's order
    (what one callback per batch gives) rather than sorted by their bytes, as 0.2.0
    did, differs in the last bits on the "lsq" case, so the comparison above
    catches a `calibrate` that dropped the sort. On the CPU, which every JAX has,
    whose float32 sums of this data depend on their order (the H200's gave the
    same bits in both orders: there the sort changes nothing)."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        model, x, _ = _case("lsq")  # its arrays made on the CPU
        hidden = np.asarray(jax.vmap(lambda v: jax.nn.relu(model.layers[0](v)))(x))
        in_order = np.stack(sorted(hidden, key=lambda a: a.tobytes()))
        quantizer = model.layers[1].input_quantizer
        fits = [
            quantizer.initialised_from(jax.device_put(h, cpu))
            for h in (in_order, hidden)
        ]
    assert _bits(fits[0]) != _bits(fits[1])


@pytest.fixture
def host_calls(monkeypatch):
    """The number of times `jax.debug.callback`'s callbacks run on the host."""
    calls = []
    original = jax.debug.callback

    def counting(callback, *args, **kwargs):
        def counted(*a, **k):
            calls.append(1)
            return callback(*a, **k)

        return original(counted, *args, **kwargs)

    monkeypatch.setattr(jax.debug, "callback", counting)
    return calls


@pytest.mark.slow
def test_calibrate_calls_the_host_once_per_layer_call(host_calls):
    """The digits MLP on 64 examples: 3 host callbacks (one per layer), however
    many examples; 0.2.0 made one per example and layer, 192 (the planted
    defect: the same count fails the bound). A layer in a 3-step `lax.scan`: 3."""
    model, x, _ = _case("lsq")
    eqxrules.calibrate(model, x[:64])
    assert len(host_calls) == len(model.layers) == 3
    host_calls.clear()
    _calibrate_0_2_0(model, x[:64])
    assert len(host_calls) == 64 * 3
    host_calls.clear()
    recurrent, x, _ = _case("scan")
    eqxrules.calibrate(recurrent, x)
    assert len(host_calls) == 3
