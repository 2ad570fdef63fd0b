"""How far apart two float computations of the same value may honestly be (a helper, not a test module).

Two evaluations of the same sum differ when their terms are added in another order: another micro-batch
split, another thread count, another processor whose kernels block a reduction differently. A sum of n
terms, added in any order, has a rounding error of at most γ(n)·Σ|xᵢ|, with γ(n) = n·u / (1 − n·u) and
u = eps/2 the dtype's unit roundoff (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
§4.2). Two orders are therefore at most 2·γ(n)·Σ|xᵢ| ≈ n·eps·Σ|xᵢ| apart.

Σ|xᵢ| of each element is not at hand, so `magnitude` stands in for it: the largest entry of the reference
result. That ignores what cancellation hides, but the worst-case n·eps is itself √n above what rounding
really accumulates (errors of independent roundings grow like a random walk, √n·u·Σ|xᵢ|: Higham & Mary,
SIAM J. Sci. Comput. 41(5), 2019), and terms of random sign sum to about Σ|xᵢ|/√n: the two √n cancel.

`terms` counts the additions a value's error passes through: the reduction that the two computations order
differently, plus the reductions inside each term that another kernel may block differently. The tolerance
depends on the dtype and those counts only, never on what one machine happened to produce.

What never goes through a reordered sum -- the same elementwise kernels on the same values -- is compared
bit for bit instead: there, any difference is a change in the math.
"""
from __future__ import annotations

import torch


def sum_tolerance(dtype: torch.dtype, terms: int, magnitude: float) -> float:
    """Largest honest difference between two evaluations of a sum of `terms` terms whose result is of
    size `magnitude`, in `dtype` (the derivation is in this module's docstring)."""
    return terms * torch.finfo(dtype).eps * magnitude


def gradient_terms(tokens: int, layers: int, seq: int, width: int, ffn: int, vocab: int) -> int:
    """Additions behind one gradient entry of a decoder-only transformer over `tokens` tokens: the sum over
    tokens that every weight gradient is, plus, per block, the reductions over the sequence (attention),
    the width (projections, norms) and ffn (the MLP), and the softmax over the vocabulary."""
    return tokens + layers * (seq + width + ffn) + vocab


def gpt_gradient_terms(cfg, tokens: int) -> int:
    """`gradient_terms` of a memfit GPT (`memfit.workloads.gpt.GPT.cfg`)."""
    return gradient_terms(tokens, cfg.layers, cfg.seq, cfg.d_model, cfg.ffn, cfg.vocab)
