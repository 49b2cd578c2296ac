"""``python -m benchmarks [suite]``: the benchmark suite (benchmarks/run.py); ``paper``: the
Rabe & Staats memory tables; ``accuracy``: the accuracy table; ``readme``: README.md's
performance summary and language-model paragraph, and docs/performance.md, from the result
files (benchmarks/readme.py)."""

import importlib
import sys

COMMANDS = {"suite": "run", "paper": "paper", "accuracy": "accuracy", "readme": "readme"}
argv = sys.argv[1:]
command = argv.pop(0) if argv and argv[0] in COMMANDS else "suite"
importlib.import_module(f"benchmarks.{COMMANDS[command]}").main(argv)
