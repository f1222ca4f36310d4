"""`kvxferd bench handshake` as a script: python bench/handshake_bench.py [--json]"""

import sys

from kvxferd.cli import app

if __name__ == "__main__":
    app(["bench", "handshake", *sys.argv[1:]], prog_name="kvxferd")
