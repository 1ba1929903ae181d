"""eagle3-build: offline compile-and-package toolchain for EAGLE3 speculative decoding."""

__version__ = "0.1.0"
