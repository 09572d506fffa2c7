"""Answer metrics (``evaluation/metrics.py``) on hand-made pairs, the tree edit distance against a
brute-force one on random small trees, and worked examples of the JSON metrics computed by hand."""

import functools
import random

import pytest

from examples.multimodal_dev.evaluation import metrics
from examples.multimodal_dev.evaluation.tree_edit import tree_edit_distance

RECEIPT = {"menu": [{"nm": "cake", "cnt": "2"}, {"nm": "juice", "cnt": "1"}], "total": {"total_price": "5.75"}}


def _brute_force(a, b, insert, remove, update) -> float:
    """The textbook recursion over forests (rightmost roots), memoised: exponential without the
    memo, fine for trees of a few nodes."""

    @functools.lru_cache(maxsize=None)
    def forest(f, g):
        if not f and not g:
            return 0
        if not g:
            return forest(f[:-1] + f[-1][1], g) + remove(f[-1])
        if not f:
            return forest(f, g[:-1] + g[-1][1]) + insert(g[-1])
        v, w = f[-1], g[-1]
        return min(
            forest(f[:-1] + v[1], g) + remove(v),
            forest(f, g[:-1] + w[1]) + insert(w),
            forest(v[1], w[1]) + forest(f[:-1], g[:-1]) + update(v, w),
        )

    return forest((a,), (b,))


def _random_tree(rng, size):
    if size == 1:
        return rng.choice("abc"), ()
    children, left = [], size - 1
    while left:
        part = rng.randint(1, left)
        children.append(_random_tree(rng, part))
        left -= part
    return rng.choice("abc"), tuple(children)


def test_tree_edit_distance_equals_the_brute_force_one():
    rng = random.Random(0)
    costs = [
        (lambda n: 1, lambda n: 1, lambda a, b: int(a[0] != b[0])),
        (lambda n: 1 + "abc".index(n[0]), lambda n: 2, lambda a, b: 3 * int(a[0] != b[0])),
    ]
    for _ in range(150):
        a, b = _random_tree(rng, rng.randint(1, 7)), _random_tree(rng, rng.randint(1, 7))
        for insert, remove, update in costs:
            assert tree_edit_distance(a, b, insert, remove, update) == _brute_force(a, b, insert, remove, update)


def test_identical_answers_score_one_and_empty_ones_zero():
    assert metrics.tree_accuracy(RECEIPT, RECEIPT) == 1.0
    assert metrics.f1_of(*metrics.field_counts(RECEIPT, RECEIPT)) == 1.0
    assert metrics.tree_accuracy({}, RECEIPT) == 0.0
    assert metrics.f1_of(*metrics.field_counts({}, RECEIPT)) == 0.0
    assert metrics.exact_match("Total: 5.75", "total 5.75") == 1.0 and metrics.token_f1("", "") == 1.0
    assert metrics.token_f1("", "cake") == 0.0 and metrics.anls("", ["cake"]) == 0.0


def test_a_prediction_that_is_not_json_scores_zero():
    assert metrics.parse_json('{"menu": [{"nm": "cake"') is None
    assert metrics.tree_accuracy(metrics.parse_json('{"menu": [{"nm": "cake"'), RECEIPT) == 0.0
    assert metrics.f1_of(*metrics.field_counts(None, RECEIPT)) == 0.0


def test_worked_examples_of_the_json_metrics():
    """One character wrong in one leaf: the tree edit costs 1 (relabel 'juice' as 'juce'); building
    the reference from the empty tree costs 25: 10 nodes at 1 (menu, its 2 <subtree>, 4 keys, total,
    its <subtree> (an object becomes a list of one), total_price) and the leaves' characters (cake 4,
    2 1, juice 5, 1 1, 5.75 4: 15). Field F1: 4 of 5 fields match on both sides."""
    wrong = {"menu": [{"nm": "cake", "cnt": "2"}, {"nm": "juce", "cnt": "1"}], "total": {"total_price": "5.75"}}
    assert metrics.tree_accuracy(wrong, RECEIPT) == pytest.approx(1 - 1 / 25)
    assert metrics.field_counts(wrong, RECEIPT) == (4, 5, 5)
    assert metrics.f1_of(4, 5, 5) == pytest.approx(0.8)
    # a missing field: inserting "cash" and its leaf "10" costs 1 + 2, against 1 + 2 + 1 + 4 from empty
    assert metrics.tree_accuracy({"total": "5.75"}, {"total": "5.75", "cash": "10"}) == pytest.approx(1 - 3 / 8)
    # normalisation: key order, numbers as strings, empty values dropped, a single value as a list
    assert metrics.normalise_json({"total": 5.75, "cash": "", "menu": {"nm": " cake "}}) == {
        "menu": [{"nm": ["cake"]}],
        "total": ["5.75"],
    }
    assert metrics.tree_accuracy({"total": 5.75, "cash": ""}, {"total": ["5.75"]}) == 1.0


def test_text_metrics_on_hand_made_pairs():
    assert metrics.exact_match("The cat!", "cat") == 1.0 and metrics.exact_match("cat", "cats") == 0.0
    assert metrics.token_f1("a b c d", "b c d e") == pytest.approx(2 * 3 / (3 + 4))  # "a" is an article
    assert metrics.token_f1("x y z", "b c d e") == 0.0
    assert metrics.anls("helo", ["hello"]) == pytest.approx(1 - 1 / 5)
    assert metrics.anls("abc", ["xyz", "abd"]) == pytest.approx(1 - 1 / 3)  # the best reference
    assert metrics.anls("abcdef", ["abcxyz"]) == 0.0  # distance 0.5: over the threshold


def test_scores_of_a_set_add_up_across_shares():
    """Two shares scored apart and added (as ranks all-reduce them) give the set's means; the field F1
    is micro-averaged over the JSON answers, free-text answers add no fields."""
    from examples.multimodal_dev.evaluation.scores import Scores

    pairs = [
        ("A red circle.", "a red circle"),
        ("blue", "Blue square"),
        ('{"menu": [{"nm": "cake", "cnt": "2"}]}', '{"menu": [{"nm": "cake", "cnt": "2"}, {"nm": "tea", "cnt": "1"}]}'),
        ("not json", '{"total": {"total_price": "5.75"}}'),
    ]
    whole, first, second = Scores(), Scores(), Scores()
    for i, (prediction, reference) in enumerate(pairs):
        whole.add(prediction, reference)
        (first if i % 2 else second).add(prediction, reference)
    added = Scores([a + b for a, b in zip(first.vector(), second.vector())])
    assert added.means() == whole.means()
    means = whole.means()
    assert means["exact_match"] == 0.25  # only the first, after normalisation
    # "blue" vs "blue square": 2 * 1 / 3; the receipts' words "menu nm cake cnt 2" in 5 + 9: 10 / 14
    assert means["token_f1"] == pytest.approx((1 + 2 / 3 + 10 / 14 + 0) / 4)
    # fields: the cake's 2 matched of 2 predicted and 4 + 1 expected
    assert means["field_f1"] == pytest.approx(2 * 2 / (2 + 5))
    assert Scores().means() == {}
