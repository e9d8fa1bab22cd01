"""python -m qexp.report ... (the flags: qexp.report.cli)."""

import os
import sys

from qexp.report.cli import main

if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`... | head`): what it wanted is printed; no traceback. Python would try to flush
        # stdout again at exit and fail the same way, so point it at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)
