"""Every call the runtime makes into torch's private internals, each behind a compatibility probe.

A hook is used only where this torch is one the project tests (TESTED, or EAGLE3_TORCH_TESTED) and its probe
passes, checked once per process on first use; otherwise the public path serves and one warning names the hook,
the torch version and why. `Hooks` is the rule both sides follow (the builder's Inductor hooks:
eagle3_build/backends/cpu/inductor_internals.py).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

TESTED_ENV = "EAGLE3_TORCH_TESTED"  # comma-separated torch versions whose internals to trust instead of TESTED
TESTED = ("2.13.0",)  # the torch releases CI runs these hooks on (a hook may name more)
NEURON_TORCH = "2.9.0"  # the Neuron SDK's: CI serves export bundles on it (tests/test_runtime_install.py)


class TorchInternalsWarning(UserWarning):
    """A reach into torch internals is off on this torch: the public path serves instead."""


def torch_release() -> str:
    """torch's version without its local tag ("2.13.0+cpu" -> "2.13.0")."""
    return torch.__version__.split("+")[0]


@dataclass(frozen=True)
class Hook:
    name: str
    fallback: str  # what serves instead, for the warning
    probe: Callable[[], None]  # raises where this torch's internals are not the ones the hook uses
    tested: tuple[str, ...]  # the torch releases CI runs it on


class Hooks:
    """One side's hooks into torch internals: each probed once per process, against the tested releases."""

    def __init__(self, side: str, tested: tuple[str, ...]):
        self.side, self.tested, self.hooks = side, tested, {}

    def hook(self, name: str, fallback: str, also_tested: tuple[str, ...] = ()):
        """Decorator: registers the probe of hook `name` (tested on this side's releases and `also_tested`)."""
        def register(probe: Callable[[], None]) -> Callable[[], None]:
            self.hooks[name] = Hook(name, fallback, probe, (*self.tested, *also_tested))
            return probe
        return register

    @staticmethod
    def tested_releases(hook: Hook) -> tuple[str, ...]:
        named = tuple(v.strip() for v in os.environ.get(TESTED_ENV, "").split(",") if v.strip())
        return named or hook.tested

    @functools.cache
    def why_off(self, name: str) -> str | None:
        """None where hook `name` is on; else why it is off (warned about once)."""
        hook = self.hooks[name]
        release = torch_release()
        tested = self.tested_releases(hook)
        if release not in tested:
            why = f"torch {release} is not a release this hook is tested on ({', '.join(tested)}; {TESTED_ENV} " \
                  "names others)"
        else:
            try:
                hook.probe()
                return None
            except Exception as e:  # (any way the internals differ: the hook stays off)
                why = f"its probe failed on torch {torch.__version__}: {type(e).__name__}: {str(e)[:200]}"
        warnings.warn(f"{self.side} hook {name!r} off: {why}; {hook.fallback}", TorchInternalsWarning, stacklevel=3)
        return why

    def forget(self) -> None:
        """Probe again on next use (tests that change torch's internals or the tested releases)."""
        Hooks.why_off.cache_clear()

    def on(self, name: str) -> bool:
        return self.why_off(name) is None

    def report(self) -> dict:
        """{"torch": version, "hooks": {name: "on" | "off: why"}} for every hook (probed now where not yet)."""
        return {"torch": torch.__version__,
                "hooks": {n: "on" if self.on(n) else f"off: {self.why_off(n)}" for n in sorted(self.hooks)}}


HOOKS = Hooks("runtime", TESTED)


# ------------------------------------------------------------------ AOTInductor package loading

@HOOKS.hook("aoti_package_loader", "aoti graphs load through torch._inductor.aoti_load_package (public; its "
            "first call runs CPU checks, seconds per graph)")
def _probe_loader() -> None:
    loader = torch._C._aoti.AOTIModelPackageLoader
    if not callable(getattr(loader, "boxed_run", None)):
        raise AttributeError("AOTIModelPackageLoader has no boxed_run")


def load_aoti_package(path: str) -> Callable[..., tuple]:
    """A graph's call, (weights, kv, *inputs) -> outputs: the low-level loader (which skips aoti_load_package's
    first-call checks) where its hook is on."""
    if HOOKS.on("aoti_package_loader"):
        # (path, model name, run single-threaded, num runners, device index)
        loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
        return lambda ws, kv, *inputs: tuple(loader.boxed_run([*ws, kv, *inputs]))
    from torch._inductor import aoti_load_package

    compiled = aoti_load_package(path)
    return lambda ws, kv, *inputs: tuple(compiled(tuple(ws), kv, *inputs))


# ------------------------------------------------------------------ MKL's and oneDNN's packed GEMMs (x86 torch)

@HOOKS.hook("mkl_packed_gemm", "graphs that take MKL-packed weights cannot be served (rebuild with "
            "backend_options.pack_weights: false, or on this torch)")
def _probe_mkl() -> None:
    if not torch.backends.mkl.is_available():
        raise RuntimeError("this torch has no MKL")
    torch.ops.mkl._mkl_reorder_linear_weight.default  # noqa: B018 (raises where absent)
    torch.ops.mkl._mkl_linear.default  # noqa: B018


@HOOKS.hook("onednn_packed_gemm", "oneDNN's GEMMs take the plain weight (same results, slower)")
def _probe_onednn() -> None:
    if not torch.backends.mkldnn.is_available():
        raise RuntimeError("this torch has no oneDNN")
    torch.ops.mkldnn._reorder_linear_weight.default  # noqa: B018
    torch.ops.mkldnn._linear_pointwise.default  # noqa: B018


def mkl_available() -> bool:
    return HOOKS.on("mkl_packed_gemm")


def onednn_available() -> bool:
    """Whether oneDNN's linear runs here (the call itself; whether it may be reordered: onednn_reorder)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_reorder_available() -> bool:
    return onednn_available() and HOOKS.on("onednn_packed_gemm")


def onednn_bf16_available() -> bool:
    """Whether oneDNN runs bfloat16 GEMMs on this CPU (AVX-512 or AVX-NE-CONVERT: not on an AVX2-only one)."""
    return onednn_reorder_available() and hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported") and \
        bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def mkl_pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)


def onednn_pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def mkl_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None):
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")


# ------------------------------------------------------------------ torch.export archives

@HOOKS.hook("export_type_hints_memo", "torch.export's deserializer runs as shipped (graphs load a few times slower)",
            also_tested=(NEURON_TORCH,))
def _probe_type_hints() -> None:
    import typing

    import torch._export.serde.serialize as ser

    if getattr(ser, "typing", None) is not typing:
        raise AttributeError("torch._export.serde.serialize does not use the typing module by that name")


class _EmptyPayloads(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "on empty bytes" not in record.getMessage()


@contextlib.contextmanager
def fast_export_load():
    """Inside: torch.export's deserializer (which calls typing.get_type_hints once per JSON object, ~15k per
    graph) gets its schema classes' hints memoised (they never change), and its archive reader (torch 2.9) does
    not warn per tensor it reads from the archive's bytes (empty ones; read-only ones: constants, never written)."""
    quiet = logging.getLogger("torch.export.pt2_archive._package")
    empty = _EmptyPayloads()
    quiet.addFilter(empty)
    try:
        with warnings.catch_warnings(), _memoised_type_hints():
            warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
            yield
    finally:
        quiet.removeFilter(empty)


@contextlib.contextmanager
def _memoised_type_hints():
    if not HOOKS.on("export_type_hints_memo"):
        yield
        return
    import types
    import typing

    import torch._export.serde.serialize as ser

    cache: dict = {}

    def get_type_hints(cls, globalns=None):
        hints = cache.get(cls)
        if hints is None:
            hints = cache[cls] = typing.get_type_hints(cls, globalns=globalns)
        return hints

    shim = types.SimpleNamespace(**{k: getattr(typing, k) for k in dir(typing) if not k.startswith("__")})
    shim.get_type_hints = get_type_hints
    ser.typing = shim
    try:
        yield
    finally:
        ser.typing = typing


def is_op_overload(obj) -> bool:
    """Whether obj is an operator overload (torch.ops.ns.op.overload)."""
    return isinstance(obj, torch._ops.OpOverload)
