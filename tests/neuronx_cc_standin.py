"""A stand-in `neuronx-cc` command (Neuron SDK 2.32's compiler CLI), for tests: `install_neuronx_cc(bin_dir)`
writes an executable `neuronx-cc` there that runs this file with the test's interpreter.

It enforces the documented command line: `neuronx-cc compile <file> --framework XLA --target <t> --output
<path> [flags]`, the input an existing file that parses as an HloModuleProto (its ENTRY signature read), a known
target, and only flags the compiler version it claims knows (NEURONX_CC_STANDIN_VERSION, default SDK 2.32's
2.27.5334.0: the integer flags --native-int64 / --implicit-integer-downcast exist from that version on);
exit 1 with argparse's one-line error otherwise. Its NEFF is a zip: `neff.json` (the compiler version, target,
argv, the HLO's sha256, the inputs input<i> / outputs output<j> with dtypes and shapes, the aliases, the
collectives' opcodes found in the module) and `graph.hlo` (the HLO as given).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import zipfile
from pathlib import Path

DEFAULT_VERSION = "2.27.5334.0"
TARGETS = ("trn1", "trn2", "trn3", "inf2")
COLLECTIVES = (b"all-reduce", b"all-gather", b"reduce-scatter", b"all-to-all", b"collective-permute")
INTEGER_FLAGS_SINCE = (2, 27, 5334)
HERE = Path(__file__).resolve().parent


def hlo_proto():
    """eagle3_build/backends/neuron/hlo_proto.py by path (no package import: the compiler starts fast)."""
    spec = importlib.util.spec_from_file_location("hlo_proto", HERE.parent / "eagle3_build/backends/neuron/hlo_proto.py")
    mod = sys.modules["hlo_proto"] = importlib.util.module_from_spec(spec)  # (dataclasses look it up there)
    spec.loader.exec_module(mod)
    return mod


def parser(version: tuple[int, ...]) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="neuronx-cc", allow_abbrev=False)
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compile", allow_abbrev=False)
    c.add_argument("input")
    c.add_argument("--framework", required=True, choices=["XLA"])
    c.add_argument("--target", required=True, choices=TARGETS)
    c.add_argument("--output", required=True)
    c.add_argument("--auto-cast", choices=["none", "matmult", "all"])
    c.add_argument("--model-type", choices=["generic", "transformer", "unet-inference"])
    c.add_argument("-O1", "-O2", "-O3", dest="opt", action="store_const", const=True)
    c.add_argument("--logical-nc-config", "--lnc", type=int, choices=[1, 2])
    c.add_argument("--logfile")
    c.add_argument("--verbose")
    c.add_argument("--enable-saturate-infinity", action="store_true")
    c.add_argument("--tensorizer-options")
    c.add_argument("--internal-hlo2tensorizer-options")
    if version >= INTEGER_FLAGS_SINCE:
        c.add_argument("--native-int64", choices=["enabled", "disabled"])
        c.add_argument("--implicit-integer-downcast", choices=["all", "none"])
    return ap


def main(argv: list[str]) -> int:
    version = os.environ.get("NEURONX_CC_STANDIN_VERSION", DEFAULT_VERSION)
    vt = tuple(int(x) for x in version.split(".")[:3])
    args = parser(vt).parse_args(argv)  # (exit 2 with the usage line on a bad command)
    src = Path(args.input)
    if not src.is_file():
        print(f"neuronx-cc: error: input file {src} does not exist", file=sys.stderr)
        return 1
    if args.target in ("trn1", "inf2") and args.logical_nc_config not in (None, 1):
        print(f"neuronx-cc: error: --logical-nc-config {args.logical_nc_config} is not valid for {args.target}",
              file=sys.stderr)
        return 1
    data = src.read_bytes()
    hp = hlo_proto()
    try:
        sig = hp.signature(data)
    except hp.HloProtoError as e:
        print(f"neuronx-cc: error: {src} is not an HloModuleProto ({e})", file=sys.stderr)
        return 1
    meta = {"compiler": version, "target": args.target, "lnc": args.logical_nc_config, "argv": ["neuronx-cc", *argv],
            "hlo_sha256": hashlib.sha256(data).hexdigest(),
            "inputs": [{"name": f"input{i}", "dtype": p.dtype, "shape": p.shape} for i, p in enumerate(sig.parameters)],
            "outputs": [{"name": f"output{j}", "dtype": p.dtype, "shape": p.shape} for j, p in enumerate(sig.results)],
            "aliases": [{"output": f"output{o}", "input": f"input{p}"} for o, p in sig.aliases],
            "collectives": sorted({c.decode() for c in COLLECTIVES if c in data})}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("neff.json", json.dumps(meta))
        z.writestr("graph.hlo", data)
    return 0


def install_neuronx_cc(bin_dir: Path) -> Path:
    """An executable `neuronx-cc` in bin_dir running this stand-in (put bin_dir first on PATH)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "neuronx-cc"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} \"$@\"\n")
    exe.chmod(0o755)
    return exe


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
