"""The metrics of a set of generated answers (``metrics.py``), kept as sums so that ranks which each
scored a share add them up (one all-reduce of ``vector()``) before the means are taken.

Every answer gets the free-text metrics; an answer whose reference is a JSON object or list (CORD-V2's
receipts) also gets the field F1, micro-averaged over the set as the Donut paper does, and the
tree-edit-distance accuracy.
"""

from __future__ import annotations

from .metrics import anls, exact_match, f1_of, field_counts, parse_json, token_f1, tree_accuracy

# the order of ``vector()``: the same on every rank
SUMS = (
    "answers",
    "exact_match",
    "token_f1",
    "anls",
    "json_answers",
    "fields_matched",
    "fields_predicted",
    "fields_expected",
    "tree_accuracy",
)


class Scores:
    def __init__(self, sums=None):
        self.sums = dict.fromkeys(SUMS, 0.0) if sums is None else dict(zip(SUMS, map(float, sums)))

    def add(self, prediction: str, reference: str) -> None:
        s = self.sums
        s["answers"] += 1
        s["exact_match"] += exact_match(prediction, reference)
        s["token_f1"] += token_f1(prediction, reference)
        s["anls"] += anls(prediction, [reference])
        expected = parse_json(reference)
        if isinstance(expected, (dict, list)):
            predicted = parse_json(prediction)
            matched, n_predicted, n_expected = field_counts(predicted, expected)
            s["json_answers"] += 1
            s["fields_matched"] += matched
            s["fields_predicted"] += n_predicted
            s["fields_expected"] += n_expected
            s["tree_accuracy"] += tree_accuracy(predicted, expected)

    def vector(self) -> list[float]:
        return [self.sums[name] for name in SUMS]

    def means(self) -> dict[str, float]:
        """The metrics of the set (empty where it has no answer of their kind)."""
        s, out = self.sums, {}
        if s["answers"]:
            out.update({name: s[name] / s["answers"] for name in ("exact_match", "token_f1", "anls")})
        if s["json_answers"]:
            out["field_f1"] = f1_of(s["fields_matched"], s["fields_predicted"], s["fields_expected"])
            out["tree_accuracy"] = s["tree_accuracy"] / s["json_answers"]
        return out
