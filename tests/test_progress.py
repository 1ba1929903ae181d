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
