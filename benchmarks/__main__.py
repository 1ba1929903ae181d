from benchmarks.cli import app

app(prog_name="python -m benchmarks")
