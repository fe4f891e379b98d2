"""Integer arithmetic shared by every layer. Standard library only and importing nothing, so that any
layer may import it without bending the layering (ARCHITECTURE.md section 2)."""

from __future__ import annotations


def cdiv(numerator: int, denominator: int) -> int:
    """The ceiling of numerator / denominator for denominator > 0: blocks for a number of tokens,
    programs for a number of rows. Exact on ints of any size (no float round trip)."""
    return -(-numerator // denominator)
