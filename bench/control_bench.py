"""`kvxferd bench control` as a script: python bench/control_bench.py [--json]"""

import sys

from kvxferd.cli import app

if __name__ == "__main__":
    app(["bench", "control", *sys.argv[1:]], prog_name="kvxferd")
