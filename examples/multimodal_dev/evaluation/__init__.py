"""Scoring generated answers against references: text metrics (exact match, token F1, ANLS) and
the JSON metrics of document parsing (field-level F1, normalised tree-edit-distance accuracy)."""
