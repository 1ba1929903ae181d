import sys

from benchmarks.cli import app
from eagle3_runtime.errors import Eagle3Error, print_cause

try:
    app(prog_name="python -m benchmarks")
except Eagle3Error as e:  # a bundle, recipe or prompt file the measurement cannot use: one line, exit 2
    print_cause(e)
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
