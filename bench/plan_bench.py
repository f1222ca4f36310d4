"""`kvxferd bench plan` as a script: python bench/plan_bench.py [--json]"""

import sys

from kvxferd.cli import app

if __name__ == "__main__":
    app(["bench", "plan", *sys.argv[1:]], prog_name="kvxferd")
