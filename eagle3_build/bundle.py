"""recipe pair -> bundle directory.

checkpoints -> pair checks -> per-rank weights -> one graph file per (role, bucket) -> tokenizer and
configs -> manifest.json. Everything is written into a temporary sibling directory that is renamed
into place only when complete, so a failed build never leaves a half-written bundle.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import platform
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from eagle3_runtime.manifest import (MANIFEST, SCHEMA_VERSION, FileEntry, GraphEntry, Manifest, ModelEntry,
                                     TensorSpec, file_entry)

from . import __version__
from .backends import get_backend
from .checkpoints import (DraftCheckpoint, TargetCheckpoint, load_draft, load_target, resolve)
from .errors import UserError
from .graphs import OUTPUT_NAMES, GraphSpec, build_graph_module, plan_graphs, step_inputs
from .pair import build_draft, build_target, check_pair, check_target
from .recipe import PairRecipe
from .sharding import write_rank_files

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


@dataclass
class LoadedPair:
    pair: PairRecipe
    target: TargetCheckpoint
    draft: DraftCheckpoint


def load_pair(pair: PairRecipe) -> LoadedPair:
    target = load_target(resolve(pair.target, "target"))
    check_target(target)
    draft = load_draft(resolve(pair.draft, "draft"), target)
    check_pair(target, draft)
    return LoadedPair(pair, target, draft)


def graph_plan(pair: PairRecipe) -> list[GraphSpec]:
    return plan_graphs(pair.buckets.prefill, pair.buckets.batch)


Progress = Callable[[str, GraphSpec | None, int, int], None]


def build_bundle(pair: PairRecipe, out: Path, progress: Progress | None = None) -> Manifest:
    """Build one pair into `out` (replaced atomically). Returns the manifest written."""
    progress = progress or (lambda *a: None)
    if pair.parallel.tp_degree != 1:
        raise UserError(f"pair {pair.name}: tp_degree {pair.parallel.tp_degree} is not supported by this build "
                        "yet (TP 1 only); `eagle3-build plan` lists its graphs")
    backend = get_backend(pair.backend)
    progress("load", None, 0, 0)
    lp = load_pair(pair)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        manifest = _write_bundle(lp, tmp, backend, progress)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _replace_dir(tmp: Path, out: Path) -> None:
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def _write_bundle(lp: LoadedPair, root: Path, backend, progress: Progress) -> Manifest:
    pair, t, d = lp.pair, lp.target, lp.draft
    dtype = DTYPES[pair.dtype]
    K = pair.speculation.num_speculative_tokens
    B, L = pair.serving.max_num_seqs, pair.serving.max_model_len
    aux_ids = d.args.aux_layer_ids

    target_model = build_target(t, aux_ids)
    draft_model = build_draft(d)
    models = {"target": target_model, "draft": draft_model}

    # --- weights
    progress("weights", None, 0, 0)
    model_entries: dict[str, ModelEntry] = {}
    weight_shapes: dict[str, tuple[list[int], torch.dtype]] = {}
    bindings: dict[str, dict[str, str]] = {}  # model -> {param name -> qualified weight name}
    for name, ckpt, model in (("target", t, target_model), ("draft", d, draft_model)):
        from .graphs import model_weight_names
        pnames = model_weight_names(model)
        own = [n for n in pnames if n in ckpt.tensors]
        bindings[name] = {n: (f"{name}/{n}" if n in own else f"target/{n}") for n in pnames}
        files = write_rank_files(ckpt.tensors, own, dtype, root / "weights" / name, pair.parallel.tp_degree)
        shapes = dict(model.named_parameters()) | dict(model.named_buffers())
        tensors = {}
        for n in own:
            tdt = dtype if shapes[n].dtype.is_floating_point else shapes[n].dtype
            tensors[n] = TensorSpec(name=n, shape=list(shapes[n].shape), dtype=dtype_name(tdt))
            weight_shapes[f"{name}/{n}"] = (list(shapes[n].shape), tdt)
        model_entries[name] = ModelEntry(
            name=name, architecture="llama" if name == "target" else f"eagle3-{d.format}",
            config=_jsonable(dataclasses.asdict(ckpt.args)),
            weight_files=[file_entry(root, f) for f in files], tensors=tensors)

    # --- KV caches
    state = {
        "target": TensorSpec(name="target_kv", shape=target_model.kv_shape(B, L), dtype=dtype_name(dtype)),
        "draft": TensorSpec(name="draft_kv", shape=draft_model.kv_shape(B, L), dtype=dtype_name(dtype)),
    }

    # --- graphs
    specs = graph_plan(pair)
    (root / "graphs").mkdir()
    graph_entries = []
    for i, spec in enumerate(specs):
        progress("graph", spec, i, len(specs))
        model = models[spec.model]
        module, pnames = build_graph_module(spec, model)
        qnames = [bindings[spec.model][n] for n in pnames]
        weights = tuple(torch.empty(weight_shapes[q][0], dtype=weight_shapes[q][1]) for q in qnames)
        kv_spec = state[spec.model]
        kv = torch.zeros(kv_spec.shape, dtype=dtype)
        ins = step_inputs(spec, K=K, target_hidden=t.args.hidden_size, draft_hidden=d.args.hidden_size,
                          dtype=dtype)
        example = tuple(torch.zeros(shape, dtype=dt_) for _, shape, dt_ in ins)
        args = (weights, kv, *example)
        outs = backend.output_specs(module, args)
        path = root / "graphs" / f"{spec.name}{backend.SUFFIX}"
        info = backend.compile_graph(module, args, path)
        graph_entries.append(GraphEntry(
            name=spec.name, role=spec.role, model=spec.model, bucket=spec.bucket, file=file_entry(root, path),
            weights=qnames, state=kv_spec.name,
            inputs=[TensorSpec(name=n, shape=s, dtype=dtype_name(x)) for n, s, x in ins],
            outputs=[TensorSpec(name=n, shape=s, dtype=dtype_name(x))
                     for n, (s, x) in zip(OUTPUT_NAMES[spec.role], outs)],
            backend=info))
    progress("graph", None, len(specs), len(specs))

    # --- tokenizer and configs
    progress("tokenizer", None, 0, 0)
    files = _write_tokenizer(t, root / "tokenizer")
    (root / "configs").mkdir()
    for name, ckpt in (("target", t), ("draft", d)):
        p = root / "configs" / f"{name}_config.json"
        p.write_text(json.dumps(ckpt.config, indent=2, sort_keys=True, default=str))
        files.append(p)

    manifest = Manifest(
        schema_version=SCHEMA_VERSION, name=pair.name,
        created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        backend=pair.backend, dtype=pair.dtype, tp_degree=pair.parallel.tp_degree, num_speculative_tokens=K,
        max_num_seqs=B, max_model_len=L, prefill_buckets=list(pair.buckets.prefill),
        batch_buckets=list(pair.buckets.batch), aux_layer_ids=list(aux_ids), vocab_size=t.args.vocab_size,
        eos_token_ids=t.eos_token_ids, bos_token_id=t.bos_token_id, draft_format=d.format,
        recipe=pair.model_dump(mode="json"),
        sources={"target": t.source.record(), "draft": d.source.record()},
        toolchain=toolchain(backend), models=model_entries, state=[state["target"], state["draft"]],
        graphs=graph_entries, files=[file_entry(root, f) for f in sorted(files)], notes=d.notes)
    (root / MANIFEST).write_text(manifest.model_dump_json(indent=2))
    return manifest


def toolchain(backend) -> dict[str, str]:
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "eagle3_build": __version__,
            "backend": backend.NAME, "backend_version": backend.version()}


def _jsonable(x):
    return json.loads(json.dumps(x, default=list))


def _write_tokenizer(t: TargetCheckpoint, out: Path) -> list[Path]:
    """Save the target's tokenizer as transformers configures it, and prove the runtime's plain
    `tokenizers` load encodes exactly like it (special tokens included)."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    src = t.source
    try:
        if src.gguf_file:
            tok = AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file)
        else:
            tok = AutoTokenizer.from_pretrained(src.directory)
    except Exception as e:
        raise UserError(f"target {src.spec.uri}: cannot load its tokenizer with transformers: {e}") from None
    if not getattr(tok, "is_fast", False):
        raise UserError(f"target {src.spec.uri}: only a slow tokenizer is available; the runtime needs "
                        "tokenizer.json (a fast tokenizer)")
    out.mkdir(parents=True)
    tok.save_pretrained(out)
    plain = Tokenizer.from_file(str(out / "tokenizer.json"))
    for s in TOKENIZER_PROBES:
        if plain.encode(s).ids != tok(s)["input_ids"]:
            raise UserError(f"target {src.spec.uri}: tokenizer.json encodes {s!r} differently from transformers; "
                            "the runtime could not reproduce the target's tokenization")
    return sorted(p for p in out.rglob("*") if p.is_file())


TOKENIZER_PROBES = ["Hello, world!", "  The quick brown fox\njumps over 12345 lazy dogs.", "ünïcödé ✓ 中文"]
