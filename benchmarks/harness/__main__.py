"""``python -m benchmarks.harness``: see :mod:`benchmarks.harness.cli` for the flags."""

from benchmarks.harness.cli import main

main()
