"""Memory-saving strategies, each in its own module, applied in one fixed order (see apply_model_strategies)."""
from __future__ import annotations

import torch

from memfit.config import Config
from memfit.strategies.checkpoint import apply_checkpointing
from memfit.strategies.precision import autocast_context, cast_inputs, cast_model, make_grad_scaler

__all__ = ["apply_model_strategies", "autocast_context", "cast_inputs", "make_grad_scaler"]


def apply_model_strategies(model: torch.nn.Module, config: Config, device: torch.device) -> torch.nn.Module:
    """The fixed order: 1. precision of the weights, 2. activation checkpointing of repeated blocks."""
    model = cast_model(model, config)
    model = apply_checkpointing(model, config)
    return model
