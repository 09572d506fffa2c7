"""Vision patches: what the vision tower is given at once. A patch is one row the tower reads:
t*h*w of a ``*_grid_thw`` row, counted before the 2x2 spatial merge (the merge comes after the
tower's blocks, so its activations grow with these rows, not with the merged tokens)."""

from __future__ import annotations


def patches(grids) -> int:
    """The tower's input rows of ``grids`` [(t, h, w), ...]."""
    return sum(int(t) * int(h) * int(w) for t, h, w in grids)
