"""Build progress where nobody watches a terminal: a piped compile (`make demo | tee`, a CI log) gets a plain
line per stage and per graph done; a terminal gets the live view; --json gets JSON lines."""
from io import StringIO

from rich.console import Console

from eagle3_build.progress import JsonReporter, LineReporter, RichReporter, progress_reporter


def test_a_log_gets_a_line_per_stage_and_per_graph_done():
    out = StringIO()
    r = progress_reporter("p", Console(file=out, force_terminal=False, width=200), as_json=False)
    assert isinstance(r, LineReporter)
    with r:
        r({"event": "stage", "stage": "load"})
        r({"event": "stage", "stage": "graphs", "total": 3, "jobs": 2})
        for g in ("a", "b", "c"):
            r({"event": "graph", "graph": g, "status": "queued", "estimate": 10.0})
        r({"event": "graph", "graph": "a", "status": "compiling", "estimate": 10.0})
        r({"event": "graph", "graph": "a", "status": "compiled"})
        r({"event": "graph", "graph": "b", "status": "cached"})
        r({"event": "graph", "graph": "c", "status": "failed", "error": "RuntimeError: boom"})
    lines = out.getvalue().splitlines()
    assert lines[0] == "p: load done in 0s" and lines[1] == "p: graphs (3 graphs, 2 jobs)"
    assert lines[2].startswith("p: a compiled in 0s (1/3 done, elapsed") and "ETA" in lines[2]
    assert lines[3].startswith("p: b cached (2/3 done") and lines[4].startswith("p: c failed: RuntimeError: boom")
    assert lines[5] == "p: graphs done in 0s" and len(lines) == 6  # (queued and compiling are not lines)


def test_a_build_refused_while_loading_prints_no_progress_line():
    out = StringIO()
    r = progress_reporter("p", Console(file=out, force_terminal=False), as_json=False)
    try:
        with r:
            r({"event": "stage", "stage": "load"})
            raise ValueError("bad checkpoint")
    except ValueError:
        pass
    assert out.getvalue() == ""


def test_a_terminal_gets_the_live_view_and_json_gets_json():
    assert isinstance(progress_reporter("p", Console(file=StringIO(), force_terminal=True), False), RichReporter)
    assert isinstance(progress_reporter("p", Console(file=StringIO(), force_terminal=False), True), JsonReporter)


def test_a_toolchain_warning_is_a_line_in_a_log_and_on_a_terminal():
    for terminal in (False, True):
        out = StringIO()
        r = progress_reporter("p", Console(file=out, force_terminal=terminal, width=200), as_json=False)
        with r:
            r({"event": "warning", "message": "the installed Neuron SDK is not a release this eagle3-build knows"})
            r({"event": "stage", "stage": "load"})
        assert "warning: the installed Neuron SDK is not a release this eagle3-build knows" in out.getvalue()


def test_a_log_is_never_silent_for_long(monkeypatch):
    """After HEARTBEAT_S without a line, a line says what the stage is doing: its latest progress (the GEMM
    measurement names the format and row count) or the graphs compiling, with their time so far."""
    import time

    monkeypatch.setattr(LineReporter, "HEARTBEAT_S", 0.3)
    out = StringIO()
    r = progress_reporter("p", Console(file=out, force_terminal=False, width=200), as_json=False)
    with r:
        r({"event": "stage", "stage": "load"})
        r({"event": "progress", "message": "target: GEMM formats at 4 row(s): preparing blocked (2/5)"})
        time.sleep(1.5)
        r({"event": "stage", "stage": "graphs", "total": 1, "jobs": 1})
        r({"event": "graph", "graph": "a", "status": "compiling", "estimate": 10.0})
        time.sleep(1.5)
        r({"event": "graph", "graph": "a", "status": "compiled"})
    lines = out.getvalue().splitlines()
    beats = [x for x in lines if "elapsed" in x and " compiled " not in x]
    assert any(x.startswith("p: load: target: GEMM formats at 4 row(s): preparing blocked (2/5)") for x in beats)
    assert any(x.startswith("p: graphs: compiling a (") for x in beats)
    gaps = [b for b in beats if b.startswith("p: load:")]
    assert 1 <= len(gaps) <= 5  # (one every 0.3 s of silence, not one per second polled)


def test_the_cli_filters_torchs_known_deprecation_warning():
    """torch 2.13 warns when it copies an exported program's treespecs (a LeafSpec): the build's entry points
    filter that one warning, nothing else."""
    import subprocess
    import sys

    code = ("import copy, warnings\nfrom eagle3_build.progress import quiet_known_warnings\nquiet_known_warnings()\n"
            "from torch.utils._pytree import tree_flatten\ncopy.deepcopy(tree_flatten([1, 2])[1])\n"
            "warnings.warn('other', FutureWarning)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "LeafSpec" not in r.stderr and "other" in r.stderr, r.stderr
    bare = subprocess.run([sys.executable, "-c", code.replace("quiet_known_warnings()\n", "")], capture_output=True,
                          text=True, timeout=120)
    assert "LeafSpec" in bare.stderr  # (the control: torch does warn)
