"""One-off GPU experiments behind the kernels' design choices: bench/probes/README.md lists each one's
question and answer, and docs/performance.md states what they found. Not the benchmark (bench/kernels/cli.py)."""
