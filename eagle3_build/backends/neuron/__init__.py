"""Backend `neuron`: NEFFs through NxD's ModelBuilder (model.py), one artifact per model (bundle.py), the
backend object the build calls (backend.py)."""
