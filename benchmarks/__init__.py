"""The benchmark harness: `python -m benchmarks <subcommand>` (benchmarks/cli.py lists them).

Every subcommand measures its contenders side by side in one run, names the host (CPU model, vector ISA,
threads, load) and writes JSON with --save-result PATH or --record NAME (benchmarks/results/NAME.<host-kind>.json).
"""
