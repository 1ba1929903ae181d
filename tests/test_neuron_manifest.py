"""A neuron bundle whose manifest misstates a graph's NxD call fields (backend.format / key / bucket_index /
arity / n_out) is refused in one line naming the graph, the field and the fix, by the loader (eagle3-run)
and by `eagle3-build check` — never a KeyError / ValueError traceback. Built through the stand-in SDK."""
import json

import pytest
from neuron_standin import standin_sdk  # noqa: F401 (fixture)
from typer.testing import CliRunner


def set_field(field, value, graph=0):
    def edit(graphs):
        graphs[graph]["backend"][field] = value
    return edit


def drop_field(field):
    def edit(graphs):
        del graphs[0]["backend"][field]
    return edit


CASES = [  # (edit of the target model's graph entries, what the message must say; check `check` fails)
    (drop_field("arity"), "backend.arity is missing"),
    (set_field("arity", "4"), "backend.arity is '4', not an integer"),
    (set_field("arity", True), "backend.arity is True, not an integer"),
    (set_field("arity", 1), "backend.arity 1 is outside"),
    (set_field("arity", 5, graph=1), "differ from graph"),
    (drop_field("n_out"), "backend.n_out is missing"),
    (set_field("n_out", 0), "backend.n_out 0 is outside"),
    (set_field("format", "torchscript"), "its file is a 'torchscript' graph, a neuron bundle's graphs are 'nxd-model'"),
    (set_field("key", "draft_step"), "backend.key 'draft_step' is not the graph's key 'target_prefill'"),
    (set_field("bucket_index", -1), "backend.bucket_index -1 is outside"),
    (drop_field("bucket_index"), "backend.bucket_index is missing"),
]


def rewrite(bundle, edit) -> str:
    """Apply `edit` to the target's graph entries, re-sign the digest (so only the call fields are wrong);
    returns the first target graph's name."""
    from eagle3_runtime.manifest import digest_of

    path = bundle / "manifest.json"
    raw = json.loads(path.read_text())
    graphs = [g for g in raw["graphs"] if g["model"] == "target"]
    edit(graphs)
    raw["digest"] = digest_of(raw)
    path.write_text(json.dumps(raw))
    return graphs[0]["name"]


def test_bad_nxd_call_fields_are_one_clear_refusal(standin_sdk, tmp_path, capsys):
    from eagle3_build.build import build_bundle
    from eagle3_build.cli import app
    from eagle3_build.compile.cache import CompileCache
    from eagle3_runtime import cli as run_cli_main
    from eagle3_runtime.bundle import Bundle, BundleError
    from test_neuron_spmd import neuron_pair

    out = tmp_path / "bundle"
    build_bundle(neuron_pair(tmp_path, 1), out, cache=CompileCache(tmp_path / "cache"))
    good = (out / "manifest.json").read_text()
    runner = CliRunner()
    r = runner.invoke(app, ["check", str(out)])
    assert r.exit_code == 0 and "nxd calls" in r.output, r.output

    for edit, needle in CASES:
        (out / "manifest.json").write_text(good)
        graph = rewrite(out, edit)
        with pytest.raises(BundleError) as e:
            Bundle(out)
        msg = str(e.value)
        assert needle in msg and "graph target_" in msg and "rebuild the bundle" in msg, msg
        if needle != "differ from graph":
            assert f"graph {graph}:" in msg, msg

        capsys.readouterr()
        assert run_cli_main.main([str(out), "--prompt", "hi", "--max-tokens", "2"]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.count("error:") == 1 and needle in " ".join(err.split()), err

        r = runner.invoke(app, ["check", str(out)])
        flat = " ".join(r.output.split())
        failed = "manifest" if "its file is" in needle else "nxd calls"
        assert r.exit_code == 2 and f"FAIL {failed}" in flat and needle in flat, r.output
        assert "Traceback" not in r.output
