"""Backends: an exported graph (or, for an SPMD backend, a whole model) in, a compiled artifact out.

base.py holds the interface; registry.py picks one by name and runs the SDK preflight; export.py
(torch.export .pt2), aoti.py (AOTInductor native code) and neuron/ (NxD ModelBuilder NEFFs) implement it.
What each backend is (options, graph format, SDK) is eagle3_runtime/backends/facts.py, shared with the runtime.
"""
