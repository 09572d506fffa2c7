"""Metrics of generated answers, each a function of one prediction and its reference(s).

Free text (question answering):
    exact_match      1 when the normalised texts are equal (lower case, no punctuation, no articles,
                     single spaces: SQuAD's normalisation)
    token_f1         F1 of the normalised texts' word multisets (SQuAD); both empty: 1
    anls             average normalised Levenshtein similarity (DocVQA): the best over the
                     references of 1 - distance / longer length, 0 where that distance is 0.5 or more

JSON (document parsing, CORD-V2), as the Donut paper defines them:
    field_counts     (matched, predicted, reference) counts of ``path = value`` fields; summed over a
                     set they give the micro-averaged field F1 (``f1_of``)
    tree_accuracy    max(0, 1 - TED(prediction, reference) / TED(empty, reference)) over the
                     normalised trees (``json_tree``); an invalid prediction is the empty one

Normalisation of JSON follows the paper's evaluator: empty values are dropped, keys are ordered
by length then name, scalars become stripped strings, and a key's single value becomes a list of
one. Tree nodes are the keys, a ``<subtree>`` per object in a list, and one leaf per string;
removing or inserting a leaf costs its length, any other node 1; relabelling a leaf costs the
character edit distance, a leaf against another node its length + 1, two other nodes 0 or 1.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter

from .tree_edit import tree_edit_distance

LEAF = "<leaf>"
ANLS_THRESHOLD = 0.5


def normalise_text(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalise_text(prediction) == normalise_text(reference))


def token_f1(prediction: str, reference: str) -> float:
    predicted, expected = normalise_text(prediction).split(), normalise_text(reference).split()
    if not predicted or not expected:
        return float(predicted == expected)
    common = sum((Counter(predicted) & Counter(expected)).values())
    return f1_of(common, len(predicted), len(expected))


def f1_of(matched: float, predicted: float, expected: float) -> float:
    """F1 from counts; nothing predicted and nothing expected is a perfect 1."""
    if predicted + expected == 0:
        return 1.0
    return 2 * matched / (predicted + expected)


def levenshtein(a: str, b: str) -> int:
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def anls(prediction: str, references: list[str]) -> float:
    best = 0.0
    for reference in references:
        a, b = " ".join(prediction.lower().split()), " ".join(reference.lower().split())
        distance = levenshtein(a, b) / max(len(a), len(b), 1)
        best = max(best, 1 - distance if distance < ANLS_THRESHOLD else 0.0)
    return best


def parse_json(text: str):
    """The JSON value of a generated answer, or None when it is not JSON."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError, RecursionError):
        return None


def normalise_json(value):
    """The value as the evaluator compares it (empty parts dropped; see the module's docstring)."""
    if not value:
        return {}
    if isinstance(value, dict):
        out = {}
        for key in sorted(value, key=lambda k: (len(k), k)):
            kept = normalise_json(value[key])
            if kept:
                out[key] = kept if isinstance(kept, list) else [kept]
        return out
    if isinstance(value, list):
        if all(isinstance(item, dict) for item in value):
            return [kept for kept in map(normalise_json, value) if kept]
        return [
            str(item).strip()
            for item in value
            if isinstance(item, (str, int, float)) and not isinstance(item, bool) and str(item).strip()
        ]
    return [str(value).strip()]


def fields(value) -> list[tuple[str, str]]:
    """``(dotted key path, leaf)`` of every leaf of a normalised value; list positions are not part of
    the path (a receipt's items compare as a multiset)."""
    out = []

    def walk(node, path):
        if isinstance(node, dict):
            for key, child in node.items():
                walk(child, f"{path}.{key}" if path else key)
        elif isinstance(node, list):
            for child in node:
                walk(child, path)
        else:
            out.append((path, node))

    walk(value, "")
    return out


def field_counts(prediction, reference) -> tuple[int, int, int]:
    predicted, expected = fields(normalise_json(prediction)), fields(normalise_json(reference))
    matched = sum((Counter(predicted) & Counter(expected)).values())
    return matched, len(predicted), len(expected)


def json_tree(value, label: str = "<root>"):
    """The ``(label, children)`` tree of a normalised value."""
    if isinstance(value, dict):
        return label, tuple(json_tree(child, key) for key, child in value.items())
    if all(isinstance(item, dict) for item in value):
        return label, tuple(json_tree(item, "<subtree>") for item in value)
    return label, tuple((LEAF + item, ()) for item in value)


def _text(node) -> str | None:
    return node[0][len(LEAF) :] if node[0].startswith(LEAF) else None


def _insert_or_remove(node) -> int:
    text = _text(node)
    return 1 if text is None else len(text)


def _update(a, b) -> int:
    ta, tb = _text(a), _text(b)
    if ta is not None and tb is not None:
        return levenshtein(ta, tb)
    one = ta if ta is not None else tb
    if one is not None:  # text on one side only
        return 1 + len(one)
    return int(a[0] != b[0])


def tree_accuracy(prediction, reference) -> float:
    """Normalised tree-edit-distance accuracy; ``prediction`` None (not JSON) counts as empty."""
    expected = json_tree(normalise_json(reference))
    empty = tree_edit_distance(json_tree({}), expected, _insert_or_remove, _insert_or_remove, _update)
    predicted = json_tree(normalise_json(prediction if prediction is not None else {}))
    distance = tree_edit_distance(predicted, expected, _insert_or_remove, _insert_or_remove, _update)
    if empty == 0:  # an empty reference: only an empty prediction matches it
        return float(distance == 0)
    return max(0.0, 1 - distance / empty)
