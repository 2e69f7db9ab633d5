"""Bytes saved for the backward pass per activation element.

Outside jit (`saved_residuals`) and inside it (`memory_analysis` of the jitted
forward), against what an elementwise rule's backward pass needs at least."""

from __future__ import annotations

import functools as ft
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import report, xla
from ..baselines import VARIANTS, build_variants
from ..cases import classify, domain_batch, elements, rule_label
from ..config import Job

NAME = "residuals"
DEFAULT = True


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


def run(job: Job) -> dict[str, Any]:
    sizes = job.sizes
    rows = []
    for entry in job.entries:
        examples = entry.examples(jax.random.key(0))
        for i, rule in enumerate(examples if job.all_examples else examples[:1]):
            kw = rule.call_kwargs(jax.random.key(1))
            dyn, _ = eqx.partition(rule, eqx.is_inexact_array)
            kind = classify(rule, kw, sizes.width)
            if kind == "batched":
                x = domain_batch(entry, sizes.batch)
                wrap = lambda fn: lambda x: jax.vmap(lambda e: fn(dyn, e))(x)  # noqa: E731
            else:
                x = 1.5 * jax.random.normal(
                    jax.random.key(7), (sizes.batch, sizes.width)
                )
                wrap = lambda fn: ft.partial(fn, dyn)  # noqa: E731
            row: dict[str, Any] = dict(
                entry=entry.name,
                example=i,
                rule=rule_label(rule),
                elements=elements(x),
                needed=_needed_bytes(entry, rule, kw, x) if kind != "batched" else None,
                variants={},
            )
            for v, fn in build_variants(rule, kw).items():
                row["variants"][v] = _saved(wrap(fn), x)
            rows.append(row)
            job.log(f"  {entry.name} #{i}")
    return dict(rows=rows)


def _saved(f: Any, x: jax.Array) -> dict[str, Any]:
    """Bytes per element of `x` that `jax.vjp(f, x)` keeps, outside jit and in."""
    try:
        saved = xla.saved_residuals(f, x)
        outside = sum(
            int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a, _ in saved
        )
        forward = jax.jit(lambda x: jax.vjp(f, x))
        mem = forward.lower(x).compile().memory_analysis()
        inside = mem.output_size_in_bytes - xla.nbytes(jax.eval_shape(f, x))
    except Exception as e:
        return dict(error=f"{type(e).__name__}: {e}"[:160])
    return dict(
        outside=outside / elements(x),
        inside=inside / elements(x),
        saved=[
            f"{a.str_short(short_dtypes=True)} {_short_source(s)}" for a, s in saved
        ],
    )


def _short_source(s: str) -> str:
    s = re.sub(r"/[^ ]*/", "", s)
    return s[:90]


def _cell(x: dict[str, Any] | None) -> str:
    if x is None:
        return "n/a"
    if "error" in x:
        return "error"
    return f"{x['outside']:.2f} / {x['inside']:.2f}"


def render(res: dict[str, Any] | None, results: dict[str, Any]) -> list[str]:
    if res is None:
        return []
    lines = report.opening(NAME, res, results)
    flagged = []
    for r in res["rows"]:
        cells = [_cell(r["variants"].get(v)) for v in VARIANTS]
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
        lines += report.fill(NAME, "flagged")
        for r in flagged:
            o = r["variants"]["eqxrules"]
            lines += report.fill(NAME, "flagged_rule", r=r, o=o)
        lines.append("")
    return lines
