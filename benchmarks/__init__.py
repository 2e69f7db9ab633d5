"""Performance figures for eqxrules (issue 6), written to `benchmarks/RESULTS.md`.

    python -m benchmarks [--quick] [--json] [--suite] [--only SECTIONS]
                         [--rules NAMES] [--out PATH]

(`python benchmarks/run.py` takes the same flags.) Each section is a module of
`benchmarks/sections/` that measures and renders; its prose is in
`benchmarks/templates/`. All run by default but `suite`, which runs with `--suite`,
and `qwix`, which needs the `bench` extra (`python -m pip install -e '.[bench]'`)
and runs with `--only qwix`.

Nothing needs a GPU: on any device the figures record `device_kind`, and the
measurements are the same.
"""
