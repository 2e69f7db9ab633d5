"""`python benchmarks/run.py ...` is `python -m benchmarks ...`, kept for the commands
that earlier reports and the changelog give."""

import pathlib
import sys

if __name__ == "__main__":
    # Run as a script, this folder is first on the path; the package's parent must be.
    sys.path[0] = str(pathlib.Path(__file__).resolve().parent.parent)
    from benchmarks.cli import main

    sys.exit(main(prog="python benchmarks/run.py"))
