"""Build progress for people (rich on a terminal: one row per graph, an ETA learned from the compile cache),
for logs (a plain line per stage and per graph done, when stderr is not a terminal: a piped `make demo` or a
CI log) and for machines (`--json`: one JSON object per line on stdout)."""
from __future__ import annotations

import json
import sys
import threading
import time

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

# Warnings third-party code prints during a build that say nothing to its user, with why each is harmless
KNOWN_WARNINGS = (
    # torch 2.13's own copy of an exported program's treespecs (torch.utils._pytree: LeafSpec is deprecated)
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
)


def quiet_known_warnings() -> None:
    """Filter KNOWN_WARNINGS in this process (the build's entry points: the CLI and its compile workers)."""
    import warnings

    for category, message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


STYLE = {"queued": "dim", "compiling": "yellow", "retrying": "magenta", "cached": "cyan", "compiled": "green",
         "failed": "bold red"}


def fmt_s(s: float) -> str:
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f}s"
    m, s = divmod(int(s), 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"


class BuildState:
    """What every reporter tracks: per-graph status, timings and the ETA."""

    def __init__(self, pair: str):
        self.pair, self.t0 = pair, time.perf_counter()
        self.stage = "load"
        self.jobs, self.total = 1, 0
        self.graphs: dict[str, dict] = {}
        self.activity: str | None = None  # what the stage is doing now (a "progress" event's message)

    def update(self, ev: dict) -> None:
        if ev["event"] == "progress":
            self.activity = ev["message"]
        elif ev["event"] == "stage":
            self.stage, self.activity = ev["stage"], None
            self.total = ev.get("total", self.total)
            self.jobs = ev.get("jobs", self.jobs)
        elif ev["event"] == "graph":
            g = self.graphs.setdefault(ev["graph"], {"estimate": ev.get("estimate", 0.0)})
            g.update({k: v for k, v in ev.items() if k not in ("event", "graph")})
            if ev["status"] == "compiling":
                g["started"] = time.perf_counter()

    def count(self, status: str) -> int:
        return sum(g["status"] == status for g in self.graphs.values())

    def eta(self) -> float | None:
        now, remaining = time.perf_counter(), 0.0
        pending = False
        for g in self.graphs.values():
            if g["status"] in ("queued", "retrying"):
                remaining += g["estimate"]
                pending = True
            elif g["status"] == "compiling":
                remaining += max(g["estimate"] * 0.1, g["estimate"] - (now - g.get("started", now)))
                pending = True
        return remaining / max(1, self.jobs) if pending else None


class RichReporter:
    def __init__(self, pair: str, console: Console):
        self.state = BuildState(pair)
        self.live = Live(self, console=console, refresh_per_second=4, transient=False)

    def __enter__(self):
        self.live.__enter__()
        return self

    def __exit__(self, *exc):
        failed = exc[0] is not None
        self.live.transient = failed  # a failed build ends on its one error line, not on a progress frame
        self.live.__exit__(*exc)
        if not failed and not self.live.console.is_terminal:  # Live leaves its last frame without a newline
            self.live.console.line()

    def __call__(self, ev: dict) -> None:
        if ev["event"] == "warning":
            self.live.console.print(f"warning: {ev['message']}", style="yellow", highlight=False, markup=False)
        self.state.update(ev)

    def __rich__(self):
        s = self.state
        done = s.count("cached") + s.count("compiled")
        eta = s.eta()
        head = Text.assemble((f"{s.pair}", "bold"), f": {s.stage}  ")
        if s.activity and not s.total:
            head.append(f"{s.activity}  ")
        if s.total:
            head.append(f"graphs {done}/{s.total} ({s.count('cached')} cached, {s.count('compiled')} compiled"
                        f"{', ' + str(s.count('failed')) + ' failed' if s.count('failed') else ''}), "
                        f"{s.jobs} job{'s' if s.jobs > 1 else ''}")
        head.append(f"  elapsed {fmt_s(time.perf_counter() - s.t0)}")
        if eta is not None:
            head.append(f"  ETA {fmt_s(eta)}", style="bold")
        active = [(n, g) for n, g in s.graphs.items() if g["status"] in ("compiling", "retrying", "failed")]
        if not active:
            return head
        t = Table(show_header=False, box=None, padding=(0, 1))
        for name, g in active:
            took = fmt_s(time.perf_counter() - g.get("started", time.perf_counter()))
            t.add_row(f"  {name}", Text(g["status"], style=STYLE.get(g["status"], "")),
                      f"{took} / ~{fmt_s(g['estimate'])}" if g["status"] == "compiling" else (g.get("error") or ""))
        return Group(head, t)


class LineReporter:
    """A plain line per stage finished and per graph done (compiled, cached, failed, retried), with the
    counts and the ETA: what a log needs, since a live view draws nothing there. A stage is reported when it
    ends, so a build refused while loading prints only its one error line; after HEARTBEAT_S without a line, a
    line says what is going on (the stage's latest progress, the graphs compiling)."""

    DONE = ("compiled", "cached", "failed", "retrying")
    HEARTBEAT_S = 30.0

    def __init__(self, pair: str, console: Console):
        self.state, self.console = BuildState(pair), console
        self.stage_t0: float | None = None
        self.last_line = time.perf_counter()
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.beat = threading.Thread(target=self._heartbeat, daemon=True)

    def __enter__(self):
        self.beat.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        if exc[0] is None:
            self._stage_done()

    def _print(self, line: str) -> None:
        with self.lock:
            self.console.print(line, highlight=False, markup=False, soft_wrap=True)
            self.last_line = time.perf_counter()

    def _heartbeat(self) -> None:
        while not self.done.wait(1.0):
            if time.perf_counter() - self.last_line >= self.HEARTBEAT_S:
                self._print(self.status())

    def status(self) -> str:
        s, now = self.state, time.perf_counter()
        busy = [f"{n} ({fmt_s(now - g['started'])})" for n, g in s.graphs.items()
                if g["status"] == "compiling" and "started" in g]
        doing = f"compiling {', '.join(busy)}" if busy else (s.activity or "working")
        return f"{s.pair}: {s.stage}: {doing} (elapsed {fmt_s(now - s.t0)})"

    def _stage_done(self) -> None:
        if self.stage_t0 is not None:
            self._print(f"{self.state.pair}: {self.state.stage} done in {fmt_s(time.perf_counter() - self.stage_t0)}")

    def __call__(self, ev: dict) -> None:
        s = self.state
        if ev["event"] == "warning":
            self._print(f"{s.pair}: warning: {ev['message']}")
            return
        if ev["event"] == "stage":
            self._stage_done()
            s.update(ev)
            self.stage_t0 = time.perf_counter()
            if ev.get("total"):
                self._print(f"{s.pair}: {s.stage} ({s.total} graphs, {s.jobs} job{'s' * (s.jobs > 1)})")
            return
        s.update(ev)
        if ev["event"] == "graph" and ev["status"] in self.DONE:
            g, done = s.graphs[ev["graph"]], s.count("cached") + s.count("compiled")
            took = f" in {fmt_s(time.perf_counter() - g['started'])}" if ev["status"] == "compiled" and "started" in g \
                else ""
            eta = s.eta()
            self._print(f"{s.pair}: {ev['graph']} {ev['status']}{took}{': ' + ev['error'] if ev.get('error') else ''} "
                        f"({done}/{s.total} done, elapsed {fmt_s(time.perf_counter() - s.t0)}"
                        f"{', ETA ' + fmt_s(eta) if eta is not None else ''})")


def progress_reporter(pair: str, console: Console, as_json: bool):
    """The reporter for this output: JSON lines, a live view on a terminal, plain lines otherwise."""
    if as_json:
        return JsonReporter(pair)
    return RichReporter(pair, console) if console.is_terminal else LineReporter(pair, console)


class JsonReporter:
    """JSON lines on stdout: {"event": ..., "pair": ..., "t": seconds since the start, ...}."""

    def __init__(self, pair: str):
        self.state = BuildState(pair)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def __call__(self, ev: dict) -> None:
        self.state.update(ev)
        emit({**ev, "pair": self.state.pair, "t": round(time.perf_counter() - self.state.t0, 3)})


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()
