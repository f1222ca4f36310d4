"""`kvxferd bench integrity` as a script: python bench/integrity_bench.py [--json]"""

import sys

from kvxferd.cli import app

if __name__ == "__main__":
    app(["bench", "integrity", *sys.argv[1:]], prog_name="kvxferd")
