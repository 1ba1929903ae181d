"""The aoti backend's CPU kernel work, behind one boundary: which format each projection's weight takes (gemm.py,
measured on the build host), the LinearMethod that reads copies packed at load (packed.py), and every reach into
Inductor's internals, each a probed hook (inductor_internals.py). docs/architecture.md."""
