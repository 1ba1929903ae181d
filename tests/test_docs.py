"""The front door and the reference: README short, every link in README and docs resolves, results generated."""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest
from conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "training" / "README.md"]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but _ and - dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text))


def anchors(path: Path) -> set[str]:
    out, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*)", line)):
            out.add(slug(m.group(1)))
    return out


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # (code blocks are not links)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_slug_follows_github():
    assert slug("Speed per host kind") == "speed-per-host-kind"
    assert slug("The demo pair and `verify`") == "the-demo-pair-and-verify"
    assert slug("Tensor parallelism, and hidden padding!") == "tensor-parallelism-and-hidden-padding"
    assert slug("8. `weights_to_skip` (NxD)") == "8-weights_to_skip-nxd"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves(doc):
    bad = []
    for target in links(doc):
        if re.match(r"[a-z]+:", target):  # (http:, https:, mailto:)
            continue
        file, _, anchor = unquote(target).partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
        elif not dest.is_relative_to(REPO):
            bad.append(f"{target}: outside the repository")
    assert not bad, f"{doc.relative_to(REPO)}: " + "; ".join(bad)


def test_readme_is_a_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "dates belong in results, not the README"
    assert not re.search(r"\bissue \d+", text, re.I)
    assert "](docs/speed.png)" in text


def test_docs_are_reference_not_a_diary():
    for doc in DOCS[1:]:
        text = doc.read_text()
        assert not re.search(r"\bissue \d+|before this round", text, re.I), doc.name


def test_results_page_and_readme_table_are_generated_from_the_json():
    from benchmarks import results_page

    assert results_page.stale() == [], "run: python -m benchmarks results"
    assert results_page.CHART.exists()
    rows = results_page.speed_rows(results_page.load())
    assert rows and all(r["in_process"]["spec"] > 0 for r in rows)


def test_the_several_clients_table_takes_each_sides_best_server():
    """The served table of several clients at once: per client count the best eagle3 and the best vLLM server by
    total tok/s, their TPOT, the ratio; no table where no served result measured clients at once."""
    from benchmarks import results_page

    servers = {"eagle3 auto": {"tok_s_total": 250.0, "tpot_ms_median": 14.0},
               "eagle3 none": {"tok_s_total": 240.0, "tpot_ms_median": 15.0},
               "vllm none": {"tok_s_total": 100.0, "tpot_ms_median": 35.0}}
    row = {"kind": "k", "cpu": "CPU X", "threads": 2, "many_file": "r.json",
           "many": {"8": {"servers": servers, "eagle3_best": "eagle3 auto", "vllm_best": "vllm none",
                          "eagle3_best_vs_vllm_best": 2.5}}}
    table = results_page.at_once_table([row], "p/")
    assert "| CPU X (2) | 8 | **250.0** (eagle3 auto, 14.0 ms) | 100.0 (vllm none, 35.0 ms) | 2.50x ([json](p/r.json)) |" \
        in table
    assert results_page.at_once_table([{**row, "many": {}}], "p/") == ""
    # the serving recipe's record, where a host has one, gives the table; else the demo bundle's served record
    R, P = results_page.Result, Path("x.json")
    demo = {"runtime": {"spec": {"decode_tok_s": 2.0}, "plain": {"decode_tok_s": 1.0}}, "transformers_eager": {"decode_tok_s": 1.0}}
    rec = lambda level: {"contenders": {}, "at_once": {level: row["many"]["8"]}}  # noqa: E731
    both = [R(P, results_page.IN_PROCESS, "k", demo), R(Path("s.json"), results_page.SERVED, "k", rec("4")),
            R(Path("m.json"), results_page.SERVED_MANY, "k", rec("8"))]
    (r,) = results_page.speed_rows(both)
    assert (list(r["many"]), r["many_file"]) == (["8"], "m.json")
    (r,) = results_page.speed_rows(both[:2])
    assert (list(r["many"]), r["many_file"]) == (["4"], "s.json")
