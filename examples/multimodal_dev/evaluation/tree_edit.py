"""Ordered tree edit distance (Zhang and Shasha, 1989) with caller-given costs.

A tree is ``(label, children)`` with ``children`` a tuple of trees. The distance is the cheapest
sequence of node removals, insertions and relabellings that turns one tree into the other, keeping
the left-to-right order of siblings and the ancestor relation. O(n1 * n2 * depth1 * depth2) time:
receipts have tens of nodes.
"""

from __future__ import annotations

from collections.abc import Callable


def _postorder(tree) -> tuple[list, list[int], list[int]]:
    """(nodes in post-order, the post-order index of each node's leftmost leaf, the key roots)."""
    nodes, leftmost = [], []

    def visit(node) -> int:
        first = None
        for child in node[1]:
            leaf = visit(child)
            first = leaf if first is None else first
        nodes.append(node)
        leftmost.append(len(nodes) - 1 if first is None else first)
        return leftmost[-1]

    visit(tree)
    last_with_leftmost = {leaf: index for index, leaf in enumerate(leftmost)}  # the highest node wins
    return nodes, leftmost, sorted(last_with_leftmost.values())


def tree_edit_distance(a, b, insert: Callable, remove: Callable, update: Callable) -> float:
    """The cost of editing tree ``a`` into tree ``b`` (``insert(node)``, ``remove(node)``,
    ``update(node_a, node_b)``)."""
    a_nodes, a_left, a_keys = _postorder(a)
    b_nodes, b_left, b_keys = _postorder(b)
    tree_dist = [[0.0] * len(b_nodes) for _ in a_nodes]
    for i in a_keys:
        for j in b_keys:
            _forest(i, j, a_nodes, a_left, b_nodes, b_left, tree_dist, insert, remove, update)
    return tree_dist[-1][-1]


def _forest(i, j, a_nodes, a_left, b_nodes, b_left, tree_dist, insert, remove, update) -> None:
    """Distances between the forests ending at key roots ``i`` and ``j``; fills ``tree_dist`` for
    every pair of subtrees whose leftmost leaves are those of ``i`` and ``j``."""
    a0, b0 = a_left[i] - 1, b_left[j] - 1  # forest row x is a's node a0 + x
    rows, cols = i - a0 + 1, j - b0 + 1
    dist = [[0.0] * cols for _ in range(rows)]
    for x in range(1, rows):
        dist[x][0] = dist[x - 1][0] + remove(a_nodes[a0 + x])
    for y in range(1, cols):
        dist[0][y] = dist[0][y - 1] + insert(b_nodes[b0 + y])
    for x in range(1, rows):
        for y in range(1, cols):
            u, v = a0 + x, b0 + y
            by_edit = min(dist[x - 1][y] + remove(a_nodes[u]), dist[x][y - 1] + insert(b_nodes[v]))
            if a_left[u] == a_left[i] and b_left[v] == b_left[j]:  # both are whole trees: relabel the roots
                dist[x][y] = min(by_edit, dist[x - 1][y - 1] + update(a_nodes[u], b_nodes[v]))
                tree_dist[u][v] = dist[x][y]
            else:  # a forest and a tree of it: reuse the subtree distance found earlier
                dist[x][y] = min(by_edit, dist[a_left[u] - 1 - a0][b_left[v] - 1 - b0] + tree_dist[u][v])
