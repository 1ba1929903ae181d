"""Which Neuron SDK a host has: versions read from the installed distributions (never a module's
__version__), recognised against the release table generated from the SDK's own release manifest.

The fake SDKs here are laid out as pip installs the real one (neuron_standin.lay_out_sdk): a
<name>-<version>.dist-info per wheel with its full version, and each package's __init__.py with the
__version__ its source declares (NxD: "0.16.0" for wheel 0.16.25997; libneuronxla: none)."""
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from neuron_standin import MODULES, lay_out_sdk, release_versions

from eagle3_build.errors import UserError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_sdk(tmp_path, monkeypatch):
    """lay(versions) -> a site directory on sys.path holding that SDK, imported from disk; unloaded after."""
    def lay(versions: dict, name: str = "site", **kw) -> Path:
        for mod in MODULES.values():
            monkeypatch.delitem(sys.modules, mod, raising=False)
        site = lay_out_sdk(tmp_path / name, versions, **kw)
        monkeypatch.syspath_prepend(str(site))
        importlib.invalidate_caches()
        return site

    yield lay
    for mod in MODULES.values():
        sys.modules.pop(mod, None)


def test_the_release_table_is_what_the_script_makes_of_the_manifest():
    """release_table.py and pyproject's neuron extras equal what tools/neuron_releases.py makes of the committed
    manifest extract; the table holds every release that ships torch-neuronx and NxD, 2.27.0 to 2.31.1."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import neuron_releases
    finally:
        sys.path.remove(str(REPO / "tools"))
    assert neuron_releases.main(["--check"]) == 0
    from eagle3_build.backends.neuron.release_table import NEWEST, RELEASES

    source = json.loads((REPO / "tools" / "neuron_sdk" / "n2-manifest.json").read_text())
    assert [r["neuron_version"] for r in source["neuron_releases"]][0] == "2.32.0"  # (no torch-neuronx, no NxD)
    assert list(RELEASES) == ["2.27.0", "2.27.1", "2.28.0", "2.28.1", "2.29.0", "2.29.1", "2.30.0", "2.31.0", "2.31.1"]
    assert NEWEST == "2.31.1"
    assert RELEASES["2.29.1"]["torch-neuronx"] == ("2.9.0.2.13.26312",)
    assert RELEASES["2.29.1"]["neuronx-cc"] == ("2.24.8799.0",)
    assert RELEASES["2.28.1"]["torch-neuronx"] == ("2.7.0.2.12.22436", "2.8.0.2.12.22436", "2.9.0.2.12.22436")
    assert RELEASES["2.31.1"]["libneuronxla"] == ("2.2.17544.0", "3.0.3854.0")
    assert {r: (row["torch"], row["transformers"]) for r, row in RELEASES.items() if r[:4] in ("2.27", "2.31")} == {
        "2.27.0": ("2.9", "4.56"), "2.27.1": ("2.9", "4.56"), "2.31.0": ("2.9", "4.57"), "2.31.1": ("2.9", "4.57")}
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["neuron"] == extras["neuron-2-31-1"]
    assert "torch-neuronx==2.9.0.2.15.32035" in extras["neuron-2-31-1"]
    assert "libneuronxla==2.2.17544.0" in extras["neuron-2-31-1"]  # the 2.x wheel: 3.x is the TorchNeuron generation


@pytest.mark.parametrize("release", ["2.27.0", "2.29.1", "2.31.1"])
def test_a_clean_install_of_each_release_is_recognised(fake_sdk, release):
    """NxD's module says 0.16.0, its wheel 0.16.25997; libneuronxla declares no version: the build and the
    runtime both read the wheels."""
    from eagle3_build.backends.neuron.backend import NeuronBackend
    from eagle3_runtime.backends.neuron import installed_versions

    versions = release_versions(release)
    fake_sdk(versions)
    import libneuronxla
    import neuronx_distributed

    assert neuronx_distributed.__version__ == versions["neuronx-distributed"].rsplit(".", 1)[0] + ".0"
    assert not hasattr(libneuronxla, "__version__")
    backend = NeuronBackend({})
    tc = backend.toolchain()
    assert tc["neuron_sdk_release"] == release and backend.notes() == []
    assert tc["neuronx_distributed"] == versions["neuronx-distributed"]  # the wheel's, not __version__
    assert installed_versions() == {key: tc[key] for key in ("torch_neuronx", "neuronx_cc", "libneuronxla",
                                                             "neuronx_distributed")}


def test_releases_are_told_apart_and_torch_variants_are_one_release(fake_sdk):
    """2.27.0 and 2.27.1 differ only in NxD Inference: without it the newest is named. 2.28.x ships
    torch-neuronx for torch 2.7, 2.8 and 2.9: each is 2.28."""
    from eagle3_build.backends.neuron.releases import identify

    v = release_versions("2.27.0")
    assert identify(v).name == "2.27.0"
    assert identify({k: x for k, x in v.items() if k != "neuronx-distributed-inference"}).name == "2.27.1"
    for torch in ("2.7", "2.8", "2.9"):
        assert identify(release_versions("2.28.1", torch=torch)).name == "2.28.1"
    assert identify(release_versions("2.29.0")).name == "2.29.0"  # 2.29.1 changed torch-neuronx and neuronx-cc


def test_a_mixed_stack_is_refused_in_one_line(tmp_path):
    """torch-neuronx of 2.29.1 with NxD of 2.27.0: `compile` exits 2 with one line naming both and the extra."""
    from neuron_standin import lay_out_sdk

    from eagle3_build.testing.tiny import make_tiny_pair

    versions = release_versions("2.29.1") | {"neuronx-distributed": release_versions("2.27.0")["neuronx-distributed"]}
    site = lay_out_sdk(tmp_path / "site", versions)
    recipe = make_tiny_pair(tmp_path / "pair")
    code = ("import sys; sys.path.insert(0, sys.argv[3]); from eagle3_build.cli import main; "
            "sys.argv = ['eagle3-build', 'compile', sys.argv[1], '--backend', 'neuron', '--out', sys.argv[2]]; main()")
    r = subprocess.run([sys.executable, "-c", code, str(recipe), str(tmp_path / "out"), str(site)],
                       capture_output=True, text=True, timeout=120)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    msg = " ".join(r.stderr.split())
    assert r.returncode == 2, r.stderr
    assert "mixes releases" in msg and "neuronx-distributed 0.16.25997 (2.27.0/2.27.1)" in msg
    assert "torch-neuronx 2.9.0.2.13.26312 (2.29.1)" in msg and "eagle3-build[neuron-2-29-1]" in msg
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists() and len(lines) <= 2, r.stderr


def test_newer_and_older_sdks(fake_sdk):
    """A version newer than the table: named in a warning, recorded as release "unknown", not refused.
    One older than the table's first release: refused."""
    from eagle3_build.backends.neuron.backend import NeuronBackend
    from eagle3_build.backends.neuron.releases import identify

    newer = release_versions("2.31.1") | {"torch-neuronx": "2.9.0.2.16.40000", "neuronx-cc": "2.28.100.0"}
    fake_sdk(newer)
    backend = NeuronBackend({})
    assert backend.toolchain()["neuron_sdk_release"] == "unknown"
    (warning,) = backend.notes()
    assert "torch-neuronx 2.9.0.2.16.40000, neuronx-cc 2.28.100.0" in warning and "ends at 2.31.1" in warning
    assert "of 2.31.1" in warning  # what it shares with the newest known release
    # a compiler with --native-int64 (2.27.5334 on) gets today's int64 downcast pinned, in every graph's flags
    assert all(a[a.index("--native-int64") + 1] == "disabled" and "--implicit-integer-downcast" in a
               for a in backend.role_args.values())
    older = release_versions("2.27.0") | {"neuronx-distributed": "0.15.22404", "neuronx-distributed-inference": ""}
    with pytest.raises(UserError, match=r"older than Neuron SDK 2\.27\.0"):
        identify(older | {"torch-neuronx": "2.8.0.2.10.16998", "neuronx-cc": "2.21.33363.0",
                          "libneuronxla": "2.2.12677.0"})


def test_integer_flags_are_pinned_per_compiler_version(fake_sdk):
    """neuronx-cc before 2.27.5334 (every NxD release, 2.27.0 to 2.31.1) has no --native-int64 (passing it would
    fail the compile); from it on, the next release's default (native int64, hard errors) is pinned away.
    A recipe's own flag still wins."""
    from eagle3_build.backends.neuron.backend import NeuronBackend
    from eagle3_build.backends.neuron.model import compiler_args
    from eagle3_build.backends.neuron.releases import integer_flags

    assert integer_flags("2.26.6360.0") == [] and integer_flags("2.24.8799.0") == []
    assert integer_flags("2.27.5334.0") == ["--native-int64=disabled", "--implicit-integer-downcast=all"]
    fake_sdk(release_versions("2.31.1"))
    assert not any("int64" in x for a in NeuronBackend({}).role_args.values() for x in a)
    mine = compiler_args({"compiler_args": ["--native-int64=enabled"]}, "draft_step", {}, neuronx_cc="2.28.0.0")
    assert mine[mine.index("--native-int64") + 1] == "enabled"


def test_a_broken_sdk_package_is_one_line(fake_sdk):
    """Installed (its wheel's metadata is there) but its import fails, e.g. libnrt missing: one UserError."""
    from eagle3_build.backends.neuron.backend import NeuronBackend

    site = fake_sdk(release_versions("2.31.1"))
    (site / "torch_neuronx" / "__init__.py").write_text(
        "raise OSError('libnrt.so.1: cannot open shared object file: No such file or directory')\n")
    with pytest.raises(UserError, match=r"torch-neuronx, which is installed but broken: `import torch_neuronx` "
                                        r"raised OSError\('libnrt.so.1"):
        NeuronBackend({})


def test_the_runtime_reads_the_wheels_and_names_a_broken_package(fake_sdk):
    """The serving host: the bundle's versions against the installed wheels (not __version__), and an SDK
    package that is installed but does not import is one line naming it."""
    from test_neuron import manifest_stub

    from eagle3_runtime.backends.neuron import NeuronHostError, check_host

    versions = release_versions("2.27.0")
    site = fake_sdk(versions)
    built = manifest_stub(torch_neuronx=versions["torch-neuronx"], neuronx_cc=versions["neuronx-cc"],
                          libneuronxla=versions["libneuronxla"], neuronx_distributed=versions["neuronx-distributed"])
    check_host(built, environ={}, devices=["/dev/neuron0"])
    with pytest.raises(NeuronHostError, match=r"compiled with neuronx-distributed 0\.16\.9999, this host has "
                                              r"0\.16\.25997"):
        check_host(manifest_stub(**{**built.toolchain, "neuronx_distributed": "0.16.9999"}), environ={},
                   devices=["/dev/neuron0"])
    (site / "neuronx_distributed" / "__init__.py").write_text("raise ImportError('libnrt.so.1: not found')\n")
    sys.modules.pop("neuronx_distributed", None)
    with pytest.raises(NeuronHostError, match=r"neuronx-distributed 0\.16\.25997 is installed but `import "
                                              r"neuronx_distributed` raised ImportError\('libnrt.so.1"):
        check_host(built, environ={}, devices=["/dev/neuron0"])
