"""plan and inspect."""
import json
from pathlib import Path

from conftest import cli_inproc, run_cli

REPO = Path(__file__).resolve().parents[1]


def test_plan_seed_llama():
    r = cli_inproc("eagle3-build", "plan", str(REPO / "recipes" / "llama31-8b-eagle3.yaml"), "--json")
    assert r.returncode == 0, r.stderr
    (plan,) = json.loads(r.stdout)
    assert plan["tp_degree"] == 8 and plan["num_speculative_tokens"] == 3
    names = [g["name"] for g in plan["graphs"]]
    # prefill 128..2048 for both models, batch buckets 1 and 2 for the four batch roles
    assert len(names) == 5 * 2 + 2 * 4
    verify = {g["name"]: g for g in plan["graphs"]}["target_verify_b2"]
    assert verify["tokens_per_call"] == 2 * 4


def test_plan_seed_gpt_oss_table():
    r = cli_inproc("eagle3-build", "plan", str(REPO / "recipes" / "gpt-oss-120b-eagle3.yaml"))
    assert r.returncode == 0, r.stderr
    assert "target_prefill_s512" in r.stdout and "target_verify_b1" in r.stdout and "5 graphs" in r.stdout


def test_inspect(tiny_bundles):
    _, bundle_dir = tiny_bundles.get("speculators", 3)
    r = cli_inproc("eagle3-build", "inspect", str(bundle_dir))
    assert r.returncode == 0, r.stderr
    assert "target_verify_b1" in r.stdout and "K 3" in r.stdout and "draft format speculators" in r.stdout
    r = cli_inproc("eagle3-build", "inspect", str(bundle_dir.parent / "nope"))
    assert r.returncode == 2 and "not a bundle" in " ".join(r.stderr.split())


def test_help_lists_every_command_in_one_line():
    """`eagle3-build --help` (and `cache --help`) name every command with a one-line summary, and the
    module docstring of eagle3_build/cli.py lists every command."""
    import typer

    import eagle3_build.cli as cli

    group = typer.main.get_command(cli.app)
    shown = cli_inproc("eagle3-build", "--help").stdout
    for name, cmd in group.commands.items():
        summary = cmd.help.split("\n\n")[0].strip()
        assert "\n" not in summary and len(summary) <= 110, (name, summary)
        assert name in cli.__doc__, name
        line = next((ln for ln in shown.splitlines() if ln.lstrip("│ ").startswith(f"{name} ")), "")
        assert summary in line, (name, line)
    cache = group.commands["cache"]
    shown = cli_inproc("eagle3-build", "cache", "--help").stdout
    for name, cmd in cache.commands.items():
        summary = cmd.help.split("\n\n")[0].strip()
        assert "\n" not in summary and summary in shown and name in cli.__doc__, name


def test_usage_errors_are_one_line():
    """A value of the wrong type, a missing argument, an unknown command or option: one line naming it and
    where the help is, exit 2 (not the boxed usage text)."""
    for args, needle in [(("cache", "prune", "--max-size", "10GB"), "Invalid value for '--max-size'"),
                         (("compile", "x.yaml", "--jobs", "abc"), "Invalid value for '--jobs'"),
                         (("compile",), "Missing argument 'recipe'"), (("nosuch",), "No such command 'nosuch'"),
                         (("plan", "x.yaml", "--bogus"), "No such option: --bogus")]:
        r = run_cli("eagle3-build", *args)  # (the console entry point: cli_inproc drives the typer app itself)
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0] and "--help)" in lines[0], (args, r.stderr)
