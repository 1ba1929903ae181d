"""A menu of speculation shapes per batch bucket (recipe `speculation.menu`, manifest `menu`): every shape's
graphs are built, each runs lossless on its own (`--speculation TAG`), the engine may switch shapes between
any two steps (chain <-> tree <-> plain) without changing a token, and `--speculation auto` picks among the
whole menu by the costs and acceptance it is given. The bundle also has context buckets (recipe
`buckets.context`): the decode loop's target graphs over the first 16 / 32 KV slots, called while every row
fits (the prompts here cross both into the whole-cache graphs)."""
import pytest

from eagle3_runtime.adaptive import NONE

# chain K 3 (the bucket's own), a chain of 1 (no draft step), a tree of depth 2 (topk 2: the catch-up and
# prefill graphs then propose 2 children for whichever shape drafts next)
MENU = {"speculation": {"num_speculative_tokens": 3, "menu": [
    {"num_speculative_tokens": 1}, {"num_speculative_tokens": 2, "tree": {"topk": 2, "num_draft_tokens": 4}}]},
    "buckets": {"context": [16, 32]}}
TAGS = ("chain3", "chain1", "tree2x2x4")
PROMPTS = [list(range(5, 21)), [7, 3, 9, 11, 2, 30, 31, 8], list(range(40, 52))]


@pytest.fixture(scope="module")
def menu_bundle(tiny):
    from eagle3_runtime.bundle import Bundle

    return Bundle(tiny.bundle(recipe=MENU).path)


def test_the_manifest_lists_every_shape_and_its_graphs(menu_bundle):
    m = menu_bundle.manifest
    assert [s.tag for s in m.shapes(1)] == list(TAGS) and m.num_speculative_tokens == 3
    names = {g.name for g in m.graphs}
    assert {"target_verify_b1", "target_verify_b1_chain1", "target_verify_b1_tree2x2x4", "draft_chain_b1",
            "draft_step_b1_tree2x2x4", "target_decode_b1", "draft_catchup_b1"} <= names
    assert not {"draft_step_b1_chain1", "draft_chain_b1_chain1", "draft_step_b1"} & names  # (a chain of 1 drafts
    # no step; chain K 3's steps are unrolled)
    catchup = m.graph("draft_catchup", 1)
    assert catchup.input("next_tokens").shape == [1, 4]  # the deepest path: chain K 3 + its bonus token
    assert [o.shape for o in catchup.outputs if o.name == "token"] == [[1, 2]]  # the largest topk
    tree = m.shapes(1)[2]
    assert m.graph("target_verify", 1, tree).input("tokens").shape == [1, 4]
    assert m.graph("target_verify", 1, m.speculation[1]).name == "target_verify_b1"
    assert m.context_buckets == [16, 32]
    assert m.graph("target_verify", 1, tree, 17).name == "target_verify_b1_tree2x2x4_c32"
    assert m.graph("target_decode", 1, None, 16).name == "target_decode_b1_c16"
    assert m.graph("target_decode", 1, None, 33).name == "target_decode_b1"  # past the largest: the whole cache
    assert m.graph("draft_step", 1, tree, 5).name == "draft_step_b1_tree2x2x4"  # (target roles only)


def test_a_context_bucket_graph_computes_what_the_whole_cache_graph_does(menu_bundle):
    import torch

    from eagle3_runtime.backends.base import call_by_name

    b = menu_bundle
    prompt = torch.tensor([list(range(5, 25)) + [0] * 44])
    out = call_by_name(b.graph("target_prefill", 64), {"tokens": prompt, "slot": torch.tensor([0]),
                                                       "last": torch.tensor([19])})
    tok = out["logits"].argmax(-1)
    inputs = {"tokens": tok[:, None].expand(1, 4).contiguous(),
              "positions": torch.arange(20, 24)[None], "start": torch.tensor([20]),
              "tree_mask": torch.tril(torch.ones(4, 4, dtype=torch.bool))[None]}
    whole = call_by_name(b.graph("target_verify", 1), inputs)
    ctx = call_by_name(b.graph("target_verify", 1, None, 24), inputs)
    assert b.graph("target_verify", 1, None, 24).entry.name == "target_verify_b1_c32"
    torch.testing.assert_close(ctx["logits"], whole["logits"], rtol=1e-4, atol=1e-4)
    decode = {"tokens": tok, "pos": torch.tensor([20])}
    torch.testing.assert_close(call_by_name(b.graph("target_decode", 1, None, 21), decode)["logits"],
                               call_by_name(b.graph("target_decode", 1), decode)["logits"], rtol=1e-4, atol=1e-4)


def test_every_shape_is_lossless_and_switching_between_steps_too(menu_bundle):
    from eagle3_runtime.engine import Engine

    e = Engine(menu_bundle, speculation="none")
    plain = e.generate_many(PROMPTS, 24)
    assert {k[3] for k in e._graphs if k[0] == "target_decode"} == {16, 32, None}  # every context bucket ran
    for tag in TAGS:
        e = Engine(menu_bundle, speculation=tag)
        gens = e.generate_many(PROMPTS, 24)
        assert [g.token_ids for g in gens] == [p.token_ids for p in plain], tag
        assert sum(g.stats.num_drafts for g in gens) > 0
        assert {k[3] for k in e._graphs if k[0] == "target_verify"} == {16, 32, None}, tag
    # --speculation auto with a chooser that serves another shape every step: chain 1 (top-1 of the
    # catch-up's 2), the tree (its 2 children), plain (a gap the draft catches up on), chain K 3
    menu_bundle.warm_up()  # (the graph costs a chooser needs)
    e = Engine(menu_bundle, speculation="auto")
    cycle = ["chain K 1", "tree depth 2 topk 2 nodes 4", NONE, "chain K 3", NONE, NONE]
    served = []

    def next_shape(c=e.choosers[1]):
        served.append(cycle[len(served) % len(cycle)])
        return served[-1]

    e.choosers[1].next_shape = next_shape
    gens = e.generate_many(PROMPTS, 24)
    assert [g.token_ids for g in gens] == [p.token_ids for p in plain]
    assert len(set(served)) == 4 and sum(g.stats.num_drafts for g in gens) > 0


def test_auto_picks_among_the_whole_menu_by_cost_and_acceptance(menu_bundle):
    from eagle3_runtime.engine import Engine

    m = menu_bundle.manifest
    menu_bundle.warm_up()
    assert {"target_verify_b1_chain1", "draft_step_b1_tree2x2x4"} <= set(menu_bundle.costs)
    ms = {"target_decode_b1": 40, "target_verify_b1": 60, "target_verify_b1_chain1": 42,
          "target_verify_b1_tree2x2x4": 46, "draft_chain_b1": 8, "draft_step_b1_tree2x2x4": 5, "draft_catchup_b1": 4}
    saved = dict(menu_bundle.backend.costs)
    menu_bundle.backend.costs = {n: ms[n] / 1e3 for n in ms}
    try:
        for reach, best in (({"chain K 3": [0.9, 0.85, 0.8]}, "chain K 3"),
                            ({"chain K 3": [0.5, 0.2, 0.05]}, "chain K 1"),  # only the first draft pays
                            ({"chain K 3": [0.5, 0.2, 0.05], "tree depth 2 topk 2 nodes 4": [0.8, 0.5]},
                             "tree depth 2 topk 2 nodes 4"),
                            ({"chain K 3": [0.02, 0.0, 0.0], "tree depth 2 topk 2 nodes 4": [0.03, 0.0]}, NONE)):
            m.build["acceptance"] = {k: {"reach": v} for k, v in reach.items()}
            e = Engine(menu_bundle, speculation="auto")
            assert e.choosers[1].current == best, e.speculation_report()
            assert e.speculation_report()[0].startswith(f"speculation at batch 1: {best}")
            assert {c.name for c in e.choosers[1].candidates} == {NONE, "chain K 1", "chain K 3",
                                                                 "tree depth 2 topk 2 nodes 4"}
    finally:
        menu_bundle.backend.costs = saved
        m.build.pop("acceptance", None)


def test_a_chain_without_its_own_record_takes_the_deepest_chains(menu_bundle):
    from eagle3_runtime.adaptive import PRIOR_REACH, acceptance_profile
    from eagle3_runtime.speculation import chain

    m = menu_bundle.manifest
    m.build["acceptance"] = {"chain K 3": {"reach": [0.6, 0.3, 0.15]}, "chain K 1": {"reach": [0.5]}}
    try:
        assert acceptance_profile(m, chain(1)) == (0.5,)  # its own record
        assert acceptance_profile(m, chain(2)) == (0.6, 0.3)  # the deepest chain's, cut
        assert acceptance_profile(m, chain(4)) == pytest.approx((0.6, 0.3, 0.15, 0.075))  # extended at 0.5
        assert acceptance_profile(m, m.shapes(1)[2]) == (PRIOR_REACH, PRIOR_REACH ** 2)  # a tree: the prior
    finally:
        m.build.pop("acceptance", None)


def test_an_unknown_shape_tag_is_refused_naming_the_bundles(menu_bundle):
    from eagle3_runtime.engine import Engine
    from eagle3_runtime.errors import Eagle3Error

    with pytest.raises(Eagle3Error, match=r"'chain5'.*chain1, chain3, tree2x2x4"):
        Engine(menu_bundle, speculation="chain5")


def test_the_manifest_refuses_a_menu_it_cannot_serve(menu_bundle):
    from pydantic import ValidationError

    from eagle3_runtime.manifest import Manifest

    raw = menu_bundle.manifest.model_dump(mode="json")
    no_graph = dict(raw, graphs=[g for g in raw["graphs"] if g["name"] != "target_verify_b1_chain1"])
    with pytest.raises(ValidationError, match="missing target_verify/1/chain1"):
        Manifest.model_validate(no_graph)
    twice = dict(raw, menu={"1": raw["menu"]["1"] + raw["menu"]["1"][:1]})
    with pytest.raises(ValidationError, match="each once"):
        Manifest.model_validate(twice)
    stray = dict(raw, menu={"1": raw["menu"]["1"][1:]})
    with pytest.raises(ValidationError, match="target_verify/1/chain1 serves no shape"):
        Manifest.model_validate(stray)
    no_context = dict(raw, graphs=[g for g in raw["graphs"] if g["name"] != "target_decode_b1_c16"])
    with pytest.raises(ValidationError, match="missing target_decode/1/c16"):
        Manifest.model_validate(no_context)
    with pytest.raises(ValidationError, match=r"context_buckets \[16, 300\] must lie in 5..255"):
        Manifest.model_validate(dict(raw, context_buckets=[16, 300]))
    unknown = dict(raw, menu={**raw["menu"], "2": raw["menu"]["1"]})
    with pytest.raises(ValidationError, match="menu: batch bucket 2 is not one of the batch buckets"):
        Manifest.model_validate(unknown)


def test_inspect_lists_the_menu_with_tags(menu_bundle):
    from conftest import cli_inproc

    r = cli_inproc("eagle3-build", "inspect", str(menu_bundle.root))
    assert r.returncode == 0, r.stderr
    assert "menu chain K 1 [chain1], tree depth 2 topk 2 nodes 4 [tree2x2x4]" in r.stdout.replace("\n", " ")
    assert "context buckets [16, 32] (+ the whole cache)" in r.stdout.replace("\n", " ")
    assert "target_verify_b1_tree2x2x4_c32" in r.stdout


@pytest.mark.parametrize("menu, where, words", [
    ("fast", "speculation.menu", "must be auto or a non-empty list"),
    ([], "speculation.menu", "must be auto or a non-empty list"),
    ([{"num_speculative_tokens": 0}], "speculation.menu[0].num_speculative_tokens", "plain decoding is always"),
    ([{"num_speculative_tokens": 2}, {"num_speculative_tokens": 2}], "speculation.menu[1]", "already"),
    ([{"num_speculative_tokens": 2, "tre": {}}], "speculation.menu[0].tre", "unknown key 'tre'"),
    ([{"num_speculative_tokens": 2, "tree": {"topk": 2}}], "speculation.menu[0].tree.num_draft_tokens",
     "required key is missing"),
    ([{"num_speculative_tokens": 300}], "speculation.menu[0].num_speculative_tokens", "must be <= 16"),
])
def test_a_bad_menu_is_one_error_at_its_line(tiny, tmp_path, menu, where, words):
    _refused_at_its_line(tiny, tmp_path, lambda p: p.update(speculation={"num_speculative_tokens": 3, "menu": menu}),
                         where, words)


def _refused_at_its_line(tiny, tmp_path, edit, where, words):
    """The tiny pair's recipe with `edit` applied to its pair entry is refused, naming `where` and its line."""
    import yaml

    from eagle3_build.recipe import RecipeError, load_recipe

    base = tiny.pair()
    data = yaml.safe_load(base.read_text())
    edit(data["pairs"][0])
    data["pairs"][0]["target"] = str(base.parent / "target")
    data["pairs"][0]["draft"] = str(base.parent / "draft")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    issues = [i for i in e.value.errors if where in i.key]
    assert issues and words in issues[0].message and issues[0].line, [(i.key, i.message) for i in e.value.errors]


def test_menu_auto_is_the_chains_one_to_four(tiny):
    from eagle3_build.recipe import load_recipe

    (pair,) = load_recipe(tiny.recipe(recipe={"speculation": {"menu": "auto"}})).pairs
    assert [s.tag for s in pair.speculation.menu[1]] == ["chain1", "chain2", "chain4"]
    assert pair.speculation.num_speculative_tokens == 4 and pair.speculation.shapes[1].tag == "chain3"


def test_verify_checks_every_menu_shape_and_records_its_acceptance(menu_bundle, tmp_path):
    import json
    import shutil

    from eagle3_build.verify import verify_bundle
    from eagle3_runtime.manifest import MANIFEST

    root = tmp_path / "bundle"
    shutil.copytree(menu_bundle.root, root)
    report = verify_bundle(root, num_prompts=3, max_tokens=16)
    assert report.lossless_ok, report.format()
    assert [r.tag for r in report.menu] == ["chain1", "tree2x2x4"] and all(r.ok == 3 for r in report.menu)
    assert "menu chain K 1 [chain1]: 3/3 prompts lossless" in report.format()
    recorded = json.loads((root / MANIFEST).read_text())["build"]["acceptance"]
    assert {k: len(v["reach"]) for k, v in recorded.items()} == {"chain K 3": 3, "chain K 1": 1,
                                                                 "tree depth 2 topk 2 nodes 4": 2}


@pytest.mark.parametrize("context, words", [
    ([300], "context bucket 300 must be below serving.max_model_len (256)"),
    ([2], "context bucket 2 is below 5"),
    ([64, 32], "strictly ascending"),
])
def test_a_bad_context_bucket_is_one_error_at_its_line(tiny, tmp_path, context, words):
    _refused_at_its_line(tiny, tmp_path, lambda p: p["buckets"].update(context=context), "buckets.context", words)
