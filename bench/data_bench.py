"""`kvxferd bench data` as a script: python bench/data_bench.py [--json]"""

import sys

from kvxferd.cli import app

if __name__ == "__main__":
    app(["bench", "data", *sys.argv[1:]], prog_name="kvxferd")
