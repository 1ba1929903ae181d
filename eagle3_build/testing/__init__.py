"""Test helpers, public for your own tests: tiny random target + draft pairs (tiny.py) and a GGUF writer
(gguf.py). Not part of the build pipeline: outside the compile cache's code hash."""
