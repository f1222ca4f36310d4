"""`kvxferd bench footprint` as a script: python bench/footprint_bench.py [--json]"""

import sys

from kvxferd.cli import app

if __name__ == "__main__":
    app(["bench", "footprint", *sys.argv[1:]], prog_name="kvxferd")
