"""Plots of each rule's value and derivative, drawn by evaluating the rule itself (as
larq's docs show them), so the picture cannot drift from the code.

Needs the optional `examples` extra (matplotlib)."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array

from ._catalogue import Entry, catalogue
from ._domain import Args, Inputs
from ._registry import entry_of

_POINTS = 401
_MISSING = (
    "`eqxrules` plots need matplotlib, which is an optional extra: "
    "pip install 'eqxrules[examples]'"
)


def _first_element(tree: Any) -> Array:
    return jnp.ravel(jtu.tree_leaves(tree)[0])[0]


def _first_example(entry: Entry) -> Any:
    return entry.examples(jax.random.key(0))[0]


def _scalar_function(entry: Entry) -> tuple[Callable[[Array], Array], str]:
    """The function of one number that the plot draws, and its axis label.

    Elementwise rules are evaluated on a scalar. Other rules are evaluated on a test
    input of their domain whose first element varies; the plot shows the first
    element of the output."""
    rule = _first_example(entry)
    kwargs = rule.call_kwargs(jax.random.key(1))
    if entry.elementwise:
        return (lambda s: _first_element(rule(s, **kwargs))), "x"
    domain = rule.input_domain()
    sample = domain.sample(jax.random.key(2))
    if isinstance(domain, Inputs):  # several inputs: one varies, the others fixed
        i, name = domain.varied, domain.names[domain.varied]
        base, rest = sample[i], "other elements and inputs fixed"
    else:
        i, name, base, rest = 0, "x", sample, "other elements fixed"

    def f(s: Array) -> Array:
        x = base.reshape(-1).at[0].set(s).reshape(base.shape)
        args = list(sample) if isinstance(sample, Args) else [x]
        args[i] = x
        return _first_element(rule(*args, **kwargs))

    return f, f"{name}[0] ({rest}); output element 0"


def _curves(entry: Entry) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    d = _first_example(entry).input_domain()
    if isinstance(d, Inputs):
        d = d.domains[d.varied]
    kinks = [k for k in d.kinks if d.low <= k <= d.high]
    # The kinks themselves are on the grid, so the value *at* each boundary shows.
    grid = np.union1d(np.linspace(d.low, d.high, _POINTS), np.asarray(kinks))
    x = jnp.asarray(grid, jnp.float32)
    f, label = _scalar_function(entry)
    value = jax.vmap(f)(x)
    derivative = jax.vmap(jax.grad(f))(x)
    return grid, np.asarray(value), np.asarray(derivative), label


def plot(
    names: Sequence[str | type | Entry] | None, out: str | pathlib.Path
) -> list[pathlib.Path]:
    """Write one PNG per rule to `out`: the value and the derivative of its first
    example on its domain (its kinks on the grid), computed with the rule and `jax.vmap(jax.grad(...))`.

    **Arguments:**

    - `names`: the rules: catalogue names (e.g. `["ste_sign"]`), catalogue
        entries, or rule classes, yours or the catalogue's (a `JVPRule` or
        `VJPRule` subclass, plotted from its first example); `None` for every
        catalogue rule.
    - `out`: the directory to write to; created if missing.

    **Returns:**

    The paths written, `out / f"{name}.png"` (a class's functional name), in the
    order of `names`.

    **Raises:**

    - `ValueError` for a name not in the catalogue (the message lists the valid
        ones).
    - `ModuleNotFoundError` if matplotlib is not installed (the message says how to
        get it).
    """
    entries = {e.name: e for e in catalogue()}
    chosen = list(entries) if names is None else list(names)
    unknown = [n for n in chosen if isinstance(n, str) and n not in entries]
    if unknown:
        raise ValueError(
            f"`plot`: unknown rule name(s) {unknown}. Valid names: "
            f"{', '.join(entries)}."
        )
    chosen_entries = [
        entries[n] if isinstance(n, str) else n if isinstance(n, Entry) else entry_of(n)
        for n in chosen
    ]
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(_MISSING, name="matplotlib") from e
    # The object-oriented API with the Agg canvas: no pyplot, no global backend.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for entry in chosen_entries:
        name = entry.name
        grid, value, derivative, label = _curves(entry)
        fig = Figure(figsize=(4.0, 2.8))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ax.plot(grid, value, label="value", linewidth=1.8)
        ax.plot(grid, derivative, "--", label="derivative", linewidth=1.5)
        ax.axhline(0.0, color="0.8", linewidth=0.6, zorder=0)
        ax.set_title(name, fontfamily="monospace")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=80)
        paths.append(path)
    return paths
