"""`kvxferd bench framing` as a script: python bench/framing_bench.py [--json]"""

import sys

from kvxferd.cli import app

if __name__ == "__main__":
    app(["bench", "framing", *sys.argv[1:]], prog_name="kvxferd")
