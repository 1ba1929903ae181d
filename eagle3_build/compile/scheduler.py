"""Compile graphs through the cache, in parallel worker processes.

    trace (main process, torch.export) -> key -> cache hit?  -> done
                                                 miss       -> compile job -> cache entry

With `jobs == 1` a miss compiles in this process. With `jobs > 1` misses go to at most `jobs`
long-lived worker processes (`python -m eagle3_build.backends.worker --serve`, one graph at a time each, its
log captured next to it), so torch/Inductor start-up is paid once per worker while one graph's crash
(segfault, OOM kill) still takes down only that graph. A graph whose worker dies is retried once on a
fresh worker; a compile error is not (it would fail the same way). Failures are recorded in the cache
with their log but never skip a later compile. Ctrl-C (and SIGTERM, see cli.py) kills the workers and
removes their staging directories; a build killed outright takes its workers with it (Linux), and the
next build removes its staging directories (CompileCache.clean_tmp).

Fault injection (tests, CI drills): `EAGLE3_BUILD_INJECT_FAILURE=graph_name[:crash][,...]` makes
that graph's compile raise (or, with `:crash`, its worker process die once, which the retry absorbs;
in-process compiles, `--jobs 1`, ignore `:crash`).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..files import save_through_python
from ..host import available_memory_gb, host_cores
from .cache import CompileCache, Entry

INJECT_ENV = "EAGLE3_BUILD_INJECT_FAILURE"
COMPILE_ERROR_EXIT = 3  # the worker's "compile raised" exit code (not retried)


def static_estimate(backend, role: str, tokens: int) -> float:
    """Machine-independent compile-time model (seconds) from the backend (class)'s ESTIMATE_S, a
    decode-sized graph: the same on every builder, so that `--shard I/N` splits identically everywhere;
    learned cache timings refine it for the ETA/plan."""
    per_model = 1.0 if role.startswith("target") else 0.4
    return backend.ESTIMATE_S * per_model * max(1, tokens) ** 0.25


def split_shard(jobs: list[tuple[str, float]], index: int, count: int) -> set[str]:
    """Names of shard `index` (1-based) of `count`: longest-processing-time-first onto the least
    loaded shard, ties broken by name — deterministic and balanced."""
    loads = [0.0] * count
    owner: dict[str, int] = {}
    for name, cost in sorted(jobs, key=lambda j: (-j[1], j[0])):
        k = min(range(count), key=lambda i: (loads[i], i))
        loads[k] += cost
        owner[name] = k + 1
    return {n for n, k in owner.items() if k == index}

Report = Callable[[dict], None]


@dataclass
class GraphJob:
    name: str
    role: str
    bucket: int
    tokens: int  # tokens per call (for compile-time estimates)
    key: str
    ep: object  # torch.export.ExportedProgram (None when `hit` was found through the trace memo)
    estimate: float = 0.0
    hit: Entry | None = None


@dataclass
class GraphResult:
    job: GraphJob
    status: str  # cached | compiled | failed
    entry: Entry | None = None
    seconds: float = 0.0
    attempts: int = 0
    error: str | None = None
    log: Path | None = None


class CompileFailed(Exception):
    """One or more graphs failed to compile (the others were still compiled and cached)."""

    def __init__(self, failures: list[GraphResult]):
        self.failures = failures
        names = ", ".join(f.job.name for f in failures)
        super().__init__(f"{len(failures)} graph(s) failed to compile: {names}")


def default_jobs(backend, tasks: int | None = None) -> int:
    """Parallel compile jobs from the cores and the memory available, with the backend's per-job
    memory estimate, at most its MAX_JOBS."""
    cores = host_cores()
    by_memory = int(available_memory_gb() // backend.JOB_MEMORY_GB)
    n = max(1, min(cores, by_memory, backend.MAX_JOBS or cores))
    return min(n, tasks) if tasks else n


def injected(name: str) -> str | None:
    """'fail' / 'crash' when EAGLE3_BUILD_INJECT_FAILURE names this graph."""
    for item in os.environ.get(INJECT_ENV, "").split(","):
        graph, _, mode = item.strip().partition(":")
        if graph == name:
            return mode or "fail"
    return None


class Scheduler:
    """Runs compile jobs for one build: cache lookups, a bounded pool of workers, retries."""

    def __init__(self, backend, backend_options: dict, cache: CompileCache, jobs: int, report: Report,
                 tp: int = 1, retries: int = 1, require_cached: bool = False):
        self.backend, self.options, self.cache = backend, backend_options, cache
        self.require_cached = require_cached
        self.jobs, self.report, self.tp, self.retries = max(1, jobs), report, tp, retries
        self.queue: list[GraphJob] = []
        self.lanes: list[_Lane] = []  # worker processes (jobs > 1), each compiling one graph at a time
        self.results: dict[str, GraphResult] = {}
        self.attempts: dict[str, int] = {}
        self.staged: list[Path] = []  # every staging dir this build made (removed on abort)
        self._prep: threading.Thread | None = None

    def start_prepare(self) -> None:
        """Backend set-up shared by every compile of this build (aoti: the host's CPU ISA probe, up to
        ~20 s of g++ runs the first time), in a thread so that it overlaps the tracing of the graphs."""
        if self._prep is None and not self.require_cached:
            self._prep = threading.Thread(target=self.backend.prepare, args=(self.cache.root,), daemon=True)
            self._prep.start()

    def prepared(self, wait: bool) -> bool:
        self.start_prepare()
        if self._prep is not None and wait:
            self._prep.join()
        return self._prep is None or not self._prep.is_alive()

    def new_staging(self) -> Path:
        d = self.cache.staging_dir()
        self.staged.append(d)
        return d

    def _event(self, job: GraphJob, status: str, **kw) -> None:
        self.report({"event": "graph", "graph": job.name, "role": job.role, "bucket": job.bucket,
                     "key": job.key, "status": status, "estimate": round(job.estimate, 2), **kw})

    def submit(self, job: GraphJob) -> None:
        learned = self.cache.estimate(self.backend.NAME, job.role, job.tokens)
        job.estimate = learned if learned is not None else static_estimate(self.backend, job.role, job.tokens)
        entry = job.hit or self.cache.get(job.key)
        if entry is not None:
            self.cache.touch(entry)
            self.results[job.name] = GraphResult(job, "cached", entry)
            self._event(job, "cached")
            return
        if self.require_cached:
            error = "not in the compile cache (--require-cached); compile it first (compile --shard I/N)"
            self.results[job.name] = GraphResult(job, "failed", error=error)
            self._event(job, "failed", error=error)
            return
        self.queue.append(job)
        self.start_prepare()
        self._event(job, "queued")
        if self.jobs > 1:
            self.pump()

    # ---------------------------------------------------------------- in-process (jobs == 1)
    def _compile_here(self, job: GraphJob) -> None:
        self.prepared(wait=True)
        self.attempts[job.name] = 1
        staged = self.new_staging()
        out = staged / f"graph{self.backend.SUFFIX}"
        self._event(job, "compiling")
        t0 = time.perf_counter()
        try:
            if injected(job.name) == "fail":  # (":crash" only applies to worker processes)
                raise RuntimeError(f"injected failure ({INJECT_ENV})")
            info = self.backend.compile_exported(job.ep, out, job.key, job.role)
        except Exception as e:
            shutil.rmtree(staged, ignore_errors=True)
            self._failed(job, f"{type(e).__name__}: {e}", traceback.format_exc(), time.perf_counter() - t0)
            return
        except BaseException:  # Ctrl-C: leave nothing behind
            shutil.rmtree(staged, ignore_errors=True)
            raise
        self._store(job, staged, info, time.perf_counter() - t0)

    def _store(self, job: GraphJob, staged: Path, info: dict, seconds: float) -> None:
        entry = self.cache.put(job.key, staged, {"backend": self.backend.NAME, "graph": job.name, "role": job.role,
                                                 "bucket": job.bucket, "tokens": job.tokens,
                                                 "compile_seconds": round(seconds, 3), "info": info})
        self.results[job.name] = GraphResult(job, "compiled", entry, seconds, self.attempts.get(job.name, 1))
        self._event(job, "compiled", seconds=round(seconds, 2))

    def _failed(self, job: GraphJob, error: str, log: str, seconds: float) -> None:
        log_path = self.cache.record_failure(job.key, {"graph": job.name, "backend": self.backend.NAME,
                                                       "error": error}, log)
        self.results[job.name] = GraphResult(job, "failed", None, seconds, self.attempts.get(job.name, 1),
                                             error, log_path)
        self._event(job, "failed", error=error, log=str(log_path), seconds=round(seconds, 2))

    # ---------------------------------------------------------------- worker processes (jobs > 1)
    def pump(self) -> None:
        for lane in list(self.lanes):
            if lane.task is None:
                continue
            rc = lane.poll()
            if rc is None:
                continue
            task = lane.task
            lane.task = None
            if lane.dead:
                self.lanes.remove(lane)
            self._reap(task, rc)
        busy = sum(ln.task is not None for ln in self.lanes)
        while len(self.lanes) < min(self.jobs, busy + len(self.queue)):  # start-up overlaps tracing/prepare
            self.lanes.append(_Lane.start(self.backend.NAME))
        while self.queue and self.prepared(wait=False):
            lane = next((ln for ln in self.lanes if ln.task is None), None)
            if lane is None:
                break
            job = max(self.queue, key=lambda j: j.estimate)  # longest first: the lanes finish together
            self.queue.remove(job)
            self.attempts[job.name] = self.attempts.get(job.name, 0) + 1
            lane.assign(_Task.stage(job, self, self.attempts[job.name]))
            self._event(job, "compiling", attempt=self.attempts[job.name])

    def _reap(self, task: _Task, rc: int) -> None:
        job, seconds = task.job, time.perf_counter() - task.t0
        log = task.log.read_text(errors="replace") if task.log.exists() else ""
        result = task.dir / "result.json"
        if rc == 0 and result.exists():
            info = json.loads(result.read_text())["info"]
            self._store(job, task.out, info, seconds)
            shutil.rmtree(task.dir, ignore_errors=True)
            return
        if rc != COMPILE_ERROR_EXIT and self.attempts[job.name] <= self.retries:
            reason = f"worker exited with {_describe_rc(rc)}"
            self._event(job, "retrying", error=reason)
            self.queue.insert(0, job)
            shutil.rmtree(task.dir, ignore_errors=True)
            return
        err_file = task.dir / "error.json"
        error = json.loads(err_file.read_text())["error"] if err_file.exists() else f"worker exited with {_describe_rc(rc)}"
        self._failed(job, error, log, seconds)
        shutil.rmtree(task.dir, ignore_errors=True)

    def finish(self) -> list[GraphResult]:
        try:
            if self.jobs == 1:
                while self.queue:
                    self._compile_here(self.queue.pop(0))
            else:
                while self.queue or any(ln.task for ln in self.lanes):
                    self.pump()
                    time.sleep(0.1)
        except BaseException:
            self.abort()
            raise
        for lane in self.lanes:
            lane.close()
        self.lanes.clear()
        return list(self.results.values())

    def abort(self) -> None:
        for lane in self.lanes:
            lane.proc.terminate()
        deadline = time.time() + 5
        for lane in self.lanes:
            try:
                lane.proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                lane.proc.kill()
                lane.proc.wait()
            if lane.task is not None:
                shutil.rmtree(lane.task.dir, ignore_errors=True)
        for d in self.staged:  # (entries already moved into the cache are gone from here)
            shutil.rmtree(d, ignore_errors=True)
        self.lanes.clear()
        self.queue.clear()


def _describe_rc(rc: int) -> str:
    if rc < 0:
        import signal

        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"code {rc}"


@dataclass
class _Task:
    """One graph's compile in a worker: its staging dir holds task.json + input.pt2 in, and
    out/ + result.json (or error.json) + compile.log back."""

    job: GraphJob
    dir: Path
    out: Path
    log: Path
    t0: float = field(default_factory=time.perf_counter)

    @classmethod
    def stage(cls, job: GraphJob, s: Scheduler, attempt: int) -> _Task:
        import torch

        d = s.new_staging()
        try:
            out = d / "out"
            out.mkdir()
            ep = job.ep
            saved, ep.example_inputs = ep.example_inputs, None  # never serialise weight-sized examples
            try:
                save_through_python(lambda f: torch.export.save(ep, f), d / "input.pt2")
            finally:
                ep.example_inputs = saved
            inject = injected(job.name)
            if inject == "crash" and attempt > 1:
                inject = None  # a transient fault: the retry succeeds
            (d / "task.json").write_text(json.dumps({
                "graph": job.name, "role": job.role, "key": job.key, "backend": s.backend.NAME, "backend_options": s.options,
                "suffix": s.backend.SUFFIX, "tp": s.tp, "inject": inject, "cache_root": str(s.cache.root)}))
        except BaseException:  # (Ctrl-C while staging) leave no staging directory behind
            shutil.rmtree(d, ignore_errors=True)
            raise
        return cls(job, d, out, d / "compile.log")


class _Lane:
    """A long-lived worker process (`python -m eagle3_build.backends.worker --serve`) that compiles the
    graphs it is handed one at a time, so torch/Inductor start-up is paid once per lane, not once per
    graph. Protocol: the staging dir's path on its stdin; `done <rc>` on its stdout when that graph
    is finished (0 compiled, COMPILE_ERROR_EXIT compile raised). A lane whose process dies takes only
    its current graph down (retried on a fresh lane)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.task, self.dead = proc, None, False

    @classmethod
    def start(cls, backend: str) -> _Lane:
        cmd = [sys.executable, "-m", "eagle3_build.backends.worker", "--serve", backend, str(os.getpid())]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        return cls(proc)

    def assign(self, task: _Task) -> None:
        self.task = task
        try:
            self.proc.stdin.write(f"{task.dir}\n".encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):  # died between graphs: poll() reports it
            pass

    def poll(self) -> int | None:
        """The current graph's exit code once it is finished: the worker's `done <rc>`, or the
        process's own exit status when it died (negative: killed by that signal)."""
        import select

        if select.select([self.proc.stdout], [], [], 0)[0]:
            line = self.proc.stdout.readline()
            if line.startswith(b"done "):
                return int(line.split()[1])
            try:  # EOF: the process is gone
                rc = self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rc = self.proc.wait()
            self.dead = True
            return rc if rc != 0 else -1
        return None

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
