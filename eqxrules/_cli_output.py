"""What the command line prints: tables, rows, quiet warnings."""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence

import jax

from .testing import CHECKS

_SYMBOL = {"passed": "ok", "failed": "FAIL", "unsupported": "n/a", "skipped": "-"}
# Column names where a check's own name is too wide for the table.
_SHORT = {
    "linearity": "linear",
    "transpose": "transp",
    "finite_differences": "fd",
    "held_fixed": "held",
    "batching": "vmap",
    "zero_cotangent": "zero",
    "second_order": "2nd",
}
_LEGEND = "ok = passed, FAIL = failed, n/a = mode not supported, - = not applicable"
_MODES_WIDTH = len("fwd+rev")
_SEED_LIMIT = 2**63  # `jax.random.key` takes a seed that fits an int64


def _count(n: int, noun: str) -> str:
    """`n` and `noun`, plural unless `n` is 1: "1 rule", "2 rules"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _say(*lines: str, err: bool = False) -> None:
    """Print and flush at once, so that a pipe or a CI log sees each line as it
    happens, not when the buffer fills."""
    stream = sys.stderr if err else sys.stdout
    for line in lines:
        print(line, file=stream, flush=True)


@contextlib.contextmanager
def _no_warnings(verbose: bool) -> Iterator[None]:
    """Keep warnings raised while checking (NumPy's divide-by-zero in a relative
    error where the reference is 0, say) off the terminal: the report says what
    went wrong. With `--verbose` each distinct warning is shown once, as a note."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    if verbose:
        seen = dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught)
        _say(*(f"note: a check warned {w}" for w in seen), err=True)


def _device_line() -> str:
    devices = jax.devices()
    d = devices[0]
    return (
        f"JAX {jax.__version__} on backend {jax.default_backend()!r}: "
        f"{len(devices)} x {d.device_kind} ({d.platform})"
    )


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([_line(header, widths), rule, *(_line(r, widths) for r in rows)])


def _header() -> list[str]:
    return ["rule", "modes", *(_SHORT.get(c, c) for c in CHECKS), "time"]


def _row(name: str, modes: str, status: Callable[[str], str], seconds: float):
    return [name, modes, *(_SYMBOL[status(c)] for c in CHECKS), f"{seconds:.2f}s"]


def _stream_widths(names: Sequence[str]) -> list[int]:
    """Column widths fixed before any rule is verified, so that each row can be
    printed as soon as its rule is done."""
    symbol = max(len(s) for s in _SYMBOL.values())
    name, modes, *checks, time = _header()
    return [
        max(len(name), *(len(n) for n in names)),
        max(len(modes), _MODES_WIDTH),
        *(max(len(h), symbol) for h in checks),
        len(time),  # the last column: nothing after it to align
    ]
