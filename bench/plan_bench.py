"""Planner benchmark (same as `kvxferd bench plan`): python bench/plan_bench.py [--json]"""

import json
import sys

from kvxferd.benchmarks import plan as bench_plan

rows = bench_plan.run()
print(json.dumps(rows, indent=2) if "--json" in sys.argv else bench_plan.render(rows))
