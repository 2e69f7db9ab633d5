"""Sharding on 8 simulated CPU devices (issue 5, situation 12).

`tests/sharding_worker.py` runs every catalogue example under `jax.jit` with a
`NamedSharding` over a batch axis and under `jax.shard_map`, and compares loss and
gradients with a single-device run; then it runs `examples/data_parallel.py`. It
needs `XLA_FLAGS=--xla_force_host_platform_device_count=8` before JAX starts, so it
runs in one subprocess (one start-up for every entry), and this process keeps its
one device.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest
from conftest import once_per_session

import eqxrules

# The slow tier: an 8-device subprocess. Each entry's first example also runs at the
# minimum versions in CI (tests/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.catalogue_wide]

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "sharding_worker.py"
# Run by the worker with `main(quick=True)`, and as a script by the slow test.
EXAMPLE = "data_parallel"
ENTRIES = eqxrules.catalogue()
# The worker subprocess runs once per test session, whichever xdist worker asks
# first (`once_per_session`): not once per worker, nor again when a worker comes
# back to this module after another.


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env.update(extra)
    return env


EIGHT = "--xla_force_host_platform_device_count=8"


def _own_xla_flags() -> str:
    """`XLA_FLAGS` of this process, less any device count."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return " ".join(f for f in flags if "device_count" not in f)


def _run_worker() -> dict:
    proc = subprocess.run(
        [sys.executable, str(WORKER)],
        cwd=ROOT,
        # This process's own XLA flags (CI's slow tier compiles with the older
        # CPU emitters, which halves the worker's compile time), and 8 devices.
        env=_env(XLA_FLAGS=f"{_own_xla_flags()} {EIGHT}".strip()),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def sharded() -> dict:
    return once_per_session("sharding_worker", _run_worker)


def test_worker_has_eight_devices_and_this_process_one(sharded):
    assert sharded["devices"] == 8
    assert len(jax.devices()) == 1


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_entry_sharded_equals_unsharded(sharded, entry):
    """Every example of the entry: loss and gradients under `jit` with a
    `NamedSharding` over the batch, and under `shard_map`, equal one device's."""
    result = sharded["entries"][entry.name]
    assert result["examples"] == len(entry.examples(jax.random.key(0)))
    assert result["failures"] == []


def test_data_parallel_example_matches_single_device(sharded):
    figures = sharded["data_parallel"]
    assert "error" not in figures, figures.get("error")
    assert figures["devices"] == 8
    assert figures["matches"] and figures["max_rel_diff"] <= 1e-5


@pytest.mark.slow
def test_data_parallel_script_sets_its_own_devices():
    """Run as a script with no `XLA_FLAGS`, the example simulates its 8 devices
    itself and says that the losses match."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / f"{EXAMPLE}.py"), "--quick"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "split over 8 devices" in proc.stdout
    assert "loss matches the single-device run" in proc.stdout


QDOT_RECIPES = (
    "identity",
    "mxfp8",
    "fp8",
    "nvfp4",
    "nvfp4_1d_nearest_rht",
    "stochastic_round",
)
PLANTED_QDOT = "planted_straddling_blocks"


def test_quantized_dot_sharded_equals_one_device(sharded):
    """Value and cotangents of a `vmap`ped `quantized_dot` under `jit`, the batch
    sharded over 8 devices and on one, each within the float32 bound of the
    reference (per-tensor scales over the whole batch)."""
    results = sharded["quantized_dot"]
    for name in (*QDOT_RECIPES, PLANTED_QDOT):
        assert results[name]["failures"] == [], name


def test_quantized_dot_under_shard_map_is_each_devices_own(sharded):
    """Under `shard_map`, with `axis_name` naming the devices' own `vmap` alone,
    each device's value and input cotangent are the reference of its own rows, and
    the weight's cotangent is their sum, taken once (a sum taken twice, planted,
    is caught)."""
    results = sharded["quantized_dot"]["shard_map"]
    for name in QDOT_RECIPES:
        assert results[name] == [], name
    planted = results["planted_weight_cotangent_summed_twice"]
    assert len(planted) == 1 and planted[0].startswith("dw: "), planted


SPANNED = ("identity", "mxfp8", "fp8", "nvfp4_1d_nearest_rht")


def test_quantized_dot_under_shard_map_spans_the_devices_by_name(sharded):
    """With `axis_name` naming the mesh axis too, per-tensor scales span the
    devices and the blocks stay within each device's rows (32, whole blocks):
    value and summed cotangents are the whole batch's reference. The same program
    without the mesh axis's name (per-tensor scales each device's own, `fp8()`) is
    caught; and the spanning costs all-reduces of scalars only, beside the weight
    cotangent's sum."""
    results = sharded["quantized_dot"]["shard_map"]
    for name in SPANNED:
        assert results[f"spanned_{name}"] == [], name
    planted = results["planted_scales_not_spanned"]
    assert {p.split(":")[0] for p in planted} == {"y", "dx", "dw"}, planted
    ops = results["spanned_fp8_collectives"]
    assert all(op == "all-reduce" for op, _ in ops), ops
    big = [sizes for _, sizes in ops if max(sizes) > 1]
    assert big == [[64 * 64]], ops  # the weight's cotangent
    assert len(ops) > 1, ops  # and the scales' maxima


def test_models_under_shard_map_train_as_on_one_device(sharded):
    """A 2-layer MLP and a 2-layer CNN quantised with `axis_name=("batch",
    "examples")` under `shard_map` over 8 devices: the loss and every gradient
    bit for bit those of one device (exact dyadic data, power-of-two scales);
    weight-gradient blocks straddling two devices (planted) are caught."""
    for model, results in sharded["models"].items():
        assert results["identity"] == [] and results["mxfp8"] == [], model
        assert results["planted_straddling_blocks"] != [], model


def extra_collectives(ours: list, plain: list) -> list:
    """The collectives of `ours` beyond `plain`'s (each `[op, operand sizes]`):
    any op `plain` lacks, and any all-reduce of more than scalars that `plain`
    does not have. Scalar all-reduces (a per-tensor scale's global amax) pass."""
    ops = {op for op, _ in plain}
    big = sorted(size for _, sizes in plain for size in sizes if size > 1)
    extra = [c for c in ours if c[0] not in ops]
    ours_big = sorted(
        size for op, sizes in ours if op in ops for size in sizes if size > 1
    )
    if ours_big != big:
        extra.append(["all-reduce sizes", ours_big])
    return extra


def test_quantized_dot_needs_no_collective_beyond_jnp_dots(sharded):
    results = sharded["quantized_dot"]
    for name in QDOT_RECIPES:
        plain = results[name]["plain"]
        assert plain == [["all-reduce", [64 * 64]]]  # the weight's cotangent, summed
        assert extra_collectives(results[name]["collectives"], plain) == [], name
    # NVFP4's per-tensor scales: all-reduces of eight scalars in all, nothing of
    # the batch's size: the global amax of x, dy and, rotated, of both again, and
    # beside each its any-NaN flag (`amax` makes a NaN anywhere the scale's, as
    # XLA's CPU `max` of 4096 elements or more would drop it); XLA may combine
    # them into fewer all-reduces.
    nvfp4 = results["nvfp4_1d_nearest_rht"]["collectives"]
    scalars = [(op, size) for op, sizes in nvfp4 if max(sizes) == 1 for size in sizes]
    assert scalars == [("all-reduce", 1)] * 8


def test_the_collective_check_catches_blocks_straddling_devices(sharded):
    planted = sharded["quantized_dot"][PLANTED_QDOT]
    assert extra_collectives(planted["collectives"], planted["plain"]) != []


QCONV_RECIPES = ("identity", "mxfp8", "fp8", "nvfp4")


def test_quantized_conv_sharded_equals_one_device(sharded):
    """Value and cotangents of a `vmap`ped `quantized_conv` under `jit`, the batch
    sharded over 8 devices, equal the one-device run's within the float32 bound
    (per-tensor scales and blocks over the whole batch); the planted straddling
    blocks too (only their collectives differ)."""
    results = sharded["quantized_conv"]
    for name in (*QCONV_RECIPES, PLANTED_QDOT):
        assert results[name]["failures"] == [], name


def test_quantized_conv_needs_no_collective_beyond_a_plain_convs(sharded):
    results = sharded["quantized_conv"]
    for name in QCONV_RECIPES:
        plain = results[name]["plain"]
        assert plain == [["all-reduce", [32 * 32 * 3 * 3]]]  # the kernel's cotangent
        assert extra_collectives(results[name]["collectives"], plain) == [], name
    planted = results[PLANTED_QDOT]
    assert extra_collectives(planted["collectives"], planted["plain"]) != []
