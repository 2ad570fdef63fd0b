"""Memory-saving strategies, each in its own module.

Order: 4-bit base weights replace the frozen Linear layers (QLoRA), precision casts the weights, tensor parallelism
splits the blocks' matmuls, checkpointing wraps the repeated blocks, then data parallelism shards them across
ranks (apply_model_strategies);
TrainStep then builds the optimizer (with 8-bit moments, paged from the host, when asked), puts optimizer offload (or the optimizer
step in backward) around the optimizer and activation offload around each forward;
accumulation and loss scaling are the step's own loop (memfit/step.py).
"""
from __future__ import annotations

import torch

from memfit.config import Config
from memfit.strategies.activation_checkpoint import apply_checkpointing, chosen_blocks, replay_model_checkpointing
from memfit.strategies.base_4bit import apply_base_4bit, check_base_4bit
from memfit.strategies.data_parallel import apply_data_parallel, data_parallel_buffers
from memfit.strategies.offload import ActivationOffload, OptimizerOffload, host_side, on_host_side
from memfit.strategies.optimizer_8bit import eight_bit
from memfit.strategies.optimizer_in_backward import OptimizerInBackward
from memfit.strategies.paged_optimizer import paged
from memfit.strategies.precision import (autocast_context, cast_inputs, cast_model, check_precision, make_grad_scaler,
                                         op_policy)
from memfit.strategies.tensor_parallel import apply_tensor_parallel
from memfit.torch_internals import keep_tensors_on_unchanged_conversion

__all__ = ["ActivationOffload", "OptimizerInBackward", "OptimizerOffload", "apply_model_strategies", "autocast_context",
           "cast_inputs", "check_precision", "data_parallel_buffers", "eight_bit", "host_side", "make_grad_scaler",
           "on_host_side", "op_policy", "paged"]


def apply_model_strategies(model: torch.nn.Module, config: Config, device: torch.device,
                           blocks: list[str] | None = None) -> torch.nn.Module:
    """The fixed order: 1. 4-bit base weights, 2. precision of the weights, 3. tensor parallelism (torchtitan splits
    before it checkpoints and shards; cast after splitting, a bf16-pure embedding kept fp32 state beside a bf16
    gradient and AdamW refused it on real ranks), 4. activation checkpointing of repeated blocks (memfit's, and the model's
    own made to replay as memfit's does), 5. data parallelism. Everything that can fail is resolved first, so a
    bad configuration leaves the model untouched."""
    units = blocks  # a pipeline stage's own blocks, named for it (strategies/pipeline_parallel.py)
    blocks = chosen_blocks(model, config.activation_checkpoint, units)
    if config.base_4bit:
        apply_base_4bit(model, check_base_4bit(model), config.precision, device)
    model = cast_model(model, config)
    model = apply_tensor_parallel(model, config, device, units)
    model = apply_checkpointing(replay_model_checkpointing(model), blocks,
                                selective=config.activation_checkpoint)
    model = apply_data_parallel(model, config, device, units)
    keep_tensors_on_unchanged_conversion(model)  # a fake model's `.to()` in its forward
    return model
