"""python -m qexp.report ... (the flags: qexp.report.cli)."""

import sys

from qexp.report.cli import main

if __name__ == "__main__":
    sys.exit(main())
