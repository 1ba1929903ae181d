"""The runtime side of each backend, one class per backend (base.py says what each provides), chosen
once per bundle from `manifest.backend` (registry.py); facts.py says what each backend is without torch.
Nothing else in the runtime names a backend."""
