"""Every catalogue rule inside a jitted forward+backward, against the baselines.

A binarised or quantised MLP, a small CNN through `Quantized`, a two-head net for
the rules whose value is the identity, `ScaledModel` around an MLP, and a batch of
the rule's own examples for the rest; against a plain `jax.custom_jvp`/`custom_vjp`
with the rule's own maths, one written from the rule's reference functions, and the
`stop_gradient` trick. XLA `cost_analysis()` flops and bytes and `memory_analysis()`
temp bytes (deterministic), and wall time as the median of interleaved A/B pairs."""

from __future__ import annotations

import statistics
from typing import Any

import jax

from .. import report, xla
from ..cases import Case, cases_for, scaled_model_cases
from ..config import Job

NAME = "overhead"
DEFAULT = True


def run(job: Job) -> dict[str, Any]:
    cases: list[Case] = []
    for entry in job.entries:
        n = len(entry.examples(jax.random.key(0)))
        if entry.name == "scaled_call":
            cases += scaled_model_cases(job.sizes)
            continue
        cases += cases_for(entry, job.sizes, range(n) if job.all_examples else [0])
    return dict(rows=[_measure(case, job) for case in cases])


def _measure(case: Case, job: Job) -> dict[str, Any]:
    job.log(f"  {case.entry} #{case.example}: {case.scenario}")
    figures: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for v, loss in case.losses.items():
        try:
            figures[v] = xla.figures(jax.value_and_grad(loss), case.params, case.data)
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
        figures={v: xla.deterministic(f) for v, f in figures.items()},
        wall={},
        hlo_diff={},
        same_program={},
    )
    if ours is None:
        return row
    for v in ("hand", "quantized_hand"):
        if v not in figures:
            continue
        theirs = figures[v]
        row["same_program"][v] = xla.same_program(ours["compiled"], theirs["compiled"])
        if theirs["flops"] != ours["flops"] or theirs["temp"] != ours["temp"]:
            row["hlo_diff"][v] = xla.hlo_diff(ours["compiled"], theirs["compiled"])
    # Wall time for the first example of each rule (every ScaledModel mode).
    if case.example <= 0:
        for v in ("hand", "hand_ref", "trick"):
            if v in figures:
                row["wall"][v] = xla.interleaved(
                    ours["compiled"],
                    figures[v]["compiled"],
                    (case.params, case.data),
                    job.sizes.pairs,
                    job.sizes.target_s,
                )
    return row


def render(res: dict[str, Any] | None, results: dict[str, Any]) -> list[str]:
    if res is None:
        return []
    rows = res["rows"]
    lines = report.opening(NAME, res, results)
    lines += [_figures_row(r) for r in rows]
    quantized = [r for r in rows if "quantized_hand" in r["figures"]]
    if quantized:
        lines += report.fill(NAME, "quantized")
        for r in quantized:
            o, q = r["figures"]["eqxrules"], r["figures"]["quantized_hand"]
            lines.append(
                f"| `{r['entry']}` {r['rule']} | {report.ratio(o['flops'], q['flops'])} "
                f"| {report.ratio(o['temp'], q['temp'])} |"
            )
    grid = [r for r in rows if "formula_0_1_0" in r["figures"]]
    if grid:
        lines += report.fill(NAME, "grid")
        for r in grid:
            o, g = r["figures"]["eqxrules"], r["figures"]["formula_0_1_0"]
            lines.append(
                f"| `{r['entry']}` {r['rule']} | {r['scenario']} | "
                f"{report.ratio(o['flops'], g['flops'])} | "
                f"{report.ratio(o['temp'], g['temp'])} |"
            )
    errors = [(r, v, e) for r in rows for v, e in r["errors"].items()]
    if errors:
        lines += report.fill(NAME, "errors")
        lines += [f"- `{r['entry']}` {r['rule']}, {v}: {e}" for r, v, e in errors]
    lines += report.fill(NAME, "wall")
    lines += [_wall_row(r) for r in rows if r["wall"]]
    return lines + report.fill(NAME, "goals") + _goals(rows) + [""]


def _figures_row(r: dict[str, Any]) -> str:
    f = r["figures"]
    o = f.get("eqxrules")
    if o is None:
        return (
            f"| `{r['entry']}` | {r['rule']} | {r['scenario']} | error: "
            f"{r['errors'].get('eqxrules')} |" + " |" * 8
        )

    def rat(v, k):
        return report.ratio(o[k], f[v][k]) if v in f else "n/a"

    return (
        f"| `{r['entry']}` | {r['rule']} | {r['scenario']} | {o['flops']:.4g} | "
        f"{report.mib(o['temp'])} | {rat('hand', 'flops')} | {rat('hand', 'bytes')} | "
        f"{rat('hand', 'temp')} | {rat('hand_ref', 'flops')} | "
        f"{rat('hand_ref', 'temp')} | {rat('trick', 'flops')} | "
        f"{rat('trick', 'temp')} |"
    )


def _wall_row(r: dict[str, Any]) -> str:
    w = r["wall"]
    ms = next(iter(w.values()))["a_s"] * 1e3
    sp = r.get("same_program", {})
    if "hand" not in sp:
        same = "-"
    elif sp["hand"]:
        same = "yes"
    elif sp.get("quantized_hand"):
        same = "as `Quantized` + hand: yes"
    else:
        same = "no"
    return (
        f"| `{r['entry']}` {r['rule']} | {r['scenario']} | {ms:.2f} | "
        f"{report.spread(w.get('hand'))} | {same} | "
        f"{report.spread(w.get('hand_ref'))} | {report.spread(w.get('trick'))} |"
    )


def _goals(rows: list[dict[str, Any]]) -> list[str]:
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
    lines = report.fill(
        NAME,
        "goal_hand",
        total=sum(len(v) for v in verdicts.values()),
        **{k: len(v) for k, v in verdicts.items()},
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
    return lines + _goal_same_program(rows) + _goals_against(rows)


def _goal_same_program(rows: list[dict[str, Any]]) -> list[str]:
    plain = [r for r in rows if "hand" in r.get("same_program", {})]
    plain = [r for r in plain if "quantized_hand" not in r["same_program"]]
    layered = [r for r in rows if "quantized_hand" in r.get("same_program", {})]
    lines = []
    if plain or layered:
        rescheduled = [
            r
            for r in layered
            if r["same_program"]["hand"]
            and r["figures"]["eqxrules"]["temp"] != r["figures"]["hand"]["temp"]
        ]
        lines += report.fill(
            NAME,
            "goal_same_program",
            plain_same=sum(r["same_program"]["hand"] for r in plain),
            plain=len(plain),
            layered_same=sum(r["same_program"]["hand"] for r in layered),
            layered=len(layered),
            rescheduled=len(rescheduled),
            layered_same_quantized=sum(
                r["same_program"]["quantized_hand"] for r in layered
            ),
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
        lines += report.fill(NAME, "goal_quantized", same=len(same), total=len(q))
    return lines


def _goals_against(rows: list[dict[str, Any]]) -> list[str]:
    """How often eqxrules is within a bound of a baseline, for three figures."""
    lines = []
    for block, bound, values in (
        (
            "goal_wall",
            1.02,
            [r["wall"]["hand"]["median"] for r in rows if "hand" in r["wall"]],
        ),
        (
            "goal_trick_wall",
            1.0,
            [r["wall"]["trick"]["median"] for r in rows if "trick" in r["wall"]],
        ),
        (
            "goal_trick_flops",
            1.0,
            [
                r["figures"]["eqxrules"]["flops"] / r["figures"]["trick"]["flops"]
                for r in rows
                if "trick" in r["figures"] and "eqxrules" in r["figures"]
            ],
        ),
    ):
        if values:
            lines += report.fill(
                NAME,
                block,
                within=sum(1 for x in values if x <= bound),
                total=len(values),
                median=statistics.median(values),
                min=min(values),
                max=max(values),
            )
    same = [
        r["figures"]
        for r in rows
        if "trick_same" in r["figures"] and "eqxrules" in r["figures"]
    ]
    if same:
        ratios = [f["eqxrules"]["flops"] / f["trick_same"]["flops"] for f in same]
        lines += report.fill(
            NAME,
            "goal_trick_same",
            within=sum(
                f["eqxrules"]["flops"] <= f["trick_same"]["flops"]
                and f["eqxrules"]["temp"] <= f["trick_same"]["temp"]
                for f in same
            ),
            total=len(same),
            min=min(ratios),
            max=max(ratios),
        )
    return lines
