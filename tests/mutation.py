"""Mutation check of the test suite: plant defects in copies of rules and check that
the catalogue suite catches each one.

Each mutation is applied to a fresh copy of the package and its tests in a
temporary directory (the working tree is never touched), either by editing one line
of a rule's source or by appending a patch that wraps one method of a rule class.
The suite then runs in that copy, in stages, cheapest first, restricted with `-k`
to the mutated rule's entry:

1. `tests/test_catalogue.py` (the `check_rule` battery, the hypothesis property, the
   dtypes, integer input, reverse-only naming);
2. `tests/test_nonfinite.py` (zero derivatives beside non-finite values);
3. `tests/test_matrix.py` (the transformation matrix).

A mutation is *caught* when a stage fails; it *survives* when every stage passes.
A mutation whose target text is not in the source any more is an *error* (the table
below is stale), as is a control run (no mutation) that fails.

Run: python tests/mutation.py [--only NAME ...] [--no-control] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
STAGES = ("tests/test_catalogue.py", "tests/test_nonfinite.py", "tests/test_matrix.py")

# Appended to a rule's module: wrap `method` of `cls`, mapping its result through
# `wrap` (a function of the result).
_PATCH = """

def _mutant_patch():
    import functools as _functools

    import jax as _jax
    import jax.numpy as _jnp

    original = {cls}.{method}

    @_functools.wraps(original)  # keeps the signature the registry reads
    def mutated(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        return _jax.tree_util.tree_map({wrap}, result)

    {cls}.{method} = mutated


_mutant_patch()
"""

SCALE = "lambda t: t * 1.5"
TO_FLOAT32 = "lambda t: t.astype(_jnp.float32) if hasattr(t, 'astype') else t"


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One planted defect. `old` is replaced by `new` (exactly one occurrence) in
    `path`; with `old` empty, `new` is appended."""

    name: str
    kind: str
    entry: str
    path: str
    old: str
    new: str

    def apply(self, root: pathlib.Path) -> None:
        file = root / self.path
        text = file.read_text()
        if not self.old:
            file.write_text(text + self.new)
            return
        count = text.count(self.old)
        if count != 1:
            raise LookupError(
                f"`{self.name}`: expected `{self.old}` once in {self.path}, found it "
                f"{count} times: the mutation table is stale"
            )
        file.write_text(text.replace(self.old, self.new))


def _patch(name, kind, entry, path, cls, method, wrap) -> Mutation:
    return Mutation(
        name,
        kind,
        entry,
        path,
        "",
        _PATCH.format(cls=cls, method=method, wrap=wrap),
    )


SIGN = "eqxrules/_rules/sign.py"
QU = "eqxrules/_rules/quantize.py"
CA = "eqxrules/_rules/categorical.py"
SG = "eqxrules/_rules/stop_gradient.py"
GR = "eqxrules/_rules/gradient.py"
SC = "eqxrules/_rules/scaled.py"
PA = "eqxrules/_rules/_paths.py"
CAT = "eqxrules/_catalogue.py"
LE = "eqxrules/_rules/learned.py"
FMT = "eqxrules/_rules/_formats.py"
BL = "eqxrules/_rules/blocks.py"

MUTATIONS = [
    # Flip a boundary from <= to < (or >= to >).
    Mutation(
        "boundary-clip-mask",
        "boundary",
        "ste_sign",
        SIGN,
        "return None if c is None else jnp.abs(x.astype(wide(x.dtype))) <= np.float32(c)",
        "return None if c is None else jnp.abs(x.astype(wide(x.dtype))) < np.float32(c)",
    ),
    Mutation(
        "boundary-ste_quantize-hi",
        "boundary",
        "ste_quantize",
        QU,
        "return within(x, self.lo, self.hi)",
        "return within(x, self.lo, self.hi) & (x < self.hi)",
    ),
    Mutation(
        "boundary-dorefa-one",
        "boundary",
        "dorefa_quantize",
        QU,
        "return within(x, 0.0, 1.0)",
        "return within(x, 0.0, 1.0) & (x < 1)",
    ),
    Mutation(
        "boundary-ternary-threshold",
        "boundary",
        "ste_ternary",
        SIGN,
        "jnp.where(w >= th, 1, jnp.where(w <= -th, -1, 0))",
        "jnp.where(w > th, 1, jnp.where(w <= -th, -1, 0))",
    ),
    # Round a float format's ties half away from zero, not to even.
    Mutation(
        "float-round-half-away",
        "float rounding",
        "float_quantize",
        FMT,
        "return jnp.round(y * pow2(-k)) * pow2(k)",
        "v = y * pow2(-k)\n    return jnp.sign(v) * jnp.floor(jnp.abs(v) + 0.5) * pow2(k)",
    ),
    # Take an MX block's shared exponent with ceil instead of floor.
    Mutation(
        "mx-scale-ceil",
        "block scale",
        "mx_quantize",
        BL,
        "k = ((bits + carry) >> 23) - (127 + fmt.emax)",
        "k = jnp.ceil(jnp.log2(top)).astype(jnp.int32) - fmt.emax",
    ),
    # Drop a parameter tangent.
    Mutation(
        "drop-sub-model-tangent",
        "parameter tangent",
        "scaled_call",
        SC,
        "t_sub = t_self.sub_model",
        "t_sub = None",
    ),
    Mutation(
        "drop-scale-tangent",
        "parameter tangent",
        "scaled_call",
        SC,
        "t_scale = t_self.scale",
        "t_scale = None",
    ),
    Mutation(
        "drop-module-tangents-in-mechanism",
        "parameter tangent",
        "scaled_call",
        CAT,
        "t_out = rule.tangent(tuple(args), tuple(t_args), t_rule, out, **kwargs)",
        "t_out = rule.tangent(tuple(args), tuple(t_args), None, out, **kwargs)",
    ),
    # A learned step's derivative (through `t_self`): the wrong sign at the upper
    # clip, and the gradient scale g forgotten.
    Mutation(
        "lsq-step-sign-upper-clip",
        "step derivative",
        "lsq_quantize",
        LE,
        "jnp.where(u >= qp, qp, jnp.round(u) - u)",
        "jnp.where(u >= qp, -qp, jnp.round(u) - u)",
    ),
    Mutation(
        "lsq-missing-grad-scale",
        "step derivative",
        "lsq_quantize",
        LE,
        "terms.append((self._g(x) * ds) * t_s)",
        "terms.append(ds * t_s)",
    ),
    # Scale a (co)tangent.
    _patch("scale-ste_sign", "scale", "ste_sign", SIGN, "SteSign", "tangent", SCALE),
    _patch(
        "scale-standardize", "scale", "standardize", SG, "Standardize", "tangent", SCALE
    ),
    _patch(
        "scale-gumbel", "scale", "gumbel_softmax", CA, "GumbelSoftmax", "tangent", SCALE
    ),
    _patch(
        "scale-clip_gradient",
        "scale",
        "clip_gradient",
        GR,
        "ClipGradient",
        "bwd",
        SCALE,
    ),
    _patch(
        "scale-zero_nonfinite",
        "scale",
        "zero_nonfinite_gradient",
        GR,
        "ZeroNonFiniteGradient",
        "bwd",
        SCALE,
    ),
    # Mishandle a symbolic zero: differentiate leaves whose tangent is `None` (an
    # unperturbed argument), as if it were an array.
    Mutation(
        "symbolic-zero-partial-jvp",
        "symbolic zero",
        "scaled_call",
        "eqxrules/_tangents.py",
        "if t is not None and eqx.is_inexact_array(p)",
        "if eqx.is_inexact_array(p)",
    ),
    # Leave a blocked path open at second order only: first derivatives unchanged.
    Mutation(
        "second-order-frozen",
        "second order",
        "frozen_call",
        SG,
        "module = _frozen(self.module)",
        "module = self.module",
    ),
    # A grid quantiser that computes `x - lo` first (the 0.1.0 formula): wrong
    # levels near zero and at boundaries.
    Mutation(
        "grid-x-minus-lo-first",
        "grid",
        "ste_quantize",
        PA,
        "value = formula_value(w, path)[1]",
        "value = lo + (hi - lo) * (jnp.round((jnp.clip(w, lo, hi) - lo) * "
        "(n / (hi - lo))) / n)",
    ),
    # Multiply by a mask (or a zero slope) instead of selecting: 0 * inf is NaN.
    Mutation(
        "multiply-magnitude-mask",
        "select",
        "magnitude_aware_sign",
        SIGN,
        "scale = jnp.where(mask, scale, jnp.zeros_like(scale))",
        "scale = scale",
    ),
    Mutation(
        "multiply-zero-slope",
        "select",
        "approx_sign",
        CAT,
        "return jnp.where(s == 0, jnp.zeros_like(t), t * s)",
        "return t * s",
    ),
    # Change a dtype.
    Mutation(
        "dtype-standardize",
        "dtype",
        "standardize",
        SG,
        "return ((_wide(a) - mean) / self._denominator(a)).astype(a.dtype)",
        "return (_wide(a) - mean) / self._denominator(a)",
    ),
    _patch(
        "dtype-ste_round", "dtype", "ste_round", QU, "SteRound", "primal", TO_FLOAT32
    ),
    # Stochastic rounding that never rounds up (the float formats' and the
    # integers' shared core), and a grid's that never steps from the nearest level.
    Mutation(
        "sr-floor-only",
        "stochastic",
        "stochastic_round",
        FMT,
        "return lo + (j < (v - lo) * float(2**resolution))",
        "return lo + 0 * j",
    ),
    Mutation(
        "sr-grid-never-moves",
        "stochastic",
        "ste_quantize",
        FMT,
        "return 2 * j + 1 < bound",
        "return 2 * j + 1 < 0 * bound",
    ),
    _patch(
        "dtype-clip_gradient_norm",
        "dtype",
        "clip_gradient_norm",
        GR,
        "ClipGradientNorm",
        "primal",
        TO_FLOAT32,
    ),
]


def _copy_tree(dest: pathlib.Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc")
    for name in ("eqxrules", "tests"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")


def _run_stage(root: pathlib.Path, stage: str, entry: str) -> tuple[int, str]:
    env = dict(os.environ)
    # This process's XLA flags (CI's slow tier: the older CPU emitters, faster to
    # compile), less any device count.
    flags = [f for f in env.pop("XLA_FLAGS", "").split() if "device_count" not in f]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    env["PYTHONPATH"] = str(root)
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        # Both tiers: the matrix is in the slow one, which `addopts` deselects.
        [sys.executable, "-m", "pytest", stage, "-x", "-q", "-n0", "-k", entry]
        + ["-m", "slow or not slow"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED")]
    return proc.returncode, (lines[0] if lines else proc.stdout.strip()[-300:])


def run(mutation: Mutation | None, entry: str) -> dict:
    """Apply `mutation` (none: the control run) to a fresh copy and run the stages
    until one fails."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="eqxrules-mutant-") as tmp:
        root = pathlib.Path(tmp)
        _copy_tree(root)
        if mutation is not None:
            try:
                mutation.apply(root)
            except LookupError as e:
                return dict(status="error", detail=str(e), seconds=0.0)
        for stage in STAGES:
            code, detail = _run_stage(root, stage, entry)
            if code == 1:
                status = "caught"
                break
            if code != 0:
                return dict(
                    status="error",
                    detail=f"{stage}: pytest exited {code}: {detail}",
                    seconds=time.perf_counter() - start,
                )
        else:
            status, detail, stage = "survived", "every stage passed", ""
    return dict(
        status=status,
        stage=stage,
        detail=detail,
        seconds=round(time.perf_counter() - start, 1),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="names of the mutations to run")
    parser.add_argument(
        "--no-control", action="store_true", help="skip the unmutated control run"
    )
    parser.add_argument("--json", action="store_true", help="print a JSON report")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"unknown mutation(s): {sorted(unknown)}")

    report: dict = {"mutations": {}}
    if not args.no_control:
        entry = chosen[0].entry if chosen else "scaled_call"
        control = run(None, entry)
        report["control"] = control
        if control["status"] != "survived":
            print(f"control run on `{entry}` did not pass: {control}", file=sys.stderr)
            return 2
    for m in chosen:
        result = run(m, m.entry)
        report["mutations"][m.name] = dict(kind=m.kind, entry=m.entry, **result)
        if not args.json:
            print(
                f"{m.name:36s} {m.kind:18s} {result['status']:9s} "
                f"{result['seconds']:6.1f}s  {result.get('detail', '')[:90]}",
                flush=True,
            )
    results = report["mutations"].values()
    caught = sum(r["status"] == "caught" for r in results)
    report["caught"], report["planted"] = caught, len(chosen)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"caught {caught}/{len(chosen)} planted mutations")
    return 0 if caught == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
