"""`pyright --verifytypes eqxrules`: the share of the exported symbols whose types
are fully known must be at least 90%. Prints the figure; exits 1 below it."""

from __future__ import annotations

import json
import subprocess
import sys

THRESHOLD = 0.90

out = subprocess.run(
    ["pyright", "--verifytypes", "eqxrules", "--ignoreexternal", "--outputjson"],
    capture_output=True,
    text=True,
    check=False,
)
result = json.loads(out.stdout)
report = result["typeCompleteness"]
score = report["completenessScore"]
counts = report["exportedSymbolCounts"]
print(
    f"pyright --verifytypes eqxrules: {score:.1%} type completeness "
    f"({counts['withKnownType']} known, {counts['withAmbiguousType']} ambiguous, "
    f"{counts['withUnknownType']} unknown exported symbols)"
)
# Say why when pyright could not read the package (run where eqxrules is not
# installed: "No py.typed file found", 0 symbols), not only the figure.
for diagnostic in result.get("generalDiagnostics", []):
    if diagnostic.get("severity") == "error" and not diagnostic.get("file"):
        print(f"pyright: {diagnostic['message']}", file=sys.stderr)
sys.exit(0 if score >= THRESHOLD else 1)
