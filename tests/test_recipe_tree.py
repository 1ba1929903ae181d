"""Recipe speculation shapes: dynamic / static trees and per-batch-bucket overrides, and their errors."""

from __future__ import annotations

import pytest
from test_recipe import assert_issue, line_no, load_err, write

from eagle3_build.recipe import PairRecipe, load_recipe
from eagle3_runtime.speculation import NO_SPECULATION, SpecShape, chain, dynamic_tree, static_tree

# batch buckets [1, 2, 4] (the default for max_num_seqs 4)
TREE = """\
pairs:
  - name: tiny
    target: ./target
    draft: ./draft
    dtype: float32
    speculation:
      num_speculative_tokens: 3
      tree: {topk: 4, num_draft_tokens: 16}
    serving:
      max_num_seqs: 4
      max_model_len: 256
"""
P = "pairs[0].speculation"


def spec(body: str, *, mml: int = 256, extra: str = "") -> str:
    """TREE with its speculation section replaced by ``body`` (lines indented under speculation:)."""
    head, rest = TREE.split("    speculation:\n", 1)
    rest = rest.split("    serving:\n", 1)[1]
    lines = "".join(f"      {ln}\n" for ln in body.strip("\n").splitlines())
    return (head + "    speculation:\n" + lines + "    serving:\n" + rest).replace(
        "max_model_len: 256", f"max_model_len: {mml}") + extra


def load_pair(tmp_path, text: str) -> PairRecipe:
    [pair] = load_recipe(write(tmp_path, text)).pairs
    return pair


def round_trips(pair: PairRecipe) -> None:
    dumped = pair.model_dump(mode="json")
    assert PairRecipe.model_validate(dumped) == pair
    with pytest.raises(Exception):  # frozen
        pair.speculation.num_speculative_tokens = 9


# ------------------------------------------------------------------------------ valid recipes


def test_dynamic_tree_every_bucket(tmp_path):
    pair = load_pair(tmp_path, TREE)
    want = dynamic_tree(3, 4, 16)
    assert want == SpecShape(depth=3, topk=4, width=4, num_nodes=16)
    assert pair.buckets.batch == [1, 2, 4]
    assert pair.speculation.shapes == {1: want, 2: want, 4: want}
    assert pair.speculation.num_speculative_tokens == 3
    assert pair.speculation.scratch() == want.scratch
    round_trips(pair)


def test_topk_one_is_a_chain(tmp_path):
    pair = load_pair(tmp_path, spec("num_speculative_tokens: 3\ntree: {topk: 1, num_draft_tokens: 4}"))
    assert pair.speculation.shapes == {1: chain(3), 2: chain(3), 4: chain(3)}


def test_no_tree_is_a_chain(tmp_path):
    pair = load_pair(tmp_path, spec("num_speculative_tokens: 2"))
    assert pair.speculation.shapes == {1: chain(2), 2: chain(2), 4: chain(2)}


def test_static_tree(tmp_path):
    choices = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    pair = load_pair(tmp_path, spec(f"tree: {{choices: {choices}}}"))
    want = static_tree(choices)
    assert (want.depth, want.num_nodes, want.topk) == (3, 6, 2)
    assert pair.speculation.shapes == {1: want, 2: want, 4: want}
    assert pair.speculation.num_speculative_tokens == 3
    round_trips(pair)
    # num_speculative_tokens may be given if it equals the depth
    pair = load_pair(tmp_path, spec(f"num_speculative_tokens: 3\ntree: {{choices: {choices}}}"))
    assert pair.speculation.shapes[4] == want


def test_per_batch_bucket_mixed(tmp_path):
    text = spec("""\
num_speculative_tokens: 3
tree: {topk: 4, num_draft_tokens: 16}
per_batch_bucket:
  1: {num_speculative_tokens: 5, tree: {topk: 2, num_draft_tokens: 8}}
  2: {num_speculative_tokens: 2}
  4: {num_speculative_tokens: 0}
""")
    pair = load_pair(tmp_path, text)
    assert pair.speculation.shapes == {1: dynamic_tree(5, 2, 8), 2: chain(2), 4: NO_SPECULATION}
    assert pair.speculation.num_speculative_tokens == 5  # the deepest, not the top level's 3
    round_trips(pair)


def test_per_batch_bucket_does_not_inherit_tree(tmp_path):
    text = spec("""\
num_speculative_tokens: 3
tree: {topk: 4, num_draft_tokens: 16}
per_batch_bucket:
  4: {num_speculative_tokens: 3}
""")
    pair = load_pair(tmp_path, text)
    assert pair.speculation.shapes == {1: dynamic_tree(3, 4, 16), 2: dynamic_tree(3, 4, 16), 4: chain(3)}


def test_static_tree_per_bucket(tmp_path):
    text = spec("""\
num_speculative_tokens: 1
per_batch_bucket:
  1: {tree: {choices: [[0], [1], [0, 0]]}}
""")
    pair = load_pair(tmp_path, text)
    assert pair.speculation.shapes == {1: static_tree([[0], [1], [0, 0]]), 2: chain(1), 4: chain(1)}
    assert pair.speculation.num_speculative_tokens == 2


def test_deepest_ignores_an_unused_top_level(tmp_path):
    text = spec("""\
num_speculative_tokens: 9
per_batch_bucket:
  1: {num_speculative_tokens: 2}
  2: {num_speculative_tokens: 2}
  4: {num_speculative_tokens: 0}
""", mml=4)
    pair = load_pair(tmp_path, text)  # max_model_len 4 fits depth 2, not the unused 9
    assert pair.speculation.num_speculative_tokens == 2


def test_per_batch_bucket_with_explicit_buckets(tmp_path):
    text = spec("num_speculative_tokens: 2\nper_batch_bucket:\n  3: {num_speculative_tokens: 1}",
                extra="    buckets:\n      batch: [1, 3, 4]\n")
    pair = load_pair(tmp_path, text)
    assert pair.speculation.shapes == {1: chain(2), 3: chain(1), 4: chain(2)}


def test_tree_from_defaults(tmp_path):
    text = """\
    defaults:
      speculation:
        num_speculative_tokens: 2
        tree: {topk: 3, num_draft_tokens: 10}
    pairs:
      - name: a
        target: ./target
        draft: ./draft
        serving: {max_num_seqs: 2, max_model_len: 64}
    """
    pair = load_pair(tmp_path, text)
    assert pair.speculation.shapes == {1: dynamic_tree(2, 3, 10), 2: dynamic_tree(2, 3, 10)}


# ------------------------------------------------------------------------------------ errors


def one_issue(tmp_path, text: str, needle: str, key: str, *words: str, nth: int = 1):
    path = write(tmp_path, text)
    err = load_err(path)
    assert len(err.errors) == 1, str(err)
    assert_issue(err, path, line_no(text, needle, nth), key, *words)
    return err


def test_num_draft_tokens_too_many(tmp_path):
    text = spec("num_speculative_tokens: 2\ntree:\n  topk: 2\n  num_draft_tokens: 8")
    err = one_issue(tmp_path, text, "num_draft_tokens:", f"{P}.tree.num_draft_tokens",
                    "must be in [3, 7], got 8", "2 steps of topk 2 children can grow at most 7 nodes")
    assert "lower num_draft_tokens" in str(err)


def test_num_draft_tokens_too_few(tmp_path):
    text = spec("num_speculative_tokens: 4\ntree:\n  topk: 4\n  num_draft_tokens: 4")
    one_issue(tmp_path, text, "num_draft_tokens:", f"{P}.tree.num_draft_tokens",
              "must be in [5, 53], got 4", "counts the root", "num_speculative_tokens + 1 = 5")


def test_topk_one_needs_a_chain_of_nodes(tmp_path):
    text = spec("num_speculative_tokens: 3\ntree:\n  topk: 1\n  num_draft_tokens: 6")
    one_issue(tmp_path, text, "num_draft_tokens:", f"{P}.tree.num_draft_tokens", "must be in [4, 4], got 6")


def test_topk_bounds(tmp_path):
    text = spec("num_speculative_tokens: 3\ntree:\n  topk: 0\n  num_draft_tokens: 6")
    one_issue(tmp_path, text, "topk:", f"{P}.tree.topk", "must be >= 1")
    text = spec("num_speculative_tokens: 3\ntree:\n  topk: 129\n  num_draft_tokens: 6")
    one_issue(tmp_path, text, "topk:", f"{P}.tree.topk", "must be <= 128", "MAX_NODES", "got 129")


def test_num_draft_tokens_above_max_nodes(tmp_path):
    text = spec("num_speculative_tokens: 3\ntree:\n  topk: 10\n  num_draft_tokens: 200")
    one_issue(tmp_path, text, "num_draft_tokens:", f"{P}.tree.num_draft_tokens", "must be <= 128", "got 200")


def test_depth_above_max_depth(tmp_path):
    text = spec("num_speculative_tokens: 17", mml=4096)
    one_issue(tmp_path, text, "num_speculative_tokens:", f"{P}.num_speculative_tokens",
              "must be <= 16", "MAX_DEPTH", "got 17")


def test_dynamic_tree_needs_both_keys(tmp_path):
    text = spec("num_speculative_tokens: 3\ntree:\n  topk: 2")
    one_issue(tmp_path, text, "tree:", f"{P}.tree.num_draft_tokens", "required key is missing", "with topk")
    text = spec("num_speculative_tokens: 3\ntree: {}")
    one_issue(tmp_path, text, "tree:", f"{P}.tree", "topk and num_draft_tokens", "or choices")


def test_tree_needs_num_speculative_tokens(tmp_path):
    text = spec("tree: {topk: 2, num_draft_tokens: 4}")
    one_issue(tmp_path, text, "speculation:", f"{P}.num_speculative_tokens", "required key is missing",
              "only a static tree")


def test_choices_with_topk(tmp_path):
    text = spec("tree:\n  choices: [[0], [1]]\n  topk: 2\n  num_draft_tokens: 3")
    path = write(tmp_path, text)
    err = load_err(path)
    assert len(err.errors) == 2
    assert_issue(err, path, line_no(text, "topk:"), f"{P}.tree.topk", "not allowed with choices", "drop topk")
    assert_issue(err, path, line_no(text, "num_draft_tokens:"), f"{P}.tree.num_draft_tokens",
                 "not allowed with choices")


def test_choices_depth_mismatch(tmp_path):
    text = spec("num_speculative_tokens: 3\ntree:\n  choices: [[0], [0, 0]]")
    one_issue(tmp_path, text, "num_speculative_tokens:", f"{P}.num_speculative_tokens",
              "must equal the depth of tree.choices (2), got 3", "omit it")


def test_choices_not_prefix_closed(tmp_path):
    text = spec("tree:\n  choices:\n    - [0]\n    - [1, 0]\n    - [0, 0]")
    one_issue(tmp_path, text, "- [1, 0]", f"{P}.tree.choices[1]", "[1, 0] has no parent [1]", "prefix-closed")


def test_choices_duplicate_and_empty_path(tmp_path):
    text = spec("tree:\n  choices:\n    - [0]\n    - []\n    - [0]")
    path = write(tmp_path, text)
    err = load_err(path)
    assert len(err.errors) == 2
    assert_issue(err, path, line_no(text, "- []"), f"{P}.tree.choices[1]", "empty path", "root is implied")
    assert_issue(err, path, line_no(text, "- [0]", 2), f"{P}.tree.choices[2]", "[0] appears twice",
                 "first as choices[0]")


def test_choices_empty_or_wrong_types(tmp_path):
    one_issue(tmp_path, spec("tree:\n  choices: []"), "choices:", f"{P}.tree.choices", "must not be empty")
    one_issue(tmp_path, spec("tree:\n  choices:\n    - [0]\n    - [0, -1]"), "- [0, -1]",
              f"{P}.tree.choices[1][1]", "must be >= 0")
    one_issue(tmp_path, spec("tree:\n  choices:\n    - [0]\n    - 1"), "- 1", f"{P}.tree.choices[1]",
              "must be a list")
    one_issue(tmp_path, spec("tree:\n  choices:\n    - [0]\n    - ['a']"), "['a']", f"{P}.tree.choices[1][0]",
              "must be an integer")


def test_choices_rank_bound(tmp_path):
    one_issue(tmp_path, spec("tree:\n  choices:\n    - [0]\n    - [200]"), "- [200]", f"{P}.tree.choices[1][0]",
              "must be <= 127")


def test_depth_still_checked_when_the_tree_is_wrong(tmp_path):
    text = spec("num_speculative_tokens: 3\ntree:\n  topk: 2\n  num_draft_tokens: 99", mml=4)
    path = write(tmp_path, text)
    err = load_err(path)
    assert len(err.errors) == 2
    assert_issue(err, path, line_no(text, "num_draft_tokens:"), f"{P}.tree.num_draft_tokens", "must be in [4, 11]")
    assert_issue(err, path, line_no(text, "max_model_len:"), "pairs[0].serving.max_model_len",
                 "greater than speculation.num_speculative_tokens + 1 (4), got 4")


def test_choices_too_deep(tmp_path):
    deep = [[0] * n for n in range(1, 18)]
    text = spec("tree:\n  choices:\n" + "".join(f"    - {c}\n" for c in deep), mml=4096)
    one_issue(tmp_path, text, "- " + str([0] * 17), f"{P}.tree.choices[16]", "17 deep", "at most 16")


def test_choices_too_many(tmp_path):
    many = [[i] for i in range(127)] + [[0, 0]]
    text = spec(f"tree:\n  choices: {many}")
    one_issue(tmp_path, text, "choices:", f"{P}.tree.choices", "128 paths, at most 127")


def test_unknown_bucket(tmp_path):
    text = spec("num_speculative_tokens: 2\nper_batch_bucket:\n  3: {num_speculative_tokens: 1}")
    one_issue(tmp_path, text, "3:", f"{P}.per_batch_bucket[3]", "unknown batch bucket 3",
              "batch buckets are 1, 2, 4", "serving.max_num_seqs 4")
    text = spec("num_speculative_tokens: 2\nper_batch_bucket:\n  2: {num_speculative_tokens: 1}",
                extra="    buckets:\n      batch: [1, 4]\n")
    one_issue(tmp_path, text, "2:", f"{P}.per_batch_bucket[2]", "batch buckets are 1, 4 (buckets.batch)")


def test_non_int_bucket_key(tmp_path):
    text = spec("num_speculative_tokens: 2\nper_batch_bucket:\n  one: {num_speculative_tokens: 1}")
    one_issue(tmp_path, text, "one:", f"{P}.per_batch_bucket.one", "must be a batch bucket size",
              "string 'one'")


def test_per_bucket_entry_errors(tmp_path):
    text = spec("num_speculative_tokens: 2\nper_batch_bucket:\n  1:\n    num_speculative_tokens: 0\n"
                "    tree: {topk: 2, num_draft_tokens: 1}")
    one_issue(tmp_path, text, "num_speculative_tokens: 0", f"{P}.per_batch_bucket[1].num_speculative_tokens",
              "must be >= 1 with a tree", "drop tree")
    text = spec("num_speculative_tokens: 2\nper_batch_bucket:\n  2:\n    num_speculative_tokens: 3\n"
                "    tree:\n      topk: 2\n      num_draft_tokens: 12")
    one_issue(tmp_path, text, "num_draft_tokens: 12", f"{P}.per_batch_bucket[2].tree.num_draft_tokens",
              "must be in [4, 11], got 12")
    text = spec("num_speculative_tokens: 2\nper_batch_bucket:\n  2:\n    num_speculative_tokens: -1")
    one_issue(tmp_path, text, "num_speculative_tokens: -1", f"{P}.per_batch_bucket[2].num_speculative_tokens",
              "must be >= 0")
    text = spec("num_speculative_tokens: 2\nper_batch_bucket:\n  2:\n    tree: {topk: 2}\n    colour: red")
    path = write(tmp_path, text)
    err = load_err(path)
    assert_issue(err, path, line_no(text, "colour"), f"{P}.per_batch_bucket[2].colour", "unknown key",
                 "allowed keys: num_speculative_tokens, tree")
    text = spec("num_speculative_tokens: 2\nper_batch_bucket:\n  2: 3")
    one_issue(tmp_path, text, "2: 3", f"{P}.per_batch_bucket[2]",
              "must be a mapping with keys num_speculative_tokens, tree")
    text = spec("num_speculative_tokens: 2\nper_batch_bucket: [1, 2]")
    one_issue(tmp_path, text, "per_batch_bucket:", f"{P}.per_batch_bucket",
              "must be a mapping of batch bucket sizes to sections with keys num_speculative_tokens, tree")


def test_top_level_zero_still_refused(tmp_path):
    one_issue(tmp_path, spec("num_speculative_tokens: 0"), "num_speculative_tokens:", f"{P}.num_speculative_tokens",
              ">= 1")


def test_unknown_tree_key(tmp_path):
    text = spec("num_speculative_tokens: 2\ntree:\n  topk: 2\n  num_draft_tokens: 4\n  width: 2")
    one_issue(tmp_path, text, "width:", f"{P}.tree.width", "unknown key", "topk, num_draft_tokens, choices")


def test_max_model_len_uses_the_deepest_shape(tmp_path):
    body = "num_speculative_tokens: 2\nper_batch_bucket:\n  1: {num_speculative_tokens: 5}"
    text = spec(body, mml=6)
    one_issue(tmp_path, text, "max_model_len:", "pairs[0].serving.max_model_len",
              "greater than speculation.per_batch_bucket[1].num_speculative_tokens + 1 (6", "deepest",
              "got 6", "at least 7")
    assert load_pair(tmp_path, spec(body, mml=7)).speculation.num_speculative_tokens == 5
    # a static tree's depth comes from its choices
    text = spec("tree: {choices: [[0], [0, 0], [0, 0, 0]]}", mml=4)
    one_issue(tmp_path, text, "max_model_len:", "pairs[0].serving.max_model_len",
              "the depth of speculation.tree.choices + 1 (4", "got 4")


def test_min_acceptance_length_uses_the_deepest_shape(tmp_path):
    body = "num_speculative_tokens: 1\nper_batch_bucket:\n  2: {num_speculative_tokens: 3}"
    text = spec(body, extra="    verify: {min_acceptance_length: 4.5}\n")
    one_issue(tmp_path, text, "min_acceptance_length", "pairs[0].verify.min_acceptance_length",
              "can never be reached", "= 4", "got 4.5")
    assert load_pair(tmp_path, spec(body, extra="    verify: {min_acceptance_length: 4.0}\n"))


def test_tree_error_from_defaults(tmp_path):
    text = """\
    defaults:
      speculation:
        num_speculative_tokens: 2
        tree: {topk: 2, num_draft_tokens: 9}
    pairs:
      - name: a
        target: ./target
        draft: ./draft
        serving: {max_num_seqs: 1, max_model_len: 64}
    """
    one_issue(tmp_path, text, "tree:", "pairs[0].speculation.tree.num_draft_tokens", "must be in [3, 7]",
              "(from defaults)")


def test_no_bucket_speculating_is_refused(tmp_path):
    text = spec("""
num_speculative_tokens: 3
per_batch_bucket:
  1: {num_speculative_tokens: 0}
  2: {num_speculative_tokens: 0}
  4: {num_speculative_tokens: 0}
""")
    path = write(tmp_path, text)
    assert_issue(load_err(path), path, line_no(text, "per_batch_bucket:"), f"{P}.per_batch_bucket",
                 "no batch bucket speculates", "give at least one bucket a chain or a tree")


def test_a_manifest_is_held_to_the_recipe_s_shape_rules_in_the_same_words():
    """speculation.tree_problems / choices_problems are the one statement of the shape rules: a recipe reports
    each at its line, a manifest (or static_tree) refuses with the first, word for word."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"num_draft_tokens: must be in \[3, 7\], got 8: 2 steps of topk 2"):
        SpecShape(depth=2, topk=2, width=2, num_nodes=8)
    with pytest.raises(ValidationError, match=r"num_draft_tokens: must be in \[4, 11\], got 3: it counts the root"):
        SpecShape(depth=3, topk=2, width=2, num_nodes=3)
    with pytest.raises(ValueError, match=r"choices\[1\]: \[1, 0\] has no parent \[1\] \(the paths must be "
                                         r"prefix-closed\)"):
        static_tree([[0], [1, 0]])
    with pytest.raises(ValueError, match=r"choices\[2\]: \[0\] appears twice \(first as choices\[0\]\)"):
        static_tree([[0], [1], [0]])
