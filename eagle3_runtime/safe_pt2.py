"""Load a torch.export `.pt2` graph without running anything from the file.

`torch.export.load` trusts its archive: it unpickles weights, constants and sample inputs
(`use_pickle`, legacy `.pt` entries, `torch.load(weights_only=False)` fallbacks), resolves node
targets by attribute lookup from `torch` (so `torch.os.system` is a valid "operator"), runs
`guards_code` as Python and parses symbolic shapes with `sympy.sympify` (eval). The archive is
therefore checked, from the bytes that will be loaded, before torch sees it:

  * only the entries torch.export.save writes for one program (JSON, raw tensor payloads, the
    archive's version files), nothing else;
  * every weight / constant payload config says `use_pickle: false` and names a raw tensor entry;
    no custom or opaque objects; the sample-inputs entry is empty;
  * the program JSON has no guards code, no range constraints, no symbolic values, no custom
    objects, and every node calls an ATen / prims / c10d-functional operator overload (or
    `operator.getitem`), resolved through `torch.ops` and never through module attributes.

What is left is a static graph of tensor operators, the same thing our builder writes.
"""
from __future__ import annotations

import io
import json
import re
import zipfile

import torch

from .torch_internals import is_op_overload

ALLOWED_NAMESPACES = ("aten", "prims", "_c10d_functional")
DENIED_OPS = {"aten.from_file", "aten._pickle"}  # file access has no place in a model graph
GETITEM = "_operator.getitem"

_ENTRY = re.compile(
    r"(?P<root>[^/]+)/(?:models/model\.json|data/weights/model_weights_config\.json|data/weights/weight_\d+"
    r"|data/constants/model_constants_config\.json|data/constants/tensor_\d+|data/sample_inputs/model\.pt"
    r"|archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id)")
_PAYLOAD = {"weights": re.compile(r"weight_\d+"), "constants": re.compile(r"tensor_\d+")}
_SYMBOLIC = (b'"as_expr"', b'"expr_str"', b'"as_sym_int"', b'"as_sym_float"', b'"as_sym_bool"',
             b'"as_sym_ints"', b'"as_sym_floats"', b'"as_sym_bools"')


class UnsafeArchive(ValueError):
    """The .pt2 holds something other than a static graph of tensor operators."""


def load_exported(data: bytes, name: str) -> torch.export.ExportedProgram:
    """Check the archive bytes (see the module docstring), then deserialize exactly those bytes."""
    check_archive(data, name)
    return torch.export.load(io.BytesIO(data))


def check_archive(data: bytes, name: str) -> None:
    try:
        _check_archive(data, name)
    except UnsafeArchive:
        raise
    except Exception as e:  # a malformed structure (a list where a map belongs, ...) is refused too
        raise UnsafeArchive(f"{name}: malformed .pt2 archive ({type(e).__name__}: {e})") from e


def _check_archive(data: bytes, name: str) -> None:
    try:
        z = zipfile.ZipFile(io.BytesIO(data))
        names = z.namelist()
    except zipfile.BadZipFile as e:
        raise UnsafeArchive(f"{name}: not a .pt2 (zip) archive") from e
    roots = set()
    for n in names:
        m = _ENTRY.fullmatch(n)
        if m is None:
            raise UnsafeArchive(f"{name}: unexpected archive entry {n!r} (an export graph holds only its "
                                "program JSON and raw tensors)")
        roots.add(m["root"])
    if len(roots) != 1 or len(set(names)) != len(names):
        raise UnsafeArchive(f"{name}: expected one program per archive, found roots {sorted(roots)}")
    (root,) = roots
    for kind in ("weights", "constants"):
        config = _json(z, f"{root}/data/{kind}/model_{kind}_config.json", name)
        entries = config.get("config") if isinstance(config, dict) else None
        if not isinstance(entries, dict):
            raise UnsafeArchive(f"{name}: {kind} config is not a payload map")
        for fqn, meta in entries.items():
            if not isinstance(meta, dict) or meta.get("use_pickle") is not False:
                raise UnsafeArchive(f"{name}: {kind} entry {fqn!r} is pickled (use_pickle must be false); "
                                    "refusing to unpickle anything from a bundle")
            path = meta.get("path_name")
            if not isinstance(path, str) or not _PAYLOAD[kind].fullmatch(path) or \
                    f"{root}/data/{kind}/{path}" not in names:
                raise UnsafeArchive(f"{name}: {kind} entry {fqn!r} names payload {path!r}, not a raw tensor entry")
    sample = f"{root}/data/sample_inputs/model.pt"
    if sample in names and z.getinfo(sample).file_size != 0:
        raise UnsafeArchive(f"{name}: the archive carries pickled sample inputs; bundles never do")
    raw = z.read(f"{root}/models/model.json") if f"{root}/models/model.json" in names else None
    if raw is None:
        raise UnsafeArchive(f"{name}: no program (models/model.json) in the archive")
    check_program(raw, name)


def check_program(raw: bytes, name: str) -> None:
    for token in _SYMBOLIC:
        if token in raw:
            raise UnsafeArchive(f"{name}: the program has symbolic values ({token.decode()}); bundle graphs are static")
    try:
        program = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise UnsafeArchive(f"{name}: the program JSON is not valid") from e
    if not isinstance(program, dict):
        raise UnsafeArchive(f"{name}: the program JSON is not an object")
    gm = program.get("graph_module") or {}
    graph = gm.get("graph") or {}
    if program.get("guards_code") or program.get("range_constraints") or graph.get("custom_obj_values"):
        raise UnsafeArchive(f"{name}: the program carries guard code, range constraints or custom objects")
    for node in graph.get("nodes") or []:
        target = node.get("target") if isinstance(node, dict) else None
        if not _allowed_target(target):
            raise UnsafeArchive(f"{name}: node calls {target!r}, which is not an ATen/prims/c10d operator")


def _allowed_target(target) -> bool:
    if target == GETITEM:
        return True
    if not isinstance(target, str):
        return False
    parts = target.split(".")
    if len(parts) != 5 or parts[:2] != ["torch", "ops"] or parts[2] not in ALLOWED_NAMESPACES:
        return False
    ns, op, overload = parts[2:]
    if f"{ns}.{op}" in DENIED_OPS or not all(p.isidentifier() for p in (op, overload)):
        return False
    try:
        packet = getattr(getattr(torch.ops, ns), op)
        return is_op_overload(getattr(packet, overload))
    except (AttributeError, RuntimeError):
        return False


def _json(z: zipfile.ZipFile, entry: str, name: str):
    try:
        raw = z.read(entry)
    except KeyError as e:
        raise UnsafeArchive(f"{name}: archive entry {entry!r} is missing") from e
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise UnsafeArchive(f"{name}: {entry} is not valid JSON") from e

