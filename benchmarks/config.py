"""Problem sizes, and what a section's `run` is given."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
"""The repository root: where subprocesses run and where the report goes."""


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
    checker_rounds: int  # rounds of one fresh process per way of checking
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
    checker_rounds=5,
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
    checker_rounds=1,
    checker_warm=2,
    seeds=2,
    target_s=0.02,
    copy_mib=16,
    train_steps=5,
)


@dataclasses.dataclass(frozen=True)
class Job:
    """What a section's `run` is given: the sizes and the command line's choices."""

    sizes: Sizes
    quick: bool
    entries: Sequence[Any]  # the catalogue entries of `--rules`
    binariser: Any  # the rule of the binarised net (`--binariser`), an instance
    all_examples: bool  # every example of each rule, not just the first
    log: Callable[[str], None]
    previous: dict[str, Any] | None = None  # this section's saved figures (`--merge`)
    save: Callable[[dict[str, Any]], None] = lambda figures: None
    """Saves this section's figures so far (with `--merge` or `--json`), for a long
    section to keep each figure as it is measured."""
