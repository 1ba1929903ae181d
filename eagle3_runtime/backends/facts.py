"""What each backend is, as class attributes read without torch: the manifest's checks, the recipe's
backend_options and the builder's preflight ask these; each runtime backend class extends its own."""
from __future__ import annotations

from typing import ClassVar

from . import neuron_sdk


class BackendFacts:
    """The facts of a backend this runtime does not know (its bundles are refused when served)."""

    name: ClassVar[str] = ""
    graph_format: ClassVar[str | None] = None  # GraphEntry.backend["format"] of its graph files
    packs_weights: ClassVar[bool] = False  # its graphs may take weights packed at load (GraphEntry.packed)
    index_dtype: ClassVar[str] = "int64"  # the dtype of token / position / index inputs
    options: ClassVar[tuple[str, ...]] = ()  # the recipe's backend_options it takes
    sdk: ClassVar[tuple[str, ...]] = ()  # pip packages it needs besides torch
    host_threads: ClassVar[bool] = True  # its graphs run on this process's torch threads (the thread governor)

    @classmethod
    def missing_sdk(cls) -> list[str]:
        """The SDK packages (pip names) not installed, read without importing them."""
        return []

    @classmethod
    def graph_formats(cls) -> tuple[str, ...]:
        """Every GraphEntry.backend["format"] its bundles may have (one per SDK generation)."""
        return (cls.graph_format,) if cls.graph_format else ()


class ExportFacts(BackendFacts):
    name = "export"
    graph_format = "torch.export"


class AotiFacts(BackendFacts):
    name = "aoti"
    graph_format = "aotinductor"
    packs_weights = True
    options = ("device", "inductor_configs", "pack_weights", "draft_bfloat16", "cpu_isa")


class NeuronFacts(BackendFacts):
    name = "neuron"
    graph_format = "nxd-model"
    index_dtype = "int32"  # NxDI's input_generator
    host_threads = False  # (NeuronCores run its graphs)
    options = ("compiler_args", "role_compiler_args", "fold_env_flags", "job_memory_gb", "generation")
    sdk = tuple(pip for _, pip in neuron_sdk.NEURON_SDK.values())

    @classmethod
    def missing_sdk(cls) -> list[str]:
        return neuron_sdk.missing()

    @classmethod
    def graph_formats(cls) -> tuple[str, ...]:
        return (cls.graph_format, neuron_sdk.NEFF_FORMAT)


KNOWN = {f.name: f for f in (ExportFacts, AotiFacts, NeuronFacts)}
BACKENDS = tuple(KNOWN)
DEFAULT_BACKEND = ExportFacts.name  # a recipe's backend when it names none


def backend_facts(name: str) -> type[BackendFacts]:
    """The facts of backend `name` (BackendFacts itself for a name this runtime does not know)."""
    return KNOWN.get(name, BackendFacts)
