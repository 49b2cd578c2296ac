"""``python -m benchmarks [suite]``: the benchmark suite (benchmarks/run.py); ``paper``: the
Rabe & Staats memory tables; ``accuracy``: the accuracy table; ``readme``: the README's
performance section from the latest results."""

import importlib
import sys

COMMANDS = {"suite": "run", "paper": "paper", "accuracy": "accuracy", "readme": "readme"}
argv = sys.argv[1:]
command = argv.pop(0) if argv and argv[0] in COMMANDS else "suite"
importlib.import_module(f"benchmarks.{COMMANDS[command]}").main(argv)
