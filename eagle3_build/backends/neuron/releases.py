"""The Neuron SDK releases this builder knows: each release's package versions, as the SDK's own release
manifest lists them (aws-neuron-sdk src/helperscripts/n2-manifest.json), with the torch its torch-neuronx
is built on and the transformers its NxD Inference pins. `pip install "eagle3-build[neuron-2-27]"` (or
`neuron-2-29`; `neuron` is the newest) installs one release's stack whole (pyproject.toml; a test keeps the
two equal); a compile host whose SDK packages come from different releases is refused."""
from __future__ import annotations

from ...errors import UserError

SDK_PACKAGES = ("torch-neuronx", "neuronx-cc", "libneuronxla", "neuronx-distributed")  # the pip names
RELEASES = {
    "2.27": {"torch-neuronx": "2.8.0.2.11.19912", "neuronx-cc": "2.22.12471.0", "libneuronxla": "2.2.14584.0",
             "neuronx-distributed": "0.16.25997", "torch": "2.8", "transformers": "4.56"},
    "2.29": {"torch-neuronx": "2.9.0.2.13.24727", "neuronx-cc": "2.24.5133.0", "libneuronxla": "2.2.16408.0",
             "neuronx-distributed": "0.18.27753", "torch": "2.9", "transformers": "4.57"},
}
NEWEST = "2.29"


def extra_name(release: str) -> str:
    return "neuron-" + release.replace(".", "-")


def requirements(release: str) -> list[str]:
    """One release's stack as pip requirements (the pyproject extra)."""
    row = RELEASES[release]
    return ([f"torch=={row['torch']}.*", f"transformers=={row['transformers']}.*"]
            + [f"{pkg}=={row[pkg]}" for pkg in SDK_PACKAGES])


def release_of(versions: dict[str, str]) -> str:
    """The release the installed SDK packages (pip name -> version) belong to: its name, or "unknown" when
    none is one this builder knows (a newer SDK). Packages of two different known releases are a mixed
    stack: a UserError naming them and the extra that installs one release whole."""
    found = {pkg: next((r for r, row in RELEASES.items() if row[pkg] == str(versions.get(pkg)).split("+")[0]),
                       None) for pkg in SDK_PACKAGES}
    known = {r for r in found.values() if r}
    if len(known) > 1 or (known and None in found.values()):
        parts = ", ".join(f"{pkg} {versions.get(pkg)} ({found[pkg] or 'no release this builder knows'})"
                          for pkg in SDK_PACKAGES)
        pick = max(known)
        raise UserError(f"backend neuron: the installed Neuron SDK mixes releases ({parts}); install one release "
                        f"whole: pip install \"eagle3-build[{extra_name(pick)}]\" --extra-index-url "
                        "https://pip.repos.neuron.amazonaws.com")
    return known.pop() if known else "unknown"
