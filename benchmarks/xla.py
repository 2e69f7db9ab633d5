"""Measuring: XLA's own figures for a compiled program, the programs themselves, and
wall time as interleaved A/B pairs."""

from __future__ import annotations

import collections
import difflib
import math
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np


def figures(fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
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


def deterministic(figs: dict[str, Any]) -> dict[str, Any]:
    """The figures of `figures` that go into the report: no executable."""
    return {k: figs[k] for k in ("flops", "bytes", "temp")}


def seconds_per_call(fn: Callable[..., Any], args: tuple[Any, ...], reps: int) -> float:
    start = time.perf_counter()
    out = None
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps


def ratio_summary(ratios: list[float]) -> dict[str, float]:
    return dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios))


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
    single = min(seconds_per_call(fa, args, 1), seconds_per_call(fb, args, 1))
    reps = max(1, math.ceil(target_s / max(single, 1e-6)))
    ratios, ta, tb = [], [], []
    for i in range(pairs):
        if i % 2 == 0:
            a, b = seconds_per_call(fa, args, reps), seconds_per_call(fb, args, reps)
        else:
            b, a = seconds_per_call(fb, args, reps), seconds_per_call(fa, args, reps)
        ratios.append(a / b)
        ta.append(a)
        tb.append(b)
    return dict(
        **ratio_summary(ratios),
        a_s=statistics.median(ta),
        b_s=statistics.median(tb),
        pairs=pairs,
        reps=reps,
    )


def nbytes(tree: Any) -> int:
    return sum(
        int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
        for x in jtu.tree_leaves(tree)
    )


def saved_residuals(f: Callable[..., Any], *args: Any) -> list[tuple[Any, str]]:
    """What `jax.vjp(f, *args)` saves for the backward pass, each with its source."""
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
