"""recipe pair -> bundle directory.

checkpoints -> pair checks -> per-rank weights -> one graph file per (role, bucket) -> tokenizer and
configs -> manifest.json. Everything is written into a temporary sibling directory that is renamed
into place only when complete, so a failed build never leaves a half-written bundle.
"""
from __future__ import annotations

import contextlib
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

from eagle3_runtime.manifest import (MANIFEST, SCHEMA_VERSION, GraphEntry, Manifest, ModelEntry,
                                     TensorSpec, file_entry)

from . import __version__
from .backends import get_backend
from .checkpoints import (DraftCheckpoint, TargetCheckpoint, load_draft, load_target, resolve)
from .errors import UserError
from .graphs import OUTPUT_NAMES, GraphSpec, build_graph_module, plan_graphs, step_inputs
from .graphs import model_weight_names
from .models.eagle3 import draft_layout
from .models.llama import llama_layout
from .pair import build_draft, build_target, check_pair, check_target
from .recipe import PairRecipe
from .sharding import check_tp, tensor_plan, write_rank_files

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
    backend = get_backend(pair.backend, pair.backend_options)
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


def layouts(pair: PairRecipe, t: TargetCheckpoint, d: DraftCheckpoint):
    """Target and draft layouts for the recipe's tp degree and hidden padding (refusing what cannot fit)."""
    tp, Hp = pair.parallel.tp_degree, pair.parallel.padded_hidden_size
    check_tp("target", t.args.num_heads, t.args.num_kv_heads, tp)
    check_tp("draft", d.args.num_heads, d.args.num_kv_heads, tp)
    if Hp is not None:
        if Hp < t.args.hidden_size:
            raise UserError(f"parallel.padded_hidden_size {Hp} is smaller than the target hidden size "
                            f"{t.args.hidden_size}")
        if d.args.hidden_size != t.args.hidden_size:
            raise UserError(f"parallel.padded_hidden_size needs draft hidden == target hidden "
                            f"({d.args.hidden_size} != {t.args.hidden_size})")
    return llama_layout(t.args, tp, Hp), draft_layout(d.args, tp, Hp, Hp)


def _write_bundle(lp: LoadedPair, root: Path, backend, progress: Progress) -> Manifest:
    pair, t, d = lp.pair, lp.target, lp.draft
    dtype = DTYPES[pair.dtype]
    K = pair.speculation.num_speculative_tokens
    B, L = pair.serving.max_num_seqs, pair.serving.max_model_len
    tp = pair.parallel.tp_degree
    aux_ids = d.args.aux_layer_ids
    t_layout, d_layout = layouts(pair, t, d)

    # rank-local models on the meta device: their parameter shapes are the per-rank shapes
    target_model = build_target(t, aux_ids, t_layout)
    draft_model = build_draft(d, d_layout)
    models = {"target": (target_model, t, t_layout), "draft": (draft_model, d, d_layout)}

    # --- weights: padded + sharded, streamed tensor by tensor into one file per rank
    model_entries: dict[str, ModelEntry] = {}
    weight_shapes: dict[str, tuple[list[int], torch.dtype]] = {}
    bindings: dict[str, dict[str, str]] = {}  # model -> {param name -> qualified weight name}
    for name, (model, ckpt, layout) in models.items():
        progress(f"weights ({name})", None, 0, 0)
        pnames = model_weight_names(model)
        own = [n for n in pnames if n in ckpt.tensors]
        bindings[name] = {n: (f"{name}/{n}" if n in own else f"target/{n}") for n in pnames}
        local = dict(model.named_parameters()) | dict(model.named_buffers())
        shapes = {n: (list(local[n].shape), dtype if local[n].dtype.is_floating_point else local[n].dtype)
                  for n in pnames}
        files = write_rank_files(name, ckpt.tensors, own, shapes, layout, root / "weights" / name)
        tensors = {}
        for n in own:
            plan = tensor_plan(name, n)
            tensors[n] = TensorSpec(name=n, shape=shapes[n][0], dtype=dtype_name(shapes[n][1]),
                                    pad=plan.pad, shard=plan.shard)
            weight_shapes[f"{name}/{n}"] = shapes[n]
        model_entries[name] = ModelEntry(
            name=name, architecture="llama" if name == "target" else f"eagle3-{d.format}",
            config=_jsonable(dataclasses.asdict(ckpt.args)), layout=layout.to_dict(),
            weight_files=[file_entry(root, f) for f in files], tensors=tensors)

    # --- KV caches (rank-local heads); K scratch positions past max_model_len take the writes of
    #     rows that ride along in a verify batch after their speculation cutoff
    state = {
        "target": TensorSpec(name="target_kv", shape=target_model.kv_shape(B, L + K), dtype=dtype_name(dtype)),
        "draft": TensorSpec(name="draft_kv", shape=draft_model.kv_shape(B, L + K), dtype=dtype_name(dtype)),
    }

    # --- graphs (traced once; with tp > 1 the collectives are traced against a fake process group)
    specs = graph_plan(pair)
    (root / "graphs").mkdir()
    graph_entries, extra_files = [], []
    with tracing_process_group(tp):
        for i, spec in enumerate(specs):
            progress("graph", spec, i, len(specs))
            model = models[spec.model][0]
            module, pnames = build_graph_module(spec, model)
            qnames = [bindings[spec.model][n] for n in pnames]
            weights = tuple(torch.empty(weight_shapes[q][0], dtype=weight_shapes[q][1]) for q in qnames)
            kv_spec = state[spec.model]
            kv = torch.zeros(kv_spec.shape, dtype=dtype)
            ins = step_inputs(spec, K=K, target_hidden=t_layout.padded_hidden,
                              draft_hidden=d_layout.padded_hidden, dtype=dtype)
            example = tuple(torch.zeros(shape, dtype=dt_) for _, shape, dt_ in ins)
            args = (weights, kv, *example)
            outs = backend.output_specs(module, args)
            path = root / "graphs" / f"{spec.name}{backend.SUFFIX}"
            info = backend.compile_graph(module, args, path)
            if info.get("neff"):  # the raw NEFF next to the loadable module
                extra_files.append(path.with_name(info["neff"]))
            graph_entries.append(GraphEntry(
                name=spec.name, role=spec.role, model=spec.model, bucket=spec.bucket,
                file=file_entry(root, path), weights=qnames, state=kv_spec.name,
                inputs=[TensorSpec(name=n, shape=s, dtype=dtype_name(x)) for n, s, x in ins],
                outputs=[TensorSpec(name=n, shape=s, dtype=dtype_name(x))
                         for n, (s, x) in zip(OUTPUT_NAMES[spec.role], outs)],
                backend=info))
    progress("graph", None, len(specs), len(specs))

    # --- tokenizer and configs
    progress("tokenizer", None, 0, 0)
    files = _write_tokenizer(t, root / "tokenizer") + extra_files
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


@contextlib.contextmanager
def tracing_process_group(tp: int):
    """A fake world of `tp` ranks so in-graph collectives trace with the right shapes; nothing runs."""
    if tp == 1:
        yield
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise UserError("a torch.distributed process group is already initialised in the build process; "
                        "run eagle3-build compile as a plain process (not under torchrun)")
    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def toolchain(backend) -> dict[str, str]:
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "eagle3_build": __version__,
            "backend": backend.NAME, "backend_version": backend.version()}
    if hasattr(backend, "toolchain"):
        info |= backend.toolchain()
    return info


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
