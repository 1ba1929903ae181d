"""Which GEMM the float32 projections of CPU graphs take, chosen by measurement on this host.

For every token row count the graphs' projections use (decode-sized ones, and prefill chunks where a format serves
them: forms_for), the forms this torch offers are timed side by side over the target's own projection shapes
(rank-local, as many weights as fit in MAX_BYTES, so they stream from memory as they do when served): "plain" (what
linear does unpacked: a weight-stationary mm up to SMALL_ROWS rows, F.linear beyond) and each packing of
eagle3_runtime.packing that can be made here (MKL's sgemm pack, oneDNN's blocked layout, Inductor's CPU GEMM
template over its own blocked layout, compiled here as the graphs compile it, with Inductor's register blocking and,
where that takes two passes over the rows, also with the blocking that takes one ("blocked:8x8":
lowerings.one_pass_blocking); for a draft stored in bfloat16, the bfloat16 forms too (oneDNN's GEMM, Inductor's
template over a bfloat16 blocked copy), measured over the draft's own shapes). The fastest wins unless it beats the
form before it in FORMS by less than MARGIN (noise must not flip a choice, which would change every graph's cache
key), and it must win in each of ROUNDS rounds timed one after the other (a close call that one round gives a later
form and the next round an earlier one goes to the earlier form: this host's memory bandwidth drifts by the second,
and a bandwidth-bound form feels it more than a compute-bound one).

Each answer is memoised under the compile cache (`host/`), keyed on the CPU model, thread count, torch and
shapes, per row count, so a host measures each once; the manifest's build record keeps it (`inspect` prints
it; the runtime says so at load when it runs on another CPU than the one that chose).
"""
from __future__ import annotations

import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from eagle3_runtime.manifest import BLOCKED, BLOCKED_FORMATS, ONEDNN_FORMATS
from eagle3_runtime.packing import BLOCKED_DTYPES, FORMATS, ONEDNN_ROWS, cpu_model, pack_weight, packed_linear

from ..files import atomic_write
from ..models.linear import SMALL_ROWS, linear
from . import lowerings

PLAIN = "plain"
FORMS = (PLAIN, *FORMATS)
F_LINEAR = "F.linear"  # (x @ W.T as ATen runs it: measured by benchmarks/linear_layout.py, never chosen)
MAX_BYTES = 1 << 30  # weights allocated for the measurement (more than any CPU's last-level cache)
MARGIN = 0.03
ROUNDS = 2
REPEATS = 25  # per decode-sized row count (AMD EPYC, 2 threads: at 9 the 1-row medians of plain and oneDNN
# swapped order between runs, at 25 they held); 3 per prefill-sized one (each pass is 10-100x longer)


def projection_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """(out, in) of every nn.Linear of a (meta, rank-local) model, in module order."""
    return [tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)]


def fit(shapes: list[tuple[int, int]], max_bytes: int = MAX_BYTES) -> list[tuple[int, int]]:
    """The shapes, each kept with the same share of its count, cut down to at most max_bytes of float32."""
    total = sum(o * i for o, i in shapes) * 4
    if total <= max_bytes:
        return list(shapes)
    counts: dict[tuple[int, int], int] = {}
    for s in shapes:
        counts[s] = counts.get(s, 0) + 1
    scale = max_bytes / total
    return [s for s, n in counts.items() for _ in range(max(1, int(n * scale)))]


def variant(fmt: str, blocking: tuple[int, int]) -> str:
    """The form name of `fmt` compiled with register blocking (block_m, block_n): "blocked:8x8"."""
    return f"{fmt}:{blocking[0]}x{blocking[1]}"


def form_parts(form: str) -> tuple[str, tuple[int, int] | None]:
    """A form name -> (its packing format, its register blocking or None for Inductor's choice)."""
    fmt, _, blocking = form.partition(":")
    return fmt, (tuple(int(x) for x in blocking.split("x")) if blocking else None)


def blocked_variants(shapes: list[tuple[int, int]], rows: int, fmt: str = BLOCKED) -> list[str]:
    """A blocked form's other candidate at a row count: the one-pass register blocking, where Inductor's choice
    for one of the shapes takes more than one pass over the rows."""
    one = lowerings.one_pass_blocking(rows)
    threads = torch.get_num_threads()
    theirs = {lowerings.blocking(rows, o, i, threads, BLOCKED_DTYPES[fmt]) for o, i in set(shapes)}
    return [variant(fmt, one)] if one and any(b and b[0] < rows for b in theirs) else []


def time_forms(shapes: list[tuple[int, int]], rows: int, forms: list[str], repeats: int = REPEATS,
               weights: list[torch.Tensor] | None = None, rounds: int = 1) -> dict[str, list[float]]:
    """Per form, the median ms of one pass of x @ W.T over every shape, x of `rows` rows, in each of `rounds`
    rounds of `repeats` passes (forms interleaved; the first pass warms up and is not kept); a blocked form
    Inductor fails to compile here is left out."""
    torch.manual_seed(0)
    weights = weights if weights is not None else [torch.rand(o, i) - 0.5 for o, i in shapes]
    xs = {w.shape[1]: torch.rand(rows, w.shape[1]) for w in weights}

    def each(fns):
        return lambda: [fn(xs[w.shape[1]]) for w, fn in zip(weights, fns)]

    calls = {}
    with torch.inference_mode():
        for form in forms:
            if form == PLAIN:  # (what linear does unpacked: weight-stationary up to SMALL_ROWS rows, else F.linear)
                calls[form] = each([(lambda x, w=w: linear(x, w)) for w in weights])
            elif form == F_LINEAR:
                calls[form] = each([(lambda x, w=w: F.linear(x, w)) for w in weights])
            elif form_parts(form)[0] in BLOCKED_FORMATS:
                try:
                    calls[form] = blocked_pass(weights, rows, xs, form_parts(form)[1], form_parts(form)[0])
                except Exception:  # (Inductor could not generate it here: not a candidate, as where it has no ISA)
                    continue
            else:
                calls[form] = each([(lambda x, w=w, p=pack_weight(w, rows, form), f=form: packed_linear(x, p, w, None, f))
                                    for w in weights])
        ms: dict[str, list[float]] = {f: [] for f in calls}
        for rep in range(repeats * rounds + 1):
            for form, run in calls.items():
                t0 = time.perf_counter()
                run()
                if rep:
                    ms[form].append((time.perf_counter() - t0) * 1e3)
    return {f: [round(statistics.median(v[i * repeats:(i + 1) * repeats]), 3) for i in range(rounds)]
            for f, v in ms.items()}


def blocked_pass(weights: list[torch.Tensor], rows: int, xs: dict[int, torch.Tensor],
                 blocking: tuple[int, int] | None = None, fmt: str = BLOCKED):
    """One pass of x @ W.T over `weights` in a blocked format (register blocking: Inductor's, or `blocking`),
    compiled now as the aoti backend compiles a graph (one AOTInductor package, the template per GEMM, in a private
    directory removed after): a callable."""
    import torch._inductor.config

    threads = torch.get_num_threads()
    dtype = BLOCKED_DTYPES[fmt]
    block_ns = [lowerings.block_n(rows, *w.shape, threads, blocking, dtype) for w in weights]
    if None in block_ns:
        raise RuntimeError(f"no {dtype} register blocking {blocking} here")
    copies = tuple(pack_weight(w, rows, fmt, bn) for w, bn in zip(weights, block_ns))
    widths, ks = [w.shape[0] for w in weights], sorted(xs)

    class Pass(nn.Module):
        def forward(self, xs_, copies_):
            by_k = dict(zip(ks, xs_))
            return [packed_linear(by_k[c.shape[1]], c, None, None, fmt, n=n, threads=threads)
                    for c, n in zip(copies_, widths)]

    args = (tuple(xs[k] for k in ks), copies)
    with tempfile.TemporaryDirectory(prefix="eagle3-gemm-") as d, lowerings.env("TORCHINDUCTOR_CACHE_DIR", d), \
            lowerings.packed_input_lowering(), lowerings.lean_wrapper(), \
            torch._inductor.config.patch({"compile_threads": 1}):
        ep = torch.export.export(Pass(), args, strict=False)
        run = torch._inductor.aoti_load_package(torch._inductor.aoti_compile_and_package(ep, package_path=f"{d}/pass.pt2"))
    return lambda: run(*args)


def pick(ms: dict[str, list[float]]) -> str:
    """The fastest form of every round (ms: per form, one median per round), unless an earlier one in FORMS is
    within MARGIN of it; where the rounds disagree, the earliest in FORMS of their choices (a format's other
    blockings after it)."""
    order = sorted(ms, key=lambda f: (FORMS.index(form_parts(f)[0]), f))
    picks = set()
    for i in range(min(len(ms[f]) for f in order)):
        best = min(order, key=lambda f: ms[f][i])
        picks.add(next(f for f in order if ms[f][i] <= ms[best][i] * (1 + MARGIN)))
    return next(f for f in order if f in picks)


def forms_for(rows: int, formats: list[str]) -> list[str]:
    """The candidates at a row count: "plain" and `formats`; beyond SMALL_ROWS (prefill chunks) only the formats
    whose one copy serves every row count (oneDNN's: an MKL copy per prefill bucket would cost the weights'
    size again for each)."""
    return [PLAIN, *(f for f in formats if rows <= SMALL_ROWS or f in ONEDNN_FORMATS)]


def choose(shapes: list[tuple[int, int]], rows: list[int], formats: list[str], cache_dir: Path | None) -> dict:
    """{"cpu", "threads", "torch", "rows": {"R": {"choice": form, "ms": {form: [ms per round]}}}} for every row count
    in `rows` with a candidate besides "plain" (forms_for); memoised in cache_dir per row count (a new bucket
    measures its own row count only: the others keep their choice, and the graphs their cache keys)."""
    import torch._inductor.config

    rows = sorted({r for r in rows if 0 < r <= SMALL_ROWS or (r > SMALL_ROWS and len(forms_for(r, formats)) > 1)})
    shapes = fit(shapes)
    ident = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
             "capability": torch.backends.cpu.get_cpu_capability(), "forms": [PLAIN, *formats],
             "shapes": sorted({(o, i, shapes.count((o, i))) for o, i in shapes}), "onednn_rows": ONEDNN_ROWS,
             "repeats": REPEATS, "rounds": ROUNDS}
    if set(BLOCKED_FORMATS) & set(formats):
        ident |= {"blocked_kernel": lowerings.kernel_tag(), "blockings": "inductor's, one-pass"}
    if torch._inductor.config.cpp.simdlen:  # (what the aoti backend compiles blocked forms for: its codegen())
        ident["code"] = [torch._inductor.config.cpp.simdlen, torch._inductor.config.cpp.march]
    out = {"cpu": ident["cpu"], "threads": ident["threads"], "torch": ident["torch"], "rows": {}}
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
    for r in missing:
        forms = forms_for(r, formats)
        forms += [v for f in BLOCKED_FORMATS if f in forms for v in blocked_variants(shapes, r, f)]
        ms = time_forms(shapes, r, forms, repeats=REPEATS if r <= SMALL_ROWS else 3, weights=weights, rounds=ROUNDS) \
            if len(forms) > 1 else {PLAIN: [0.0]}
        known[str(r)] = {"choice": pick(ms), "ms": ms}
    if path is not None and missing:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({**out, "rows": known}, indent=1))
    return {**out, "rows": {str(r): known[str(r)] for r in rows}}


def named(fmt: str, rows: list[int]) -> dict:
    """A `choose` record that gives every row count `fmt` serves (forms_for) the format `fmt` (nothing measured)."""
    return {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__, "named": fmt,
            "rows": {str(r): {"choice": fmt, "ms": {}} for r in sorted({r for r in rows if r > 0})
                     if fmt in forms_for(r, [fmt])}}


def choices(record: dict | None) -> dict[int, str]:
    """Row count -> form of a `choose` record (a packing format, or a format with its blocking: form_parts); row
    counts left plain are absent."""
    if not record:
        return {}
    return {int(r): v["choice"] for r, v in record["rows"].items() if v["choice"] != PLAIN}
