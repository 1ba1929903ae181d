"""Backends: an exported graph (or, for an SPMD backend, a whole model) in, a compiled artifact out.

base.py holds the interface and the SDK preflight; registry.py picks one by name; export.py
(torch.export .pt2), aoti.py (AOTInductor native code) and neuron.py (NxD ModelBuilder NEFFs) implement it.
"""
