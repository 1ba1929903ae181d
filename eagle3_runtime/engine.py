"""Continuous-batching EAGLE3 engine over a bundle's graphs (gpt-fast style: plain PyTorch loops).

Sequence state: `ids` = prompt + generated; the last id is *pending* (not yet in the target's KV
cache) at position p = len(ids) - 1. Active sequences occupy KV-cache rows 0..n-1 (a finished row
is refilled by moving the last row into it), so a batch-bucket-b graph works on rows 0..b-1.

One step = at most one prefill (a waiting request, into row n) + one decode step for all rows, in
a speculation shape of the batch bucket it runs (speculation.SpecShape: a chain, a tree or none; the
bucket's own, one fixed by --speculation, or the one adaptive.py expects fastest of the bucket's menu):

  speculative round (any row can speculate):
    draft     the root's children from the last prefill / catch-up, then depth - 1 draft_step calls
              over the frontier (tree.py); a chain of an unrolled bundle: one draft_chain call
    verify    target runs the tree's N nodes (node i at KV slot p + i) in one pass
    accept    greedy: the longest path of target-argmax tokens (found by the verify graph itself where the
              bundle accepts in the graph, Manifest.accept); sampled: the path of the target's own samples
              (sampling.verify_tree_sampled); the accepted nodes' KV moves to p..p+a
    catch-up  draft re-runs positions p..p+a with the target's aux states -> the next root's children
  rows past the speculation cutoff (graph_contract.can_speculate) take only the verify's first token (one
  token per step; their verify writes land in the KV scratch positions of graph_contract.kv_cache_length);
  when no row can speculate, the plain target_decode graph runs instead.
Target decode / verify calls take the bundle's smallest context bucket holding every KV slot the batch's rows
write (graph_contract.pick_context), else the whole-cache graph.

An exception in a step (run_forever) fails the requests of that step (every active row, and the one
being admitted) with an "error" event naming it, frees their rows and goes on; after
MAX_CONSECUTIVE_FAILURES failed steps in a row, or an error marked fatal, the engine stops: waiting
requests fail, submit() raises EngineDead and `on_dead` is called (the server then exits non-zero).
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .adaptive import MODES, NONE, Chooser, bucket_chooser
from .buckets import pick_bucket
from .errors import Eagle3Error
from .bundle import Bundle, call_by_name
from .graph_contract import can_speculate, draft_unrolled, pick_context
from .manifest import torch_dtype
from .contention import ThreadGovernor
from .speculation import NO_SPECULATION, SpecShape
from .metrics import Metrics, SpecStats
from .sampling import SamplingParams, Uniform, Uniforms, next_token, verify_tree_sampled
from .tokenizer import BundleTokenizer, TextStream
from .tree import Drafting, Tree, accept_greedy, dummy_tree


class RequestError(Eagle3Error, ValueError):
    """A request this bundle cannot serve (the message has the numbers; `param` names the field)."""

    def __init__(self, message: str, param: str = "prompt"):
        super().__init__(message)
        self.param = param


class QueueFull(RuntimeError):
    pass


class EngineDead(Eagle3Error, RuntimeError):
    """The engine stopped after an error it cannot recover from; nothing more can be served."""


MAX_CONSECUTIVE_FAILURES = 3  # failed steps in a row (no step succeeding in between) before the engine stops
log = logging.getLogger("eagle3_runtime.engine")


def is_fatal(e: BaseException) -> bool:
    """Errors after which no later step can be trusted: out of memory, or one marked `fatal` (a TP rank
    left mid-call: the ranks are out of step)."""
    return isinstance(e, MemoryError) or bool(getattr(e, "fatal", False))


def describe_error(e: BaseException) -> str:
    """One line naming an exception: its type and the first line of its message, at most 300 characters."""
    text = str(e).strip().splitlines()
    line = f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
    return line if len(line) <= 300 else line[:297] + "..."


@dataclass
class Event:
    """What a request's listener receives: new tokens (and their text), then a finish reason."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # with finish_reason "error": what failed (one line)


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    stop: tuple[str, ...] = ()
    speculative: bool = True
    on_event: Callable[[Event], None] | None = None
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


_ids = itertools.count()


@dataclass
class Sequence:
    req: Request
    ids: list[int]
    n_prompt: int
    row: int
    rng: Uniforms  # the request's uniforms, one per output position (sampling.Uniforms)
    stats: SpecStats
    draft_top: tuple[list[int], list[float]] | None = None  # the draft's top-k for the next root, log-probs
    draft_hidden: torch.Tensor | None = None
    gap: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # (aux, next token) the draft has not seen
    finish_reason: str | None = None
    text_stream: "TextStream | None" = None  # the text so far (with a tokenizer)
    first_token_time: float | None = None

    @property
    def pos(self) -> int:
        return len(self.ids) - 1

    def take_draft(self, out: dict[str, torch.Tensor], row: int) -> None:
        """The draft's state after a prefill / catch-up graph: its top-k for the next root, and its hidden."""
        self.draft_top = out["token"][row].tolist(), out["logprob"][row].tolist()
        self.draft_hidden = out["hidden"][row]

    @property
    def generated(self) -> list[int]:
        return self.ids[self.n_prompt:]

    def u(self) -> Uniform:
        """The uniforms from this request's next output position on."""
        return self.rng.at(len(self.ids) - self.n_prompt)


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: SpecStats
    seconds: float  # from the call to this request's last token
    target_passes: int  # target passes run meanwhile (generate_many: shared with the requests batched with it)
    ttft: float | None = None  # s from the call to the first token (the prefill's), same clock as `seconds`


def check_request(n_prompt: int, max_tokens: int, longest_prompt: int, max_model_len: int) -> None:
    """The admission rule for one request (the engine's, and what `verify` checks its prompts against);
    `longest_prompt`: Manifest.longest_prompt."""
    if n_prompt < 1:
        raise RequestError("the prompt is empty (0 tokens)")
    if n_prompt >= max_model_len:
        raise RequestError(f"the prompt has {n_prompt} tokens, max_model_len is {max_model_len}: no room to generate")
    if n_prompt > longest_prompt:
        raise RequestError(f"the prompt has {n_prompt} tokens, the largest prefill bucket of this bundle is "
                           f"{longest_prompt} and it has no verify graph to continue past it (max_model_len "
                           f"{max_model_len}); shorten the prompt or rebuild with a larger buckets.prefill")
    if max_tokens < 1:
        raise RequestError(f"max_tokens must be at least 1 (got {max_tokens})", "max_tokens")
    if n_prompt + max_tokens > max_model_len:
        raise RequestError(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                           f"{max_model_len}; ask for at most {max_model_len - n_prompt} tokens", "max_tokens")


class Engine:
    def __init__(self, bundle: Bundle, *, tokenizer: BundleTokenizer | None = None,
                 speculative: bool = True, max_queue: int = 64, metrics: Metrics | None = None,
                 on_dead: Callable[[str], None] | None = None, speculation: str = "always",
                 governor: ThreadGovernor | None = None):
        self.bundle = bundle
        self.governor = governor  # (the decode steps' thread count under contention: contention.py)
        m = bundle.manifest
        self.K, self.max_len, self.max_num_seqs = m.num_speculative_tokens, m.max_model_len, m.max_num_seqs
        self.prefill_buckets, self.batch_buckets, self.context_buckets = \
            m.prefill_buckets, m.batch_buckets, m.context_buckets
        self.eos = set(m.eos_token_ids)
        self.tokenizer = tokenizer  # (None: token ids only, no text)
        self.menus = {b: {s.describe(): s for s in m.shapes(b)} for b in self.batch_buckets}
        tags = sorted({s.tag for b in self.batch_buckets for s in m.shapes(b) if s.speculates})
        if speculation not in MODES and speculation not in tags:
            raise Eagle3Error(f"--speculation {speculation[:40]!r}: choose one of {', '.join(MODES)} or a shape of "
                              f"this bundle ({', '.join(tags) or 'it has none'})")
        self.speculative = speculative and speculation != "none"
        self.accept_in_graph = m.accept == "graph"  # greedy rows: the verify graph's path, else the host's
        self.unroll_draft = m.unroll_draft
        # what each batch bucket runs without a chooser: its own shape, or the one --speculation names
        self.shapes: dict[int, SpecShape] = {
            b: next((s for s in m.shapes(b) if s.tag == speculation), m.speculation[b]) for b in self.batch_buckets}
        self.longest_prompt = m.longest_prompt()
        self.catchup_len = {g.bucket: g.input("next_tokens").shape[1] for g in m.graphs if g.role == "draft_catchup"}
        # per batch bucket, the shape whose verify graph continues a prompt past its first prefill chunk: the
        # fewest seconds per node where warm-up timed them, else the most nodes (_prefill_plan)
        self.chunk_shapes: dict[int, SpecShape] = {}
        for b in self.batch_buckets:
            shapes = [s for s in m.shapes(b) if s.speculates]
            if shapes:
                per_node = {s.describe(): bundle.seconds.get(m.graph("target_verify", b, s).name, 0.0) / s.num_nodes
                            for s in shapes}
                self.chunk_shapes[b] = min(shapes, key=lambda s: (per_node[s.describe()], -s.num_nodes))
        self._graphs: dict[tuple, tuple] = {}  # (role, bucket, id(shape)) -> (graph, its metrics label): _run
        # --speculation auto: per batch bucket, plain decoding or a shape of its menu, whichever is expected
        # to yield the most tokens per second here (adaptive.py: step costs, warm-up then live, x acceptance)
        self.choosers: dict[int, Chooser] = {}
        self.max_queue = max_queue
        self.metrics = metrics or Metrics(self.K)
        if governor is not None:
            self.metrics.threads.set(governor.current)
        self.metrics.record_warmup(m, bundle.timings)
        if speculation == "auto" and self.speculative:
            seconds = bundle.seconds
            for b in self.batch_buckets:
                try:
                    chooser = bucket_chooser(m, seconds, b)
                except KeyError:  # (a graph not timed: no warm-up ran) every round speculates
                    continue
                if chooser is not None:
                    self.choosers[b] = chooser
                    self.metrics.record_choice(b, chooser)
        for b in self.batch_buckets:
            if b not in self.choosers:  # (fixed: what every round of the bucket runs)
                served = self.shapes[b].describe() if self.speculative and self.shapes[b].speculates else NONE
                self.metrics.speculation.labels(str(b), served).set(1)
        hidden = next((o for g in m.graphs if g.role == "draft_catchup" for o in g.outputs if o.name == "hidden"), None)
        self.hidden, self.hidden_dtype = (hidden.shape[-1], torch_dtype(hidden.dtype)) if hidden else (0, None)
        self.aux_width = m.graph("target_decode", self.batch_buckets[0]).outputs[-1].shape[-1]
        self.waiting: collections.deque[Request] = collections.deque()
        self.active: list[Sequence] = []
        self.target_passes = 0
        self._cv = threading.Condition()
        self._stop = False
        self._admitting: Request | None = None  # popped from the queue, not yet an active row
        self.failures = 0  # failed steps since the last good one
        self.dead: str | None = None  # why the engine stopped, once it has
        self.on_dead = on_dead

    def speculation_report(self) -> list[str]:
        """One line per batch bucket: the speculation served and why."""
        if not self.speculative:
            return ["speculation: none (--speculation none)"]
        return [f"speculation at batch {b}: " + (self.choosers[b].reason() if b in self.choosers else
                                                  f"{self.shapes[b].describe()} (every round)")
                for b in self.batch_buckets]

    # ------------------------------------------------------------------ admission

    def check_request(self, n_prompt: int, max_tokens: int) -> None:
        check_request(n_prompt, max_tokens, self.longest_prompt, self.max_len)

    def submit(self, req: Request) -> None:
        """Queue a request (thread-safe). Raises RequestError / QueueFull."""
        self.check_request(len(req.prompt_ids), req.max_tokens)
        req.sampling.validate()
        with self._cv:
            if self.dead is not None:
                raise EngineDead(f"the engine stopped after an error ({self.dead}); restart the server")
            # (a finished row counts as free: its listener has had its last event before the engine frees it)
            busy = sum(s.finish_reason is None for s in list(self.active))
            if len(self.waiting) + busy >= self.max_num_seqs + self.max_queue:
                raise QueueFull(f"all {self.max_num_seqs} sequence slots are busy and {len(self.waiting)} "
                                f"requests are waiting (max queue {self.max_queue})")
            self.waiting.append(req)
            self.metrics.queue_depth.set(len(self.waiting))
            self._cv.notify()

    # ------------------------------------------------------------------ the loop

    def has_work(self) -> bool:
        return bool(self.waiting or self.active)

    @torch.inference_mode()  # (a step's eager tensors skip autograd's bookkeeping: ~2% of a speculative round)
    def step(self) -> None:
        """At most one prefill, then one decode step over every active row."""
        self._drop_cancelled()
        req = None
        with self._cv:
            if self.waiting and len(self.active) < self.max_num_seqs:
                req = self._admitting = self.waiting.popleft()
                self.metrics.queue_depth.set(len(self.waiting))
        if req is not None:
            t0 = time.perf_counter()
            self._prefill(req)
            self._admitting = None
            self.metrics.step_latency.labels("prefill").observe(time.perf_counter() - t0)
            self._free_finished()
        if self.active:
            gov, rows = self.governor, len(self.active)
            threads = gov.next_threads() if gov is not None else None
            if threads is not None and threads != torch.get_num_threads():
                torch.set_num_threads(threads)
            t0 = time.perf_counter()
            kind = self._decode_step()
            seconds = time.perf_counter() - t0
            self.metrics.step_latency.labels(kind).observe(seconds)
            if gov is not None:
                switches = gov.switches
                gov.observe((kind, rows), threads, seconds)
                if gov.switches != switches:
                    self.metrics.threads.set(gov.current)
                    self.metrics.thread_switches.inc(gov.switches - switches)
            self._free_finished()
        self.metrics.running.set(len(self.active))

    def run_forever(self) -> None:
        """Background loop (one thread): steps while there is work, sleeps otherwise; survives a failed
        step (see the module docstring) until the engine is stopped or dead."""
        while True:
            with self._cv:
                while not self.has_work() and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
            try:
                self.step()
                self.failures = 0
            except Exception as e:  # noqa: BLE001 (any error: the requests of this step get it, the loop goes on)
                self._step_failed(e)
                if self.dead is not None:
                    return

    def _step_failed(self, e: Exception) -> None:
        """Fail the step's requests with the error, free every row; stop for good if the error is fatal
        or keeps coming."""
        msg = describe_error(e)
        log.error("engine step failed; its requests get the error: %s", msg, exc_info=e)
        self.failures += 1
        failed = [s.req for s in self.active if s.finish_reason is None]
        if self._admitting is not None and all(r is not self._admitting for r in failed):
            failed.append(self._admitting)
        self.active.clear()  # (every row's cache contents are rewritten by its next prefill)
        self._admitting = None
        self.metrics.running.set(0)
        fatal = is_fatal(e) or self.failures >= MAX_CONSECUTIVE_FAILURES
        with self._cv:
            if fatal:
                self.dead = msg if is_fatal(e) else f"{self.failures} steps failed in a row, the last with {msg}"
                failed += list(self.waiting)
                self.waiting.clear()
                self.metrics.queue_depth.set(0)
        for req in failed:
            self.metrics.finished("error")
            if req.on_event:
                req.on_event(Event([], "", "error", error=msg))
        if fatal:
            log.error("engine stopped: %s", self.dead)
            if self.on_dead:
                self.on_dead(self.dead)

    def abort_all(self) -> None:
        """End every request: waiting ones at once, active ones at the next step (their rows freed)."""
        with self._cv:
            for req in self.waiting:
                if req.on_event:
                    req.on_event(Event([], "", "abort"))
            self.waiting.clear()
            for s in list(self.active):
                s.req.cancel()
            self._cv.notify_all()

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            for req in self.waiting:
                if req.on_event:
                    req.on_event(Event([], "", "abort"))
            self.waiting.clear()
            self._cv.notify_all()

    def generate(self, prompt_ids: list[int], max_tokens: int, speculative: bool = True,
                 sampling: SamplingParams | None = None, stop: tuple[str, ...] = ()) -> Generation:
        """Run one request to completion on the calling thread (no background loop)."""
        return self.generate_many([prompt_ids], max_tokens, speculative, [sampling], stop)[0]

    def generate_many(self, prompts: list[list[int]], max_tokens: int, speculative: bool = True,
                      sampling: list[SamplingParams | None] | None = None, stop: tuple[str, ...] = ()
                      ) -> list[Generation]:
        """Run requests to completion on the calling thread, batched as the server batches them (up to
        max_num_seqs rows at a time, the rest queued); one Generation per prompt, in order. `sampling`: one
        SamplingParams per prompt (None: greedy)."""
        sampling = list(sampling) if sampling is not None else [None] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling)} sampling parameters")
        reqs = [Request(list(p), max_tokens, s or SamplingParams(temperature=0.0), tuple(stop), speculative)
                for p, s in zip(prompts, sampling)]
        for req in reqs:  # refused before any runs
            self.check_request(len(req.prompt_ids), req.max_tokens)
            req.sampling.validate()
        t0, passes0 = time.perf_counter(), self.target_passes
        done: dict[str, tuple[Sequence, float, int]] = {}  # request id -> (sequence, finish time, target passes)
        pending = collections.deque(reqs)
        self._on_finish = lambda seq: done.__setitem__(seq.req.id, (seq, time.perf_counter(), self.target_passes))
        try:
            while pending or self.has_work():
                while pending and len(self.waiting) + len(self.active) < self.max_num_seqs:
                    self.submit(pending.popleft())
                self.step()
        finally:
            self._on_finish = None
        out = []
        for req in reqs:
            seq, t1, passes = done[req.id]
            ttft = seq.first_token_time - t0 if seq.first_token_time is not None else None
            text = seq.text_stream.text if seq.text_stream is not None else ""
            out.append(Generation(list(req.prompt_ids), seq.generated, text, seq.finish_reason, seq.stats,
                                  t1 - t0, passes - passes0, ttft))
        return out

    _on_finish: Callable[[Sequence], None] | None = None

    # ------------------------------------------------------------------ prefill

    def _prefill(self, req: Request) -> None:
        """The prompt's first chunk through a prefill graph (of the bucket the plan picks), the rest, if any, through
        the verify graph of the plan's shape (a chain over its nodes: the same causal attention over the cached
        prefix), then the draft's prefill over the first chunk, the rest left to it as a gap (_catch_up_gaps)."""
        row, n = len(self.active), len(req.prompt_ids)
        seq = Sequence(req, list(req.prompt_ids), n, row, req.sampling.uniforms(), SpecStats(self.K))
        self.active.append(seq)
        drafts = self._speculates(seq) and self.K > 0
        bsz = pick_bucket(self.batch_buckets, len(self.active))
        S, shape = self._prefill_plan(n, bsz, drafts)
        first = min(S, n)
        tokens = torch.zeros(1, S, dtype=torch.int64)
        tokens[0, :first] = torch.tensor(seq.ids[:first])
        slot, last = torch.tensor([row]), torch.tensor([first - 1])
        out = self._run("target_prefill", S, tokens=tokens, slot=slot, last=last)
        self.target_passes += 1
        logits, rest = out["logits"][0], []
        for q in range(first, n, shape.num_nodes if shape is not None else n):
            logits, aux = self._continue_prompt(seq, bsz, shape, q)
            rest += list(aux)
        self.metrics.prompt_tokens.inc(n)
        self._emit(seq, [next_token(logits, req.sampling, seq.u())])
        if seq.finish_reason is None and drafts:
            nxt = torch.zeros(1, S, dtype=torch.int64)
            nxt[0, :first] = torch.tensor(seq.ids[1:first + 1])
            d = self._run("draft_prefill", S, aux=out["aux"], next_tokens=nxt, slot=slot, last=last)
            seq.take_draft(d, 0)
            seq.gap = list(zip(rest, seq.ids[first + 1:n + 1]))

    def _continue_prompt(self, seq: Sequence, bsz: int, shape: SpecShape, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt positions q.. (up to the shape's node count) through its verify graph as a chain -> the logits of
        the last of them and their aux states. The other rows put their pending token at its own position (what
        a row past the speculation cutoff does in a round: it writes only slots rewritten before they are read)."""
        N = shape.num_nodes
        r = min(N, seq.n_prompt - q)
        tokens = torch.zeros(bsz, N, dtype=torch.int64)
        start = torch.zeros(bsz, dtype=torch.int64)
        for s in self.active:
            if s is not seq:
                tokens[s.row, 0], start[s.row] = s.ids[-1], s.pos
        tokens[seq.row, :r], start[seq.row] = torch.tensor(seq.ids[q:q + r]), q
        v = self._run("target_verify", bsz, shape, kv_len_=int(start.max()) + N, tokens=tokens,
                      positions=start[:, None] + torch.arange(N), start=start,
                      tree_mask=torch.ones(N, N, dtype=torch.bool).tril().expand(bsz, N, N).contiguous())
        self.target_passes += 1
        return v["logits"][seq.row, r - 1], v["aux"][seq.row, :r]

    def _prefill_plan(self, n: int, bsz: int, drafts: bool) -> tuple[int, SpecShape | None]:
        """The prefill bucket of a prompt's first chunk and, where the prompt is longer, the shape whose verify graph
        continues it: of padding the prompt to a bucket that holds it and continuing from a smaller one, the plan the
        warm-up's graph times expect to take least time (draft included: its prefill, and the catch-up calls of the
        positions it did not prefill); without them, the smallest bucket that holds it. Beyond the largest bucket the prompt is always
        continued."""
        m, costs = self.bundle.manifest, self.bundle.seconds
        chunk = self.chunk_shapes.get(bsz)
        fits = [S for S in self.prefill_buckets if S >= n]

        def cost(S: int) -> float:
            roles = ("target_prefill", "draft_prefill") if drafts else ("target_prefill",)
            total = sum(costs[m.graph(r, S).name] for r in roles)
            if S < n:
                verify = m.graph("target_verify", bsz, chunk, n + chunk.num_nodes)  # (the context bucket it runs)
                total += -(-(n - S) // chunk.num_nodes) * costs[verify.name]
                if drafts:
                    total += -(-(n - S) // self.catchup_len[bsz]) * costs[m.graph("draft_catchup", bsz).name]
            return total

        options = fits + ([S for S in self.prefill_buckets if S < n] if chunk is not None else [])
        try:
            S = min(options, key=cost)
        except KeyError:  # (no warm-up ran: nothing timed)
            S = fits[0] if fits else self.prefill_buckets[-1]
        return S, (chunk if S < n else None)

    def _run(self, role: str, bucket: int, shape_: SpecShape | None = None, kv_len_: int | None = None,
             **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Call one compiled graph (of speculation shape `shape_`, None: the bucket's own; of the smallest
        context bucket holding KV slots 0..kv_len_-1 where the role has them) with its inputs by name
        (graph_contract.ROLES) -> its outputs by name, timed into the metrics (eagle3_graph_latency_seconds; a menu
        shape's graph under role:tag)."""
        context = pick_context(self.context_buckets, kv_len_) if kv_len_ is not None else None
        key = (role, bucket, id(shape_), context)  # (the shapes are the manifest's: one id each for the engine's life)
        if key not in self._graphs:
            graph = self.bundle.graph(role, bucket, shape_, kv_len_)
            self._graphs[key] = graph, role if graph.entry.shape is None else f"{role}:{graph.entry.shape.tag}"
        graph, label = self._graphs[key]
        t0 = time.perf_counter()
        out = call_by_name(graph, inputs)
        self.metrics.record_graph(label, bucket, time.perf_counter() - t0)
        return out

    def _speculates(self, seq: Sequence) -> bool:
        return self.speculative and seq.req.speculative

    # ------------------------------------------------------------------ decode

    def _decode_step(self) -> str:
        n = len(self.active)
        bsz = pick_bucket(self.batch_buckets, n)
        chooser = self.choosers.get(bsz)
        if chooser is None:
            shape = self.shapes[bsz]
        else:  # (costs are compared within the context bucket the rows are in: a longer one costs more)
            context = pick_context(self.context_buckets, max(s.pos for s in self.active) + 1) or 0
            shape = self.menus[bsz].get(chooser.next_shape(context), NO_SPECULATION)
        spec = [shape.speculates and s.draft_top is not None and can_speculate(s.pos, shape.depth, self.max_len)
                for s in self.active]
        if any(ok and s.gap for s, ok in zip(self.active, spec)):
            self._catch_up_gaps(bsz)
        t0 = time.perf_counter()  # (a step's cost, for the chooser: without catching up on plain steps before it)
        if any(spec):
            self._spec_round(bsz, shape, spec)
            kind, name = "speculative", shape.describe()
        else:
            self._plain_round(bsz)
            kind, name = "decode", NONE
        if chooser is not None:
            before = chooser.current
            chooser.observe_time(name, time.perf_counter() - t0)
            self._chose(bsz, chooser, before)
            if self.target_passes % 64 == 0:  # (the expected rates follow live times between switches too)
                self.metrics.record_choice(bsz, chooser)
        return kind

    def _chose(self, bsz: int, chooser: Chooser, before: str) -> None:
        """Log and count a chooser's switch, if its last observation made one."""
        if chooser.current != before:
            log.info("speculation at batch %d: %s", bsz, chooser.reason())
            self.metrics.speculation_switches.labels(str(bsz)).inc()
            self.metrics.record_choice(bsz, chooser)

    def _plain_round(self, bsz: int) -> None:
        tokens = torch.zeros(bsz, dtype=torch.int64)
        pos = torch.zeros(bsz, dtype=torch.int64)
        for s in self.active:
            tokens[s.row], pos[s.row] = s.ids[-1], s.pos
        out = self._run("target_decode", bsz, kv_len_=int(pos.max()) + 1, tokens=tokens, pos=pos)
        self.target_passes += 1
        for s in self.active:
            tok = next_token(out["logits"][s.row], s.req.sampling, s.u())
            if s.draft_top is not None and can_speculate(s.pos + 1, 1, self.max_len):  # it may speculate again
                s.gap.append((out["aux"][s.row], tok))
            self._emit(s, [tok])

    def _catch_up_gaps(self, bsz: int) -> None:
        """Rows that decoded without speculation (a bucket without it) feed the draft the positions it
        missed, T at a time through draft_catchup, before they draft again. Other rows write only past
        their pending position (the draft's uncommitted slots)."""
        T = self.catchup_len[bsz]
        while any(s.gap for s in self.active):
            aux = torch.zeros(bsz, T, self.aux_width, dtype=self.hidden_dtype)
            nxt = torch.zeros(bsz, T, dtype=torch.int64)
            start = torch.zeros(bsz, dtype=torch.int64)
            last = torch.zeros(bsz, dtype=torch.int64)
            chunks = {}
            for s in self.active:
                chunk, s.gap = s.gap[:T], s.gap[T:]
                start[s.row] = s.pos - len(s.gap) - len(chunk) if chunk else s.pos
                for i, (a, t) in enumerate(chunk):
                    aux[s.row, i], nxt[s.row, i] = a, t
                last[s.row] = max(len(chunk) - 1, 0)
                chunks[s.row] = bool(chunk)
            d = self._run("draft_catchup", bsz, aux=aux, next_tokens=nxt, start=start, last=last)
            for s in self.active:
                if chunks[s.row]:
                    s.take_draft(d, s.row)

    def _draft_tree(self, bsz: int, shape: SpecShape, start: torch.Tensor,
                    drafting: dict[int, Drafting]) -> None:
        """The depth - 1 draft steps: each expands every row's frontier by its top-k children (a chain of an
        unrolled bundle: all in one draft_chain call)."""
        if draft_unrolled(shape, self.unroll_draft):
            hidden = torch.zeros(bsz, self.hidden, dtype=self.hidden_dtype)
            token = torch.zeros(bsz, dtype=torch.int64)
            for s in self.active:
                dr = drafting.get(s.row)
                if dr is not None:
                    hidden[s.row], token[s.row] = s.draft_hidden, dr.tokens[1]
            chains = self._run("draft_chain", bsz, shape, hidden=hidden, token=token, start=start)["tokens"].tolist()
            for row, dr in drafting.items():
                dr.extend_chain(chains[row])
            return
        W, M = shape.width, shape.dims()["M"]
        prev = None  # the previous step's hidden states [bsz, W, Hd]
        for step in range(1, shape.depth):
            hidden = torch.zeros(bsz, W, self.hidden, dtype=self.hidden_dtype)
            tokens = torch.zeros(bsz, W, dtype=torch.int64)
            offsets = (step - 1) * W + torch.arange(W)
            mask = torch.zeros(bsz, W, M, dtype=torch.bool)
            mask[:, torch.arange(W), offsets] = True
            for s in self.active:
                dr = drafting.get(s.row)
                if dr is None:
                    continue
                toks, parent_slot, _, mask[s.row] = dr.step_inputs(step)
                tokens[s.row] = torch.tensor(toks)
                for w, ps in enumerate(parent_slot):
                    hidden[s.row, w] = s.draft_hidden if ps < 0 else prev[s.row, ps]
            positions = (start + step - 1)[:, None].expand(bsz, W).contiguous()
            d = self._run("draft_step", bsz, shape, hidden=hidden, tokens=tokens, positions=positions,
                          slots=start[:, None] + offsets, start=start, tree_mask=mask)
            prev = d["hidden"]
            for row, dr in drafting.items():
                dr.expand(d["token"][row], d["logprob"][row])

    def _spec_round(self, bsz: int, shape: SpecShape, spec: list[bool]) -> None:
        rows, N, T = self.active, shape.num_nodes, self.catchup_len[bsz]  # (T >= shape.depth + 1)
        start = torch.zeros(bsz, dtype=torch.int64)
        for s in rows:
            start[s.row] = s.pos
        # 1. draft a tree per row (rows that cannot speculate get their pending token alone)
        drafting = {s.row: Drafting(shape, s.ids[-1], *s.draft_top) for s, ok in zip(rows, spec) if ok}
        self._draft_tree(bsz, shape, start, drafting)
        trees: dict[int, Tree] = {}
        tokens = torch.zeros(bsz, N, dtype=torch.int64)
        positions = torch.zeros(bsz, N, dtype=torch.int64)
        mask = torch.eye(N, dtype=torch.bool).repeat(bsz, 1, 1)
        for s in rows:
            t = trees[s.row] = drafting[s.row].tree() if s.row in drafting else dummy_tree(shape, s.ids[-1])
            tokens[s.row], positions[s.row], mask[s.row] = torch.tensor(t.tokens), s.pos + torch.tensor(t.depths), t.mask()
        # 2. verify every node in one target pass
        v = self._run("target_verify", bsz, shape, kv_len_=int(start.max()) + N, tokens=tokens, positions=positions,
                      start=start, tree_mask=mask)
        logits = v["logits"]
        self.target_passes += 1
        if self.accept_in_graph:  # (one host copy each for the whole batch)
            g_accepted, g_path, g_next = v["accepted"].tolist(), v["path"].tolist(), v["next_tokens"].tolist()
        # 3. accept per row; the accepted nodes' KV moves to slots p..p+a
        paths = torch.zeros(bsz, T, dtype=torch.int64)
        nxt = torch.zeros(bsz, T, dtype=torch.int64)
        last = torch.zeros(bsz, dtype=torch.int64)
        name = shape.describe()
        for s, ok in zip(rows, spec):
            if ok:
                t, p = trees[s.row], s.pos
                if s.req.sampling.greedy and self.accept_in_graph:
                    a = g_accepted[s.row]
                    path, new = g_path[s.row][:a + 1], g_next[s.row][:a + 1]
                elif s.req.sampling.greedy:
                    g = logits[s.row].argmax(-1).tolist()
                    path = accept_greedy(t, g)
                    new = [t.tokens[i] for i in path[1:]] + [g[path[-1]]]
                else:
                    path, new = verify_tree_sampled(logits[s.row], t, s.req.sampling, s.u())
                a = len(path) - 1
                s.stats.record(a, N - 1, name)
                chooser = self.choosers.get(bsz)
                if chooser is not None:
                    before = chooser.current
                    chooser.observe(name, a)
                    self._chose(bsz, chooser, before)
                self.metrics.record_draft(a, N - 1, name)
                paths[s.row, :a + 1], nxt[s.row, :a + 1], last[s.row] = torch.tensor(path), torch.tensor(new), a
                self._emit(s, new)
                moved = [(p + j, p + m) for m, j in enumerate(path) if j != m]  # (none for a chain)
                if moved and s.finish_reason is None:
                    self.bundle.compact_kv(s.row, [x for x, _ in moved], [y for _, y in moved])
            else:  # past the speculation cutoff: one token from the verify's first node
                self._emit(s, [next_token(logits[s.row, 0], s.req.sampling, s.u())])
        # 4. catch the draft up on the accepted positions (rows that finished or cannot speculate
        #    write only into their own, soon irrelevant, draft cache entries)
        if any(ok and s.finish_reason is None for s, ok in zip(rows, spec)):
            aux = v["aux"].gather(1, paths[:, :, None].expand(bsz, T, v["aux"].shape[-1]))
            d = self._run("draft_catchup", bsz, aux=aux, next_tokens=nxt, start=start, last=last)
            for s, ok in zip(rows, spec):
                if ok:
                    s.take_draft(d, s.row)

    # ------------------------------------------------------------------ output

    def _emit(self, seq: Sequence, tokens: list[int]) -> None:
        """Append tokens one at a time until EOS / max_tokens / max_model_len / a stop string, then notify the
        listener. The token that ends the request is the last one kept, as in plain decoding: a round's
        tokens after it are dropped, never counted or sent."""
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
            self.metrics.ttft.observe(seq.first_token_time - seq.req.arrival)
        if self.tokenizer is not None and seq.text_stream is None:
            seq.text_stream = self.tokenizer.stream(seq.req.stop)
        added, delta = [], ""
        for tok in tokens:
            seq.ids.append(tok)
            added.append(tok)
            if tok in self.eos:
                seq.finish_reason = "stop"
            elif len(seq.ids) - seq.n_prompt >= seq.req.max_tokens or len(seq.ids) >= self.max_len:
                seq.finish_reason = "length"
            if seq.text_stream is not None:  # incremental: O(1) amortised per token (tokenizer.TextStream)
                text, stopped = seq.text_stream.add([tok], seq.generated if seq.finish_reason else None)
                delta += text
                if stopped:
                    seq.finish_reason = "stop"
            if seq.finish_reason:
                break
        self.metrics.generation_tokens.inc(len(added))
        if seq.req.on_event and (added or seq.finish_reason):
            seq.req.on_event(Event(added, delta, seq.finish_reason))

    def _drop_cancelled(self) -> None:
        for s in self.active:
            if s.req.cancelled and s.finish_reason is None:
                s.finish_reason = "abort"
                if s.req.on_event:
                    s.req.on_event(Event([], "", "abort"))
        with self._cv:
            kept = collections.deque(r for r in self.waiting if not r.cancelled)
            if len(kept) != len(self.waiting):
                self.waiting = kept
                self.metrics.queue_depth.set(len(kept))
        self._free_finished()

    def _free_finished(self) -> None:
        """Free finished rows at once; keep active rows contiguous by moving the last row down."""
        i = 0
        while i < len(self.active):
            s = self.active[i]
            if s.finish_reason is None:
                i += 1
                continue
            self.metrics.finished(s.finish_reason)
            if self._on_finish:
                self._on_finish(s)
            last = self.active.pop()
            if last is not s:
                self.bundle.copy_kv_row(last.row, s.row)
                last.row = s.row
                self.active[i] = last
