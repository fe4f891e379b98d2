"""What the sampling kernels' tests check a draw's distribution with: Pearson's chi-square against
known probabilities."""

import torch

CHI_SQUARE_999 = {3: 16.27, 7: 24.32}
"""The chi-square distribution's 99.9th percentile by degrees of freedom: a correct sampler fails a
fixed-seed test at most 1 time in 1000 seeds, a wrong distribution (any bias over ~1%) nearly always."""
PROBS = torch.tensor([0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.04, 0.01])
"""A softmax(logits) over a vocabulary of 8, with no token rare enough to starve its bin."""


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of the drawn tokens against the expected probabilities (all > 0)."""
    counts = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def tempered(probs: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(log(probs) / T): what a draw at temperature T follows."""
    return torch.softmax(probs.log() / temperature, dim=-1)
