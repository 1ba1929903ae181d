"""Which format the float32 projections of CPU graphs take, chosen by measurement on this host.

Per token row count, the candidates (plain and each packing format this torch can make and compile here) are
timed side by side over the model's own projection shapes, streamed from memory as when served; the fastest wins
unless an earlier candidate is within MARGIN, in each of ROUNDS rounds. A round ends early once its ranking is
clear (every pass of the fastest faster than every pass of the others by CLEAR). Answers are memoised per host under the
compile cache and kept in the manifest's build record. docs/architecture.md (glossary) and docs/linear-layout.md.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from eagle3_runtime.launch import HUGE_PAGES_ENV
from eagle3_runtime.manifest import BLOCKED, BLOCKED_FORMATS, ONEDNN_FORMATS
from eagle3_runtime.packing import BLOCKED_DTYPES, FORMATS, ONEDNN_ROWS, cpu_model, pack_weight, packed_linear

from ...files import atomic_write
from ...host import available_memory_gb, busy_cores, host_cores
from ...models.linear import SMALL_ROWS, linear
from . import inductor_internals as inductor

PLAIN = "plain"
CANDIDATES = (PLAIN, *FORMATS)
F_LINEAR = "F.linear"  # (x @ W.T as ATen runs it: a reference for benchmarks, never chosen)
MAX_BYTES = 1 << 30  # weights allocated for the measurement (more than any CPU's last-level cache)
MARGIN = 0.03
ROUNDS = 2
CLEAR = 0.10  # a round stops after MIN_PASSES once the fastest's slowest pass beats the others' fastest by this
MIN_PASSES = 3
MARK = "eagle3-gemm"  # (gemm_worker's answer lines start with it)
WORKER_MEMORY_GB = 3  # a compile worker: torch and Inductor, the copies of up to MAX_BYTES of weights, gcc
REPEATS = 25  # per decode-sized row count (fewer let close medians swap between runs: docs/linear-layout.md); 3 per
# prefill-sized one (each pass is 10-100x longer)


def projection_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """(out, in) of every nn.Linear of a (meta, rank-local) model, in module order."""
    return [tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)]


def fit_in_memory(shapes: list[tuple[int, int]], max_bytes: int = MAX_BYTES) -> list[tuple[int, int]]:
    """The shapes, each kept with the same share of its count, cut down to at most max_bytes of float32."""
    total = sum(o * i for o, i in shapes) * 4
    if total <= max_bytes:
        return list(shapes)
    counts: dict[tuple[int, int], int] = {}
    for s in shapes:
        counts[s] = counts.get(s, 0) + 1
    scale = max_bytes / total
    return [s for s, n in counts.items() for _ in range(max(1, int(n * scale)))]


def blocked_format(fmt: str, blocking: tuple[int, int]) -> str:
    """The candidate name of `fmt` compiled with register blocking (block_m, block_n): "blocked:8x8"."""
    return f"{fmt}:{blocking[0]}x{blocking[1]}"


def format_parts(candidate: str) -> tuple[str, tuple[int, int] | None]:
    """A candidate name -> (its packing format, its register blocking or None for Inductor's choice)."""
    fmt, _, blocking = candidate.partition(":")
    return fmt, (tuple(int(x) for x in blocking.split("x")) if blocking else None)


def blocked_variants(shapes: list[tuple[int, int]], rows: int, fmt: str = BLOCKED) -> list[str]:
    """A blocked candidate's other candidate at a row count: the one-pass register blocking, where Inductor's choice
    for one of the shapes takes more than one pass over the rows."""
    one_pass = inductor.one_pass_blocking(rows)
    threads = torch.get_num_threads()
    inductors = {inductor.blocking(rows, o, i, threads, BLOCKED_DTYPES[fmt]) for o, i in set(shapes)}
    return [blocked_format(fmt, one_pass)] if one_pass and any(b and b[0] < rows for b in inductors) else []


def time_formats(shapes: list[tuple[int, int]], rows: int, candidates: list[str], repeats: int = REPEATS,
               weights: list[torch.Tensor] | None = None, rounds: int = 1,
               note: Callable[[str], None] | None = None, compiled: dict[str, Path | str] | None = None
               ) -> dict[str, list[float]]:
    """Per candidate, the median ms of one pass of x @ W.T over every shape, x of `rows` rows, in each of `rounds`
    rounds of `repeats` passes (candidates interleaved; the first pass warms up and is not kept); a blocked candidate
    Inductor fails to compile here is left out, with a warning naming it (the record lists the candidates timed).
    compiled: blocked candidates already compiled (compile_candidates: a package path, or why it failed)."""
    torch.manual_seed(0)
    weights = weights if weights is not None else [torch.rand(o, i) - 0.5 for o, i in shapes]
    xs = {w.shape[1]: torch.rand(rows, w.shape[1]) for w in weights}

    def over_weights(fns):
        return lambda: [fn(xs[w.shape[1]]) for w, fn in zip(weights, fns)]

    calls = {}
    with torch.inference_mode():
        for i, candidate in enumerate(candidates):
            if note is not None:
                note(f"GEMM formats at {rows} row(s): preparing {candidate} ({i + 1}/{len(candidates)})")
            if candidate == PLAIN:  # (what linear does unpacked: weight-stationary up to SMALL_ROWS rows, else F.linear)
                calls[candidate] = over_weights([(lambda x, w=w: linear(x, w)) for w in weights])
            elif candidate == F_LINEAR:
                calls[candidate] = over_weights([(lambda x, w=w: F.linear(x, w)) for w in weights])
            elif format_parts(candidate)[0] in BLOCKED_FORMATS:
                try:
                    calls[candidate] = blocked_pass(weights, rows, xs, candidate, (compiled or {}).get(candidate))
                except Exception as e:  # (Inductor could not generate it here: not a candidate)
                    warnings.warn(f"GEMM format {candidate} left out of the measurement: Inductor could not compile "
                                  f"it on torch {torch.__version__}: {type(e).__name__}: {str(e)[:200]}", RuntimeWarning)
                    continue
            else:
                calls[candidate] = over_weights([(lambda x, w=w, p=pack_weight(w, rows, candidate), f=candidate:
                                                  packed_linear(x, p, w, None, f)) for w in weights])
        if note is not None:
            note(f"GEMM formats at {rows} row(s): timing {len(calls)} candidates, up to {repeats * rounds} passes each")
        for run in calls.values():  # (warm-up, not kept)
            run()
        medians: dict[str, list[float]] = {f: [] for f in calls}
        for _ in range(rounds):
            ms: dict[str, list[float]] = {f: [] for f in calls}
            for rep in range(repeats):
                for candidate, run in calls.items():
                    t0 = time.perf_counter()
                    run()
                    ms[candidate].append((time.perf_counter() - t0) * 1e3)
                if rep + 1 >= MIN_PASSES and ranking_clear(ms):
                    break
            for f, v in ms.items():
                medians[f].append(round(statistics.median(v), 3))
    return medians


def ranking_clear(ms: dict[str, list[float]]) -> bool:
    """Whether more passes cannot change the winner: the fastest candidate's slowest pass beats every other
    candidate's fastest by CLEAR."""
    if len(ms) < 2:
        return True
    best = min(ms, key=lambda f: statistics.median(ms[f]))
    return all(max(ms[best]) * (1 + CLEAR) < min(v) for f, v in ms.items() if f != best)


def _one_pass(weights: list[torch.Tensor], rows: int, xs: dict[int, torch.Tensor], candidate: str, threads: int):
    """(module, args): one pass of x @ W.T over `weights` in a blocked candidate's format and register blocking
    (Inductor's, or the candidate's), its packed copies among the args."""
    fmt, blocking = format_parts(candidate)
    dtype = BLOCKED_DTYPES[fmt]
    block_ns = [inductor.block_n(rows, *w.shape, threads, blocking, dtype) for w in weights]
    if None in block_ns:
        raise RuntimeError(f"no {dtype} register blocking {blocking} here")
    copies = tuple(pack_weight(w, rows, fmt, bn) for w, bn in zip(weights, block_ns))
    widths, ks = [w.shape[0] for w in weights], sorted(xs)

    class OnePass(nn.Module):
        def forward(self, xs_, copies_):
            by_k = dict(zip(ks, xs_))
            return [packed_linear(by_k[c.shape[1]], c, None, None, fmt, n=n, threads=threads)
                    for c, n in zip(copies_, widths)]

    return OnePass(), (tuple(xs[k] for k in ks), copies)


def _compile(module: nn.Module, args: tuple, package: str) -> None:
    """The pass compiled as the aoti backend compiles a graph (one AOTInductor package, the template per GEMM, in a
    private Inductor cache removed after)."""
    with tempfile.TemporaryDirectory(prefix="eagle3-gemm-") as d, inductor.inductor_cache(d), \
            inductor.packed_input_lowering(), inductor.lean_wrapper(), inductor.config_patch({"compile_threads": 1}):
        inductor.compile_and_package(torch.export.export(module, args, strict=False), package, {})


def compile_pass(shapes: list[tuple[int, int]], rows: int, candidate: str, threads: int, package: str) -> None:
    """A blocked candidate's pass over `shapes` compiled into the package `package` (gemm_worker's task: the
    package takes any weights of these shapes)."""
    weights = [torch.empty(o, i) for o, i in shapes]
    _compile(*_one_pass(weights, rows, {i: torch.empty(rows, i) for i in {i for _, i in shapes}}, candidate, threads),
             package)


def blocked_pass(weights: list[torch.Tensor], rows: int, xs: dict[int, torch.Tensor], candidate: str,
                 compiled: Path | str | None = None):
    """One pass of x @ W.T over `weights` in a blocked candidate: a callable. compiled: the package
    compile_pass made for it (or why it failed); else compiled here."""
    module, args = _one_pass(weights, rows, xs, candidate, torch.get_num_threads())
    if isinstance(compiled, str):
        raise RuntimeError(compiled)
    if compiled is None:
        with tempfile.TemporaryDirectory(prefix="eagle3-gemm-") as d:
            _compile(module, args, f"{d}/pass.pt2")
            run = inductor.load_package(f"{d}/pass.pt2")
    else:
        run = inductor.load_package(str(compiled))
    return lambda: run(*args)


def compile_candidates(shapes: list[tuple[int, int]], jobs: list[tuple[int, str]], out_dir: Path,
                       note: Callable[[str], None] | None = None) -> dict[tuple[int, str], Path | str]:
    """Each (rows, blocked candidate) of `jobs` compiled into a package under out_dir, on as many worker processes
    (gemm_worker) as the idle cores and the memory give, at most one per job (gcc is most of a candidate's cost, one
    core each): (rows, candidate) -> the package's path, or why Inductor could not compile it. One job, or one idle
    core (a worker's start-up, ~4 s of importing torch, would not pay): nothing (time_formats compiles each in this
    process)."""
    idle = min(host_cores(), (os.cpu_count() or 1) - (busy_cores(0.2) or 0.0))  # (busy: over every CPU)
    procs = min(len(jobs), int(idle + 0.5), max(1, int(available_memory_gb() // WORKER_MEMORY_GB)))
    if procs < 2:
        return {}
    simdlen, march = inductor.isa_config()
    tasks = [json.dumps({"id": n, "shapes": shapes, "rows": r, "candidate": c, "threads": torch.get_num_threads(),
                         "simdlen": simdlen, "march": march, "out": str(out_dir / f"pass-{n}.pt2")})
             for n, (r, c) in enumerate(jobs)]
    pending, out, lock = list(reversed(tasks)), {}, threading.Lock()
    if note is not None:
        note(f"GEMM formats: compiling {len(jobs)} blocked candidates on {procs} processes")

    def lane(k: int) -> None:
        with open(out_dir / f"worker-{k}.log", "w") as log:
            p = subprocess.Popen([sys.executable, "-m", f"{__package__}.gemm_worker", str(os.getpid())],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
            try:
                serve(p, log.name)
            finally:
                with contextlib.suppress(OSError):
                    p.stdin.close()
                p.wait()

    def serve(p: subprocess.Popen, log: str) -> None:
        while True:
            with lock:
                task = pending.pop() if pending else None
            if task is None:
                break
            n = json.loads(task)["id"]
            try:
                p.stdin.write(task + "\n")
                p.stdin.flush()
                answer = next((ln for ln in p.stdout if ln.startswith(f"{MARK} {n} ")), None)
            except BrokenPipeError:
                answer = None
            got = json.loads(answer.split(" ", 2)[2]) if answer else \
                {"error": f"the compile worker exited with {p.wait()} (log {log})"}
            with lock:
                out[jobs[n]] = Path(got["ok"]) if "ok" in got else got["error"]
                if note is not None:
                    note(f"GEMM formats: {len(out)}/{len(jobs)} blocked candidates compiled ({jobs[n][1]} "
                         f"at {jobs[n][0]} row(s))")
            if answer is None:
                return

    threads = [threading.Thread(target=lane, args=(k,), daemon=True) for k in range(procs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for job in jobs:  # (a job a dead worker never took)
        out.setdefault(job, "the compile worker exited before compiling it")
    return out


def pick_fastest(ms: dict[str, list[float]]) -> str:
    """The fastest candidate of every round (ms: per candidate, one median per round), unless an earlier one in
    CANDIDATES is within MARGIN of it; where the rounds disagree, the earliest in CANDIDATES of their choices (a format's other
    blockings after it)."""
    order = sorted(ms, key=lambda f: (CANDIDATES.index(format_parts(f)[0]), f))
    picks = set()
    for i in range(min(len(ms[f]) for f in order)):
        best = min(order, key=lambda f: ms[f][i])
        picks.add(next(f for f in order if ms[f][i] <= ms[best][i] * (1 + MARGIN)))
    return next(f for f in order if f in picks)


def formats_for(rows: int, formats: list[str]) -> list[str]:
    """The candidates at a row count: "plain" and `formats`; beyond SMALL_ROWS (prefill chunks) only the formats
    whose one copy serves every row count (oneDNN's: an MKL copy per prefill bucket would cost the weights'
    size again for each)."""
    return [PLAIN, *(f for f in formats if rows <= SMALL_ROWS or f in ONEDNN_FORMATS)]


def choose(shapes: list[tuple[int, int]], rows: list[int], formats: list[str], cache_dir: Path | None,
           note: Callable[[str], None] | None = None) -> dict:
    """{"cpu", "threads", "torch", "formats", "torch_hooks", "rows": {"R": {"choice": candidate, "ms": {candidate:
    [ms per round]}}}} for every row count in `rows` with a candidate besides "plain" (formats_for); memoised in cache_dir per row count (a new bucket
    measures its own row count only: the others keep their choice, and the graphs their cache keys)."""
    rows = sorted({r for r in rows if 0 < r <= SMALL_ROWS or (r > SMALL_ROWS and len(formats_for(r, formats)) > 1)})
    shapes = fit_in_memory(shapes)
    ident = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
             "capability": torch.backends.cpu.get_cpu_capability(), "formats": [PLAIN, *formats],
             "shapes": sorted({(o, i, shapes.count((o, i))) for o, i in shapes}), "onednn_rows": ONEDNN_ROWS,
             "repeats": REPEATS, "rounds": ROUNDS, "huge_pages": os.environ.get(HUGE_PAGES_ENV, "0")}
    if set(BLOCKED_FORMATS) & set(formats):
        ident |= {"blocked_kernel": inductor.kernel_tag(), "blockings": "inductor's, one-pass"}
    if inductor.isa_config()[0]:  # (what the aoti backend compiles blocked candidates for: its codegen())
        ident["code"] = list(inductor.isa_config())
    out = {"cpu": ident["cpu"], "threads": ident["threads"], "torch": ident["torch"], "formats": ident["formats"],
           "torch_hooks": inductor.report()["hooks"], "rows": {}}
    path, known = None, {}
    if cache_dir is not None:
        digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
        path = Path(cache_dir) / "host" / f"gemm-{digest}.json"
        try:
            known = json.loads(path.read_text())["rows"]
        except (OSError, ValueError, KeyError, TypeError):
            known = {}
    missing = [r for r in rows if str(r) not in known]
    weights = [torch.rand(o, i) - 0.5 for o, i in shapes] if missing and formats else []
    per_rows = {}
    for r in missing:
        candidates = formats_for(r, formats)
        per_rows[r] = candidates + [v for f in BLOCKED_FORMATS if f in candidates for v in blocked_variants(shapes, r, f)]
    with tempfile.TemporaryDirectory(prefix="eagle3-gemm-") as d:
        compiled = compile_candidates(shapes, [(r, c) for r, cs in per_rows.items() if len(cs) > 1 for c in cs
                                               if format_parts(c)[0] in BLOCKED_FORMATS], Path(d), note)
        for r, candidates in per_rows.items():  # (timed after every compile: one thing at a time on the cores)
            ms = time_formats(shapes, r, candidates, repeats=REPEATS if r <= SMALL_ROWS else 3, weights=weights,
                              rounds=ROUNDS, note=note, compiled={c: p for (r_, c), p in compiled.items() if r_ == r}
                              ) if len(candidates) > 1 else {PLAIN: [0.0]}
            known[str(r)] = {"choice": pick_fastest(ms), "ms": ms}
    if path is not None and missing:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({**out, "rows": known}, indent=1))
    return {**out, "rows": {str(r): known[str(r)] for r in rows}}


def named_choice(fmt: str, rows: list[int]) -> dict:
    """A `choose` record that gives every row count `fmt` serves (formats_for) the format `fmt` (nothing measured)."""
    return {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__, "named": fmt,
            "torch_hooks": inductor.report()["hooks"],
            "rows": {str(r): {"choice": fmt, "ms": {}} for r in sorted({r for r in rows if r > 0})
                     if fmt in formats_for(r, [fmt])}}


def format_per_rows(record: dict | None) -> dict[int, str]:
    """Row count -> candidate of a `choose` record (a packing format, or a format with its blocking: format_parts); row
    counts left plain are absent."""
    if not record:
        return {}
    return {int(r): v["choice"] for r, v in record["rows"].items() if v["choice"] != PLAIN}
