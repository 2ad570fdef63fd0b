"""One optimizer step over one global batch: the only place memfit's training math lives.

The estimator traces exactly this code on fake tensors and the trainer runs it on real ones, so what is
estimated is what runs. Read `TrainStep.__call__` top to bottom to follow a step.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from memfit.config import Config
from memfit.errors import ConfigError, LossChunkError, WorkloadError
from memfit.losses import chunked_used, chunking
from memfit.strategies import (ActivationOffload, OptimizerInBackward, OptimizerOffload, apply_model_strategies,
                               autocast_context,
                               cast_inputs, check_precision, data_parallel_buffers, eight_bit, host_side,
                               make_grad_scaler, op_policy, paged)
from memfit.strategies.cuda_kernels import kernels as cuda_kernels
from memfit.strategies.pipeline_parallel import Pipeline
from memfit.torch_internals import grad_scaler_tensors
from memfit.workload import Batch, Workload, batch_size, move_batch, split_batch


class TrainStep:
    """Builds the model and optimizer for `config` on `device` and performs optimizer steps.

    `on_phase` is told "forward", "backward" and "optimizer" as the step enters each (the tracer uses it);
    `move` carries a micro-batch to the device (the tracer swaps it to model a host-to-GPU copy);
    `cuda_target`: the step runs on the CPU to stand for a CUDA one, so autocast follows CUDA's op policy
    and dropout and attention keep what CUDA's kernels keep (strategies/cuda_kernels.py).
    """

    def __init__(self, workload: Workload, config: Config, device: torch.device | str = "cpu",
                 on_phase: Callable[[str], None] | None = None,
                 move: Callable[[Batch, torch.device], Batch] = move_batch, cuda_target: bool = False):
        self.workload, self.config, self.device = workload, config, torch.device(device)
        self.cuda_target = cuda_target
        if self.device.type == "cuda":
            check_precision(config, torch.cuda.get_device_name(self.device), torch.cuda.is_bf16_supported())
        # a 4-bit base is quantized layer by layer on its way to the GPU (strategies/base_4bit.py)
        with torch.device("cpu") if config.base_4bit and self.device.type == "cuda" else self.device:
            model = workload.model()
        if not isinstance(model, torch.nn.Module):
            raise WorkloadError(f"workload.model() returned {type(model).__name__}, not an nn.Module")
        # a pipeline stage keeps its part of the model in place (strategies/pipeline_parallel.py), cut before
        # the other strategies so that FSDP shards only what the stage holds
        self.pipeline = Pipeline(model, workload.loss, config, self.device) if config.pp > 1 else None
        self.model = apply_model_strategies(model, config, self.device,
                                            blocks=self.pipeline.kept if self.pipeline else None)
        if self.pipeline is not None:
            self.pipeline.attach()
        self.activation_offload = ActivationOffload(self.model, self.device) if config.offload_activations else None
        self.optimizer_offload = None
        make_optimizer = (workload.optimizer if not config.optimizer_8bit else
                          paged(workload.optimizer) if config.paged_optimizer else eight_bit(workload.optimizer))
        if config.offload_optimizer:
            self.optimizer_offload = OptimizerOffload(self.model, make_optimizer, self.device)
            self.optimizer = self.optimizer_offload.optimizer
        else:
            self.optimizer = make_optimizer(self.model.parameters())
        if config.optimizer_in_backward and workload.max_grad_norm is not None:
            raise ConfigError("optimizer_in_backward updates each parameter as soon as its gradient is ready; "
                              "clipping by the gradients' total norm (max_grad_norm) needs all of them first")
        self.in_backward = OptimizerInBackward(self.model, self.optimizer) if config.optimizer_in_backward else None
        self.scaler = make_grad_scaler(config, self.device)
        self.on_phase = on_phase or (lambda phase: None)
        self.move = move
        self.tracing = False  # True under fake tensors: no data-dependent control flow (`.item()`)
        self.phase = "idle"  # where the current step is: forward | backward | optimizer (OOM recovery asks)
        self.skipped_steps = 0  # fp16 steps dropped because the gradients overflowed
        self.ungraded: list[torch.Tensor] = []  # traced: trainable parameters the last step gave no gradient
        self.grad_norm: torch.Tensor | None = None  # the last step's total gradient norm, before clipping

    def __call__(self, batch: Batch) -> torch.Tensor:
        """Zero grads -> forward/backward per micro-batch (loss weighted by its share of the global batch)
        -> one optimizer step. Returns the global batch's mean loss (a detached tensor)."""
        cfg, model, opt = self.config, self.model, self.optimizer
        for mover in self._movers():
            mover.moved_bytes = 0
        opt.zero_grad(set_to_none=True)
        if self.in_backward is not None:
            self.in_backward.updated = 0
        total = batch_size(batch)
        loss_sum = torch.zeros((), device=self.device)
        # backward too: checkpointing recomputes the forward (under autocast)
        with op_policy(cfg, self.cuda_target), cuda_kernels(self.cuda_target):
            if self.pipeline is not None:
                loss_sum = self._pipeline_step(batch)
            for micro in split_batch(batch, cfg.micro_batch) if self.pipeline is None else ():
                micro = cast_inputs(self.move(micro, self.device), cfg)
                weight = batch_size(micro) / total  # mean over the global batch, uneven last chunk included
                self._enter("forward")
                with autocast_context(cfg, self.device, self.cuda_target), self._offload_hooks(), \
                        chunking(cfg.loss_chunks):
                    loss = self.workload.loss(model, micro)
                    if cfg.loss_chunks > 1 and not chunked_used():
                        raise LossChunkError(f"loss_chunks={cfg.loss_chunks}: {self.workload.name}'s loss does not "
                                             "compute its cross-entropy with memfit.losses.chunked_cross_entropy")
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise WorkloadError("workload.loss(model, batch) must return a scalar tensor")
                if not loss.requires_grad:
                    raise WorkloadError(_NOT_TRAINING)
                self._enter("backward")
                scaled = loss.float() * weight
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
                loss_sum += loss.detach().float() * weight
                del micro, loss, scaled
        self._enter("optimizer")
        if self.tracing and self.in_backward is None and self.optimizer_offload is None and cfg.gpus == 1:
            self.ungraded = [p for p in model.parameters() if p.requires_grad and p.grad is None]
        self.optimizer_step()
        self.phase = "idle"
        if (self.config.gpus > 1 or self.pipeline is not None) and not self.tracing:
            # the global batch's mean: every data-parallel rank holds an equal share, and in a pipeline only the
            # last stage has a loss (the others add zero), and the tp ranks of a group hold the same one (gloo has
            # no AVG)
            torch.distributed.all_reduce(loss_sum)
            loss_sum /= self.config.gpus * self.config.tp
        return loss_sum

    def _pipeline_step(self, batch: Batch) -> torch.Tensor:
        """Every micro-batch's forward and backward under the pipeline's schedule, the batch moved to the
        device whole (every stage reads its micro-batches' labels or inputs from it)."""
        stage = self.pipeline.module
        stage.on_forward, stage.on_backward = (lambda: self._enter("forward")), (lambda: self._enter("backward"))
        batch = cast_inputs(self.move(batch, self.device), self.config)
        self._enter("forward")
        with autocast_context(self.config, self.device, self.cuda_target):
            return self.pipeline.step(batch, self.config.micro_batch)

    def _enter(self, phase: str) -> None:
        self.phase = phase
        self.on_phase(phase)

    def prime(self) -> None:
        """Leave behind what a first step leaves (optimizer state, loss scale, gradients) without a forward
        or backward pass: zero gradients, one optimizer step. The estimator's steady state, at a fraction
        of the cost of a real first step."""
        params = list({id(p): p for p in self.model.parameters() if p.requires_grad}.values())
        with torch.no_grad():
            if self.optimizer_offload is not None:
                with host_side():
                    for m in self.optimizer_offload.master:
                        m.grad = torch.zeros_like(m)
            else:
                sparse = _sparse_gradients(self.model)
                for p in params:
                    p.grad = _empty_sparse(p) if id(p) in sparse else torch.zeros_like(p)
            if self.scaler is not None:
                self.scaler.scale(torch.zeros((), device=self.device))  # creates the scale tensor
            tracing, self.tracing = self.tracing, True  # zero gradients cannot overflow: no host sync needed
            try:
                self.optimizer_step()
            finally:
                self.tracing = tracing
            if self.in_backward is not None:  # its steps leave no gradients behind
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)

    @property
    def moved_bytes(self) -> int:
        """Bytes copied between host and device by offloading during the last step."""
        return sum(m.moved_bytes for m in self._movers())

    def _movers(self) -> list:
        """What copies between host and device in a step: offloading, paged optimizer states."""
        paged_states = self.optimizer if self.config.paged_optimizer else None
        return [m for m in (self.activation_offload, self.optimizer_offload, paged_states) if m is not None]

    def state_tensors(self) -> list[torch.Tensor]:
        """Everything the step keeps between steps: parameters, buffers, gradients, optimizer and loss-scale
        state, offloaded masters, a traced DDP's gradient buckets. A live-bytes counter started between steps
        begins from these."""
        out = list(self.model.parameters()) + list(self.model.buffers())
        out += [p.grad for p in self.model.parameters() if p.grad is not None] + self.host_tensors()
        out += data_parallel_buffers(self.model)
        for state in self.optimizer.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        if self.scaler is not None:
            out += grad_scaler_tensors(self.scaler)
        if self.grad_norm is not None:
            out.append(self.grad_norm)
        return out

    def host_tensors(self) -> list[torch.Tensor]:
        """What lives in host memory between steps: offloaded masters and state, paged optimizer states."""
        holder = self.optimizer_offload or (self.optimizer if self.config.paged_optimizer else None)
        return holder.host_tensors() if holder is not None else []

    def kept_gradients(self) -> list[torch.Tensor]:
        """The gradients each micro-step after the first adds its own into: the host's fp32 copies under
        optimizer offload, else the parameters' own (none with the optimizer step in backward)."""
        if self.in_backward is not None:
            return []
        held = self.optimizer_offload.master if self.optimizer_offload is not None else self.model.parameters()
        return [g for g in {id(p): p.grad for p in held}.values() if g is not None and not g.is_sparse]

    def _offload_hooks(self):
        return self.activation_offload.hooks() if self.activation_offload else contextlib.nullcontext()

    def optimizer_step(self) -> None:
        """The optimizer phase of a step, on the gradients there are (clipping, loss scale, offload included):
        the planner also traces it alone, after `prime`, to price a family's update without a whole step."""
        opt, scaler = self.optimizer, self.scaler
        if self.in_backward is not None:  # each parameter was updated in backward (during prime: see there)
            return
        if self.optimizer_offload is not None:  # Config forbids fp16 here: no scaler to consult
            self.optimizer_offload.step(before=self._clip)
        elif scaler is None:
            self._clip()
            opt.step()
        elif self.tracing:  # same memory as scaler.step, without the host sync that fake tensors cannot do
            scaler.unscale_(opt)
            self._clip()
            opt.step()
            scaler.update()
        else:
            before = scaler.get_scale()
            if self.workload.max_grad_norm is not None:  # clipped in true units; scaler.step then skips unscaling
                scaler.unscale_(opt)
                self._clip()
            scaler.step(opt)
            scaler.update()
            self.skipped_steps += scaler.get_scale() < before

    def _clip(self) -> None:
        """Scale the gradients the optimizer is about to read so that their total L2 norm is at most the
        workload's max_grad_norm. FSDP's gradients are shards (DTensor): torch reduces their norms across
        ranks, so every rank scales by the global norm, as one process would (a rank's own shards' norm would
        not). An overflowed fp16 step gets a non-finite norm, and GradScaler skips that step."""
        if self.workload.max_grad_norm is None:
            return
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if hasattr(norm, "full_tensor"):  # a replicated DTensor: the plain tensor every rank holds
            norm = norm.full_tensor()
        if self.pipeline is not None:  # each stage holds its own blocks' gradients
            norm = self.pipeline.total_norm(norm)
        torch.nn.utils.clip_grads_with_norm_(params, self.workload.max_grad_norm, norm)
        self.grad_norm = norm


_NOT_TRAINING = (
    "workload.loss(model, batch) returned a loss that does not require grad (computed under torch.no_grad() or "
    "inference_mode, or with every parameter frozen): memfit's step trains (forward, backward, optimizer step); "
    "it does not estimate generation or evaluation, and inference memory (KV cache, serving) is not supported yet")


def _sparse_gradients(model: torch.nn.Module) -> set[int]:
    """ids of the parameters whose gradients are sparse: the weights of embeddings made with sparse=True."""
    return {id(m.weight) for m in model.modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}


def _empty_sparse(p: torch.Tensor) -> torch.Tensor:
    """A sparse zero gradient for `p`, holding no rows. A dense one, as other parameters get, would count a
    table-sized gradient no step holds and make optimizer state of the wrong kind (SparseAdam refuses it)."""
    indices = torch.empty(1, 0, dtype=torch.long, device=p.device)
    return torch.sparse_coo_tensor(indices, p.new_empty(0, *p.shape[1:]), p.shape, check_invariants=True)
