"""Checkpoints: recipe sources resolved to local files and read lazily (sources.py), target and draft
configs checked and loaded (load.py), the pair checked against each other and built as models
(pair_checks.py), the target's tokenizer exported for the runtime (tokenizer_export.py)."""
