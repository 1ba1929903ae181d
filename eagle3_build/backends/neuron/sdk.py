"""The Neuron SDK check the build runs before anything heavy (no torch import), and how to install it."""
from __future__ import annotations

from eagle3_runtime.backends import neuron_sdk
from eagle3_runtime.backends.facts import NeuronFacts

from ...errors import UserError
from .releases import NEWEST, OLDEST, install_hint

NEURON_SDK = {mod: pip for mod, (_, pip) in neuron_sdk.NEURON_SDK.items()}  # import name -> pip name
NEURON_INSTALL_HINT = (
    "install the Neuron SDK from the Neuron pip repository on a trn1/trn2/inf2 or compile host, one release's "
    f"stack whole: {install_hint(NEWEST)} (an extra per release {OLDEST} to {NEWEST}, "
    "eagle3_build/backends/neuron/release_table.py; PyPI only has placeholder packages by those names)")


def check_sdk() -> None:
    """UserError naming the SDK packages that are absent, or are PyPI's "WRONG PACKAGE" placeholders (read from
    the installed metadata, without importing anything)."""
    missing = NeuronFacts.missing_sdk()
    if missing and neuron_sdk.host_generation() == neuron_sdk.NEFF_GENERATION:
        return  # (SDK 2.32 +: neuronx-cc and nrtpy / libneuronxla 3, no torch-neuronx; backend.neff_sdk_versions)
    if missing:
        raise UserError(
            f"backend neuron needs the Neuron SDK and {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed (or only PyPI's placeholder): "
            f"{NEURON_INSTALL_HINT}. Without the SDK, "
            "`eagle3-build plan RECIPE --backend neuron` lists every NEFF with its exact compiler command")
