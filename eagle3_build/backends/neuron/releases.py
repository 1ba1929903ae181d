"""Which Neuron SDK release a host's packages are: the release table (release_table.py, generated from the
SDK's own release manifest by tools/neuron_releases.py) read against the installed distributions' versions.

A release is recognised by every package it lists that is installed: the four the builder needs
(SDK_PACKAGES) and NxD Inference where present (2.27.0 and 2.27.1 differ only there). Releases whose
packages are the same (2.31.0 and 2.31.1) are named by the newest. Packages of two different releases are
a mixed stack, refused naming each package and the extra that installs one release whole; a version newer
than every release the table knows is an SDK this builder has not seen: named in a warning and recorded,
not refused; one older than the table's oldest release is refused."""
from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import UserError
from .release_table import MANIFEST, NEWEST, RELEASES

SDK_PACKAGES = ("torch-neuronx", "neuronx-cc", "libneuronxla", "neuronx-distributed")  # pip names the build needs
IDENTIFYING = (*SDK_PACKAGES, "neuronx-distributed-inference")  # (NxD Inference: only where installed)
OLDEST = next(iter(RELEASES))
INDEX_URL = "https://pip.repos.neuron.amazonaws.com"
# neuronx-cc's integer flags (--native-int64, --implicit-integer-downcast) exist from this version on (SDK 2.32,
# release-notes/components/compiler.rst "Neuron Compiler [2.27.5334.0]"); every compiler before it downcasts
# int64 to int32 and has no such flags. The next compiler changes their defaults to native int64 with hard
# errors, so a compiler that has them gets today's behaviour pinned.
INTEGER_FLAGS_SINCE = (2, 27, 5334)
INTEGER_FLAGS = ["--native-int64=disabled", "--implicit-integer-downcast=all"]


def vtuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0]))


def extra_name(release: str) -> str:
    return RELEASES[release]["extra"]


def install_hint(release: str) -> str:
    return f'pip install "eagle3-build[{extra_name(release)}]" --extra-index-url {INDEX_URL}'


def integer_flags(neuronx_cc: str) -> list[str]:
    """The integer flags this compiler version is given: the pins where it has the flags, none before."""
    return list(INTEGER_FLAGS) if vtuple(neuronx_cc) >= INTEGER_FLAGS_SINCE else []


@dataclass(frozen=True)
class SdkRelease:
    name: str  # a release of the table, or "unknown"
    warning: str | None = None  # an SDK newer than the table: what to say and record


def releases_listing(pkg: str, version: str) -> list[str]:
    v = version.split("+")[0]
    return [r for r, row in RELEASES.items() if v in row[pkg]]


def identify(versions: dict[str, str]) -> SdkRelease:
    """The release of the installed packages (pip name -> version; absent: not installed). UserError for a
    mixed stack or an SDK older than the table."""
    present = {pkg: versions[pkg] for pkg in IDENTIFYING if versions.get(pkg)}
    listed = {pkg: releases_listing(pkg, v) for pkg, v in present.items()}
    known = {pkg: rs for pkg, rs in listed.items() if rs}
    common = set(RELEASES)
    for rs in known.values():
        common &= set(rs)
    if known and not common:
        parts = ", ".join(f"{pkg} {present[pkg]} ({'/'.join(known[pkg]) if pkg in known else 'no release in the table'})"
                          for pkg in present)
        newest = max((r for rs in known.values() for r in rs), key=vtuple)
        raise UserError(f"backend neuron: the installed Neuron SDK mixes releases ({parts}); install one release "
                        f"whole: {install_hint(newest)}")
    unknown = {pkg: v for pkg, v in present.items() if pkg not in known}
    older = [pkg for pkg, v in unknown.items() if vtuple(v) < vtuple(RELEASES[OLDEST][pkg][0])]
    if older:
        parts = ", ".join(f"{pkg} {present[pkg]}" for pkg in older)
        raise UserError(f"backend neuron: the installed Neuron SDK ({parts}) is older than Neuron SDK {OLDEST}, the "
                        f"oldest release eagle3-build builds for; install a newer one whole, e.g. {install_hint(NEWEST)}")
    if unknown:
        parts = ", ".join(f"{pkg} {v}" for pkg, v in unknown.items())
        near = f" (with the {', '.join(known)} of {max(common, key=vtuple)})" if known else ""
        return SdkRelease("unknown", f"the installed Neuron SDK is not a release this eagle3-build knows: {parts}"
                                     f"{near}; its release table ends at {NEWEST} (the SDK's manifest "
                                     f"{MANIFEST['version']}). Building anyway; the bundle records these versions "
                                     "and the runtime will require exactly them")
    return SdkRelease(max(common, key=vtuple))
