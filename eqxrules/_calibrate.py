"""`calibrate`: initialise a quantised model's learned input quantisers from the
inputs its layers see on a calibration batch, with one host callback per layer
call (not per example)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.custom_batching import custom_vmap
from jaxtyping import Array, PRNGKeyArray

from ._layers import Quantized, _initialised
from ._tangents import call_with_key

_M = TypeVar("_M")


def calibrate(
    model: _M, x: Any, *, vmap: bool = True, key: PRNGKeyArray | None = None
) -> _M:
    r"""Initialise every learned input quantiser of `model` from the input its layer
    sees on a calibration batch `x`.

    The model runs once, jitted, with each [`Quantized`][] layer's learned input
    quantiser (one with an `initialised_from` method, as [`LSQ`][] and [`PACT`][]
    have) replaced by a recorder that passes its input on unquantised and copies
    it to the host (`jax.debug.callback`, once per call of the layer, the whole
    batch at a time); each is then fitted to everything its layer saw, the
    examples in the order of their bytes, so that the fit is the same bits on
    every call (for `LSQ`, the step
    $2\,\overline{\lvert v\rvert}/\sqrt{Q_p}$; for `PACT`, $\alpha = \max v$).
    Weight quantisers are applied as they are.

    **Arguments:**

    - `model`: a model holding `Quantized` layers, e.g. from [`quantize`][].
    - `x`: a batch of inputs.
    - `vmap`: `True` (default) if `model` takes one example, so it is applied to
        the batch with `jax.vmap`; `False` to call `model(x)` as it is (a model
        that maps over the batch itself, with `jax.vmap` or otherwise).
    - `key`: a PRNG key passed to the model, if it takes one.

    **Returns:**

    A copy of `model` with its learned input quantisers fitted. Unchanged if it has
    none.

    !!! Example

        ```python
        mlp = eqx.nn.MLP(64, 10, 128, 2, key=jax.random.key(0))
        q = eqxrules.quantize(
            mlp, kernel_quantizer=eqxrules.LSQ(1.0, bits=4, axis=0),
            input_quantizer=eqxrules.LSQ(1.0, bits=4),
        )
        q = eqxrules.calibrate(q, x_train[:256])
        ```
    """

    def is_quantized(node: Any) -> bool:
        return isinstance(node, Quantized)

    def learned(m: Any) -> list[Quantized]:
        nodes = jtu.tree_leaves(m, is_leaf=is_quantized)
        return [
            n
            for n in nodes
            if is_quantized(n) and hasattr(n.input_quantizer, "initialised_from")
        ]

    layers = learned(model)
    if not layers:
        return model

    # Each recorder sends its input to the host with `jax.debug.callback`, which
    # works however the model maps over the batch (the calibration's `vmap`, the
    # model's own, a `lax.scan`, ...). Under `vmap` it is called through
    # `_recorder`, so that it sends the whole batch at once: `jax.debug.callback`
    # alone sends one example at a time, a callback per example and layer, which
    # made calibrating the digits MLP over 100 times slower.
    seen: list[list[np.ndarray]] = [[] for _ in layers]

    def recorder(i: int) -> Callable[[Array], Array]:
        def record(batch: np.ndarray, batch_axes: int) -> None:
            shape = batch.shape[batch_axes:]
            seen[i].extend(np.asarray(batch).reshape(-1, *shape))

        return _recorder(record, 0)

    recording = eqx.tree_at(
        lambda m: [n.input_quantizer for n in learned(m)],
        model,
        [recorder(i) for i in range(len(layers))],
    )

    def run(x: Any) -> Any:
        return call_with_key(recording, x, key)  # pyright: ignore[reportArgumentType]

    # One compiled program (eagerly, each operation would compile its own).
    jax.block_until_ready(eqx.filter_jit(jax.vmap(run) if vmap else run)(x))
    jax.effects_barrier()
    fitted = []
    for layer, inputs in zip(layers, seen):
        if not inputs:
            fitted.append(layer.input_quantizer)
            continue
        # Every example the layer saw, stacked along a new first axis (so an
        # `axis` of an input quantiser is best counted from the end); flattened
        # and joined if their shapes differ. The callbacks (one per call of the
        # layer) arrive in no fixed order: put the examples in one (by their
        # bytes), so that the fit, a sum in floating point, is the same bits on
        # every call.
        inputs = sorted(inputs, key=lambda a: (a.shape, a.tobytes()))
        if len({a.shape for a in inputs}) == 1:
            samples = jnp.asarray(np.stack(inputs))
        else:
            samples = jnp.asarray(np.concatenate([a.reshape(-1) for a in inputs]))
        fitted.append(_initialised(layer.input_quantizer, samples))
    return eqx.tree_at(lambda m: [n.input_quantizer for n in learned(m)], model, fitted)


def _recorder(
    record: Callable[[np.ndarray, int], None], batch_axes: int
) -> Callable[[Array], Array]:
    """The identity, sending its input to the host as `record(input, batch_axes)`:
    the input as one array, whose first `batch_axes` axes are those of the
    `vmap`s it is called under (each `vmap` adds one, in front), so that each
    example's part of it is `input[i, j, ...]`."""

    @custom_vmap
    def identity(h: Array) -> Array:
        jax.debug.callback(lambda a: record(a, batch_axes), h)
        return h

    @identity.def_vmap
    def batched(axis_size: int, in_batched: list[bool], h: Array) -> Any:
        # (`jax.debug.callback`'s own rule would call it once per example.)
        (is_batched,) = in_batched
        more = batch_axes + 1 if is_batched else batch_axes
        return _recorder(record, more)(h), is_batched

    return identity
