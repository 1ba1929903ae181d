"""What a graph file says it takes and returns, read from the file as data (nothing loaded or run), and
checked against its manifest entry.

A graph is called with its weights (GraphEntry.weights, then the packed copies), the model's KV cache,
the rank and the role's inputs, and returns the role's outputs (graph_contract.py). The
manifest names those tensors; only the graph file knows the shapes its code was compiled for. Each file
states them:

  export  the program JSON of the torch.export archive (its user inputs and outputs, in call order)
  aoti    the package's wrapper metadata, key `eagle3.signature` (written by the builder at compile time)
  neuron  not read here (one NxD model per model; its calls are checked by backends/neuron.py)

(each backend, backends/, names its reader)

so that a manifest edited after the build (weights reordered or dropped, a KV cache of another shape or
dtype, a graph file swapped for another role's, an index input declared float32, another vocab size)
is refused before any native code sees a tensor of the wrong shape.
"""
from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .manifest import BundleError, GraphEntry, Manifest

METADATA_KEY = "eagle3.signature"
MAX_ENTRY_BYTES = 64 << 20  # a program JSON / metadata entry this large is not a graph of ours

# torch.export's serialized ScalarType codes (torch/_export/serde/schema.py) -> manifest dtype names
_EXPORT_DTYPES = {7: "float32", 13: "bfloat16", 6: "float16", 5: "int64", 4: "int32", 12: "bool"}
Spec = tuple[list[int], str]  # (shape, dtype name)


@dataclass(frozen=True)
class Signature:
    inputs: list[Spec]  # in call order: weights, packed copies, KV cache, rank, the role's inputs
    outputs: list[Spec]

    def to_json(self) -> str:
        return json.dumps({"inputs": self.inputs, "outputs": self.outputs})


def _entry(z: zipfile.ZipFile, suffix: str, name: str) -> bytes | None:
    found = [i for i in z.infolist() if i.filename.endswith(suffix)]
    if not found:
        return None
    if len(found) > 1 or found[0].file_size > MAX_ENTRY_BYTES:
        raise BundleError(f"{name}: {len(found)} entries named *{suffix}, or one too large; not a graph of a bundle")
    return z.read(found[0])


def export_signature(z: zipfile.ZipFile, name: str) -> Signature | None:
    raw = _entry(z, "/models/model.json", name)
    if raw is None:
        return None
    gm = json.loads(raw)["graph_module"]
    values, sig = gm["graph"]["tensor_values"], gm["signature"]

    def spec(arg_name: str) -> Spec:
        v = values[arg_name]
        return [int(d["as_int"]) for d in v["sizes"]], _EXPORT_DTYPES.get(v["dtype"], f"code {v['dtype']}")

    inputs = [spec(s["user_input"]["arg"]["as_tensor"]["name"]) for s in sig["input_specs"] if "user_input" in s]
    outputs = [spec(s["user_output"]["arg"]["as_tensor"]["name"]) for s in sig["output_specs"]
               if "user_output" in s]
    return Signature(inputs, outputs)


def aoti_signature(z: zipfile.ZipFile, name: str) -> Signature | None:
    raw = _entry(z, "wrapper_metadata.json", name)
    if raw is None:
        return None
    text = json.loads(raw).get(METADATA_KEY)
    if text is None:
        return None
    data = json.loads(text)
    return Signature([(list(s), d) for s, d in data["inputs"]], [(list(s), d) for s, d in data["outputs"]])


def read_zip_signature(path: Path, reader, backend: str, kind: str) -> Signature:
    """The signature a zip-packaged graph file states (`reader`: export_signature, aoti_signature). Raises
    BundleError when the file is not that backend's kind of graph file (`kind`) or states no signature."""
    try:
        with zipfile.ZipFile(path) as z:
            sig = reader(z, str(path))
    except BundleError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise BundleError(f"{path}: not a readable {backend} graph file ({type(e).__name__}: {e}); rebuild the "
                          "bundle") from e
    if sig is None:
        raise BundleError(f"{path}: a {backend} bundle's graph file must be {kind}, this one is not (or was "
                          "built without its signature); rebuild the bundle")
    return sig


def expected_inputs(m: Manifest, g: GraphEntry) -> list[tuple[str, Spec | None]]:
    """(what, spec) of every input the manifest says the graph takes, in call order (None: a packed copy,
    whose layout is the host's to make)."""
    out: list[tuple[str, Spec | None]] = []
    for w in g.weights:
        model, _, tensor = w.partition("/")
        t = m.models[model].tensors[tensor]
        out.append((f"weight {w}", (t.shape, t.dtype)))
    out += [(f"packed copy of {p.weight}", None) for p in g.packed]
    state = next(s for s in m.state if s.name == g.state)
    out.append((f"KV cache {state.name}", (state.shape, state.dtype)))
    out += [(f"input {s.name}", (s.shape, s.dtype)) for s in g.inputs]
    return out


def check_signature(m: Manifest, g: GraphEntry, sig: Signature, path: Path) -> None:
    """The graph file's own signature against what the manifest will pass it and read from it."""
    want = expected_inputs(m, g)
    if len(sig.inputs) != len(want):
        raise BundleError(f"{path}: the graph file takes {len(sig.inputs)} inputs, the manifest passes it "
                          f"{len(want)} (graph {g.name}: weights, packed copies, KV cache, inputs); the manifest does "
                          "not belong to this graph — rebuild the bundle")
    for i, ((what, spec), (shape, dtype)) in enumerate(zip(want, sig.inputs)):
        if spec is not None and [list(spec[0]), spec[1]] != [list(shape), dtype]:
            raise BundleError(f"{path}: input {i} of the graph file is {dtype} {list(shape)}, the manifest passes "
                              f"{what} as {spec[1]} {list(spec[0])} (graph {g.name}); rebuild the bundle")
    outs = [(o.shape, o.dtype) for o in g.outputs]
    if [[list(s), d] for s, d in sig.outputs] != [[list(s), d] for s, d in outs]:
        raise BundleError(f"{path}: the graph file returns {[[list(s), d] for s, d in sig.outputs]}, the manifest "
                          f"reads {[[list(s), d] for s, d in outs]} (graph {g.name}: {', '.join(o.name for o in g.outputs)}); "
                          "rebuild the bundle")
