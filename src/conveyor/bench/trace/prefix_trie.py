"""A trie over prompt units (words, or Mooncake's block hash ids) that says what each prompt shares.

Every prompt is inserted as its sequence of units; a node counts the prompts passing through it. A
prompt's shared prefix is its path down to the deepest node at least two prompts pass through: exactly
the leading units it has in common with some other prompt. Node ids name prefixes (prefix_group).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


class PrefixTrie:
    """Trie over units; node 0 is the root."""

    def __init__(self) -> None:
        self.children: list[dict[Hashable, int]] = [{}]
        self.count: list[int] = [0]

    def insert(self, units: Sequence[Hashable]) -> list[int]:
        """Add one prompt; returns the node of each of its units."""
        node, path = 0, []
        for u in units:
            nxt = self.children[node].get(u)
            if nxt is None:
                nxt = len(self.children)
                self.children[node][u] = nxt
                self.children.append({})
                self.count.append(0)
            self.count[nxt] += 1
            path.append(nxt)
            node = nxt
        return path


def shared_prefix(trie: PrefixTrie, path: list[int]) -> int:
    """Units of the path shared with at least one other inserted prompt."""
    return max((d + 1 for d, node in enumerate(path) if trie.count[node] >= 2), default=0)
