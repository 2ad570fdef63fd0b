"""Chunked cross-entropy, the part of the workload contract a language model's loss uses so that a step can
compute it in pieces (`Config.loss_chunks`).

A large vocabulary makes the loss the largest tensor of a step: Llama-3's 128,256 logits for 2 x 2048 tokens
are 2 GiB in bf16, twice that upcast to fp32, and the softmax saved for backward as much again. In chunks of
tokens, each chunk's logits are made, reduced to a loss and dropped; backward makes them again, one chunk at
a time (`torch.utils.checkpoint`). The math is the plain loss's (a sum of per-chunk sums over the same
tokens), for one more forward pass of the head.

A workload's loss opts in by calling `chunked_cross_entropy` when `loss_chunks()` is above 1 (memfit's GPT
and transformers' causal LMs do). The head's forward is skipped while the model runs, so the whole logits are
never made; the model must hand the head's output on untouched as its logits, which is checked.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import torch
import torch.nn.functional as F

from memfit.errors import LossChunkError

_state = threading.local()


@contextlib.contextmanager
def chunking(chunks: int):
    """The step's request: compute the loss in `chunks` pieces (1: whole)."""
    previous = getattr(_state, "chunks", 1), getattr(_state, "used", False)
    _state.chunks, _state.used = chunks, False
    try:
        yield
    finally:
        _state.chunks, _state.used = previous


def loss_chunks() -> int:
    """How many pieces the running step wants the loss in; a loss that can chunk asks this first."""
    return getattr(_state, "chunks", 1)


def chunked_used() -> bool:
    """Whether the loss just run went through `chunked_cross_entropy` (the step refuses chunks it ignored)."""
    return getattr(_state, "used", False)


def chunked_cross_entropy(run: Callable[[], Any], head: torch.nn.Module, labels: torch.Tensor, *,
                          logits: Callable[[Any], torch.Tensor] = lambda out: out, shift: bool = False,
                          ignore_index: int = -100) -> torch.Tensor:
    """Mean cross entropy, over the tokens whose label is not `ignore_index`, of the logits `head` makes
    inside `run()`, upcast to fp32, in `loss_chunks()` pieces of tokens.

    Args:
        run: runs the model's forward (without computing its own loss).
        head: the module whose output are the logits (``model.get_output_embeddings()``).
        labels: one per position; ``shift=True``: the labels are the input ids and position t predicts t+1
            (transformers' causal-LM convention: the last position predicts nothing).
        logits: where the logits are in run()'s output (``lambda out: out.logits`` for transformers).
    """
    placeholder: dict = {"calls": 0}

    def skipped(hidden: torch.Tensor) -> torch.Tensor:
        placeholder["calls"] += 1  # a head also used elsewhere (tied to the input embedding module) is refused
        placeholder["hidden"] = hidden
        # the logits' shape, no memory: every element is the same zero
        placeholder["out"] = hidden.new_zeros(()).expand(*hidden.shape[:-1], head.weight.shape[0])
        return placeholder["out"]

    head.forward = skipped  # an instance attribute: Module.__call__ finds it before the class's forward
    try:
        out = run()
    finally:
        del head.forward
    if placeholder["calls"] != 1 or logits(out) is not placeholder["out"]:
        raise LossChunkError(f"the loss cannot be chunked: {type(head).__name__} is not used once to make the "
                             "logits, or the model changes them after it (scales, caps or slices them)")
    hidden = placeholder["hidden"]
    if shift:
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    tokens = hidden.flatten(0, -2)
    targets = labels.reshape(-1)
    chunks = loss_chunks()
    total = sum(torch.utils.checkpoint.checkpoint(_chunk_loss, head, h, t, ignore_index, use_reentrant=False,
                                                  preserve_rng_state=False)  # no randomness to replay
                for h, t in zip(tokens.tensor_split(chunks), targets.tensor_split(chunks)))
    _state.used = True
    return total / (targets != ignore_index).sum()


def _chunk_loss(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, ignore_index: int):
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum", ignore_index=ignore_index)
