import os
import sys

from ._cli import main

# Guarded, so that importing this module (as documentation tools do) runs nothing.
if __name__ == "__main__":
    try:
        code: int = main()
    except BrokenPipeError:
        # The reader went away (`python -m eqxrules list | head`): stop quietly, as a
        # Unix command does, and keep Python from failing again when it flushes stdout
        # at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    sys.exit(code)
