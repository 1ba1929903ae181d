"""eagle3-build: compile | plan | inspect | make-tiny-pair"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .errors import UserError
from .recipe import RecipeError, load_recipe, select_pair

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Offline compile-and-package toolchain for EAGLE3 speculative decoding.")
console = Console(stderr=True)
out_console = Console()


def fail(msg: str, code: int = 2):
    console.print(f"[bold red]error:[/] {msg}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _pairs(recipe: Path, pair: Optional[str]):
    try:
        return select_pair(load_recipe(recipe), pair)
    except RecipeError as e:
        fail(str(e))


def _with_backend(pairs, backend: Optional[str]):
    from .backends import BACKENDS

    if backend is None:
        return pairs
    if backend not in BACKENDS:
        fail(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    return [p.model_copy(update={"backend": backend}) for p in pairs]


@app.command("compile")
def compile_cmd(
    recipe: Path = typer.Argument(..., help="recipe YAML"),
    pair: Optional[str] = typer.Option(None, "--pair", help="build only this pair"),
    out: Optional[Path] = typer.Option(None, "--out", help="bundle directory (one pair only); default artifacts/<name>"),
    artifacts: Path = typer.Option(Path("artifacts"), "--artifacts", help="where bundles go by default"),
    backend: Optional[str] = typer.Option(None, "--backend", help="override the recipe's backend (export | neuron)"),
):
    """Build every pair of RECIPE into a bundle."""
    from .backends import preflight

    pairs = _with_backend(_pairs(recipe, pair), backend)
    if out is not None and len(pairs) != 1:
        fail(f"--out needs exactly one pair, the recipe has {len(pairs)}; add --pair NAME")
    try:  # before importing torch / reading checkpoints: a missing SDK fails at once
        for p in pairs:
            preflight(p.backend)
    except UserError as e:
        fail(str(e))
    from .bundle import build_bundle

    for p in pairs:
        dest = out or artifacts / p.name
        t0 = time.perf_counter()
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False) as progress:
            task = progress.add_task(f"{p.name}: loading checkpoints", total=None)

            def report(stage, spec, i, n):
                if stage == "graph":
                    progress.update(task, total=n, completed=i,
                                    description=f"{p.name}: {'graph ' + spec.name if spec else 'graphs done'}")
                else:
                    progress.update(task, description=f"{p.name}: {stage}")

            try:
                manifest = build_bundle(p, dest, report)
            except (UserError, RecipeError) as e:
                progress.stop()
                fail(f"pair {p.name}: {e}")
        size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
        console.print(f"[green]built[/] {dest}  ({len(manifest.graphs)} graphs, {size / 1e6:.1f} MB, "
                      f"{time.perf_counter() - t0:.1f}s)", highlight=False)
        for note in manifest.notes:
            console.print(f"  note: {note}", highlight=False)


@app.command("plan")
def plan_cmd(
    recipe: Path = typer.Argument(..., help="recipe YAML"),
    pair: Optional[str] = typer.Option(None, "--pair"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    backend: Optional[str] = typer.Option(None, "--backend", help="override the recipe's backend"),
):
    """List every graph a recipe builds, without loading checkpoints or compiling (for neuron: every
    NEFF with its exact neuronx-cc command; no SDK needed)."""
    from .graphs import plan_graphs

    result = []
    for p in _with_backend(_pairs(recipe, pair), backend):
        K = p.speculation.num_speculative_tokens
        cc_args = None
        if p.backend == "neuron":
            from .backends.neuron import compiler_args

            try:
                cc_args = compiler_args(p.backend_options)
            except UserError as e:
                fail(f"pair {p.name}: {e}")
        graphs = []
        for g in plan_graphs(p.buckets.prefill, p.buckets.batch):
            tokens = g.bucket if g.role.endswith("prefill") else g.bucket * (K + 1 if g.role in (
                "target_verify", "draft_catchup") else 1)
            entry = {"name": g.name, "role": g.role, "model": g.model, "bucket": g.bucket, "tokens_per_call": tokens}
            if cc_args is not None:
                from .backends.neuron import neuronx_cc_command

                entry["artifact"] = f"graphs/{g.name}.neff"
                entry["compiler_command"] = neuronx_cc_command(g.name, cc_args)
            graphs.append(entry)
        result.append({"pair": p.name, "backend": p.backend, "tp_degree": p.parallel.tp_degree,
                       "num_speculative_tokens": K, "compiler_args": cc_args, "graphs": graphs})
    if as_json:
        out_console.print_json(json.dumps(result))
        return
    for r in result:
        t = Table(title=f"{r['pair']}  (backend {r['backend']}, TP {r['tp_degree']}, K {r['num_speculative_tokens']})")
        for c in ("graph", "role", "model", "bucket", "tokens/call"):
            t.add_column(c)
        for g in r["graphs"]:
            t.add_row(g["name"], g["role"], g["model"], str(g["bucket"]), str(g["tokens_per_call"]))
        out_console.print(t)
        out_console.print(f"{len(r['graphs'])} graphs")
        if r["compiler_args"] is not None:
            out_console.print("neuronx-cc commands (run by torch_neuronx.trace, one NEFF per graph):")
            for g in r["graphs"]:
                out_console.print(f"  {g['compiler_command']}", highlight=False, soft_wrap=True)


@app.command("inspect")
def inspect_cmd(bundle: Path = typer.Argument(..., help="bundle directory"),
                as_json: bool = typer.Option(False, "--json")):
    """Summarise a bundle's manifest."""
    from eagle3_runtime.bundle import BundleError, read_manifest

    try:
        m = read_manifest(bundle)
    except BundleError as e:
        fail(str(e))
    if as_json:
        out_console.print_json(m.model_dump_json())
        return
    out_console.print(f"[bold]{m.name}[/]  schema {m.schema_version}, built {m.created_at}")
    out_console.print(f"backend {m.backend}, dtype {m.dtype}, TP {m.tp_degree}, K {m.num_speculative_tokens}, "
                      f"max_num_seqs {m.max_num_seqs}, max_model_len {m.max_model_len}")
    out_console.print(f"prefill buckets {m.prefill_buckets}, batch buckets {m.batch_buckets}, "
                      f"aux layers {m.aux_layer_ids}, draft format {m.draft_format}")
    for k, s in m.sources.items():
        out_console.print(f"{k}: {s['uri']}" + (f" @ {s['resolved_revision']}" if s.get("resolved_revision") else ""))
    out_console.print("toolchain: " + ", ".join(f"{k} {v}" for k, v in m.toolchain.items()))
    t = Table(title="graphs")
    for c in ("graph", "role", "bucket", "inputs", "size", "sha256"):
        t.add_column(c)
    for g in m.graphs:
        ins = " ".join(f"{i.name}{i.shape}" for i in g.inputs)
        t.add_row(g.name, g.role, str(g.bucket), ins, f"{g.file.size / 1e3:.0f} kB", g.file.sha256[:12])
    out_console.print(t)
    for name, model in m.models.items():
        size = sum(f.size for f in model.weight_files)
        out_console.print(f"weights {name}: {len(model.tensors)} tensors, {size / 1e6:.1f} MB, "
                          f"{len(model.weight_files)} rank file(s)")


@app.command("make-tiny-pair")
def make_tiny_pair_cmd(
    directory: Path = typer.Argument(..., help="output directory"),
    draft_format: str = typer.Option("speculators", "--draft-format", help="eagle | speculators | specforge"),
    seed: int = typer.Option(0, "--seed"),
    k: int = typer.Option(3, "-k", "--num-speculative-tokens"),
    max_model_len: int = typer.Option(256, "--max-model-len"),
    dtype: str = typer.Option("float32", "--dtype"),
    target_format: str = typer.Option("hf", "--target-format", help="hf | gguf (the recipe then uses target.gguf)"),
):
    """Write a random tiny Llama target, a tiny EAGLE3 draft and a recipe for them."""
    from .tiny import DRAFT_FORMATS, TARGET_FORMATS, make_tiny_pair

    if draft_format not in DRAFT_FORMATS:
        fail(f"--draft-format {draft_format!r}: choose one of {', '.join(DRAFT_FORMATS)}")
    if target_format not in TARGET_FORMATS:
        fail(f"--target-format {target_format!r}: choose one of {', '.join(TARGET_FORMATS)}")
    try:
        recipe = make_tiny_pair(directory, draft_format=draft_format, seed=seed, num_speculative_tokens=k,
                                max_model_len=max_model_len, dtype=dtype, target_format=target_format)
    except ValueError as e:
        fail(str(e))
    console.print(f"wrote {recipe}", highlight=False)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
