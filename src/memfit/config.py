"""`Config`: every knob memfit turns for one training run, and nothing else."""
from __future__ import annotations

import dataclasses
import json
import warnings

from memfit.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16", "bf16-pure")
LAYOUTS = ("none", "ddp", "fsdp", "fsdp-no-reshard", "hsdp")
# torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
LOOPED_SCHEDULES = ("interleaved-1f1b", "zero-bubble")  # several stages a rank: r, r + pp, r + 2 pp, ...
MAX_GPUS = 4096


@dataclasses.dataclass(frozen=True)
class Config:
    """How one optimizer step is executed. Frozen: a run that changes its configuration (OOM recovery)
    makes a new one with `replace`.

    Args:
        micro_batch: samples per forward/backward pass.
        precision: ``fp32``; ``bf16`` (bf16 autocast, fp32 weights); ``fp16`` (fp16 autocast and dynamic
            loss scaling); ``bf16-pure`` (bf16 weights, gradients and optimizer state, no fp32 master copy:
            8 bytes a parameter with AdamW instead of 16, and numerically weaker; with ``offload_optimizer``
            the master weights and optimizer state are fp32 on the host, only the GPU's copy is bf16).
        grad_accum: micro-steps per optimizer step; the global batch is ``micro_batch * grad_accum``.
        activation_checkpoint: which blocks drop their activations after forward and recompute them in
            backward: ``"none"``, ``"all"`` repeated blocks, ``"selective"`` (every block, but the outputs
            of matmuls and attention are kept), ``"selective-op"`` (torchtitan's op-level selective
            checkpointing: attention's outputs and every second matmul's kept), an integer k (every k-th block)
            or a tuple of module names.
        offload_activations: saved activations live in host memory between forward and backward.
        offload_optimizer: fp32 master weights, optimizer state and the optimizer step live on the host
            (ZeRO-Offload's idea).
        optimizer_in_backward: each parameter is updated, and its gradient freed, as soon as backward has
            produced it: the step never holds all gradients. Same math as the step after backward for
            per-parameter optimizers (SGD, Adam, AdamW, ...); needs grad_accum 1 and no fp16 loss scaling.
        loss_chunks: the loss computed in this many pieces of tokens, each chunk's logits made again in
            backward (memfit/losses.py): same math, most of a large vocabulary's logits never held; for losses
            written with `memfit.losses.chunked_cross_entropy` (memfit's GPT, transformers' causal LMs).
        optimizer_8bit: Adam's two moments in 8 bits a value, block-wise scaled (2 bytes a parameter instead
            of 8; strategies/optimizer_8bit.py). Changes the math: the planner offers it only when allowed.
        paged_optimizer: the 8-bit moments kept in host memory, each parameter's copied to the device for its
            own update only (bitsandbytes' paged 8-bit AdamW under memory pressure; strategies/paged_optimizer.py):
            the device holds one parameter's state at a time. Needs ``optimizer_8bit``; one GPU.
        base_4bit: the frozen Linear layers' weights stored in 4-bit NF4 with double quantization (QLoRA's
            base; 0.52 bytes a weight; strategies/base_4bit.py), for a LoRA workload. Changes the math: the
            planner offers it only when allowed.
        gpus: data-parallel ranks, each a group of ``pp * tp`` ranks (its pipeline stages and tensor-parallel
            ranks) when those are set; each runs ``micro_batch * grad_accum`` samples a step.
        data_parallel: how the ranks hold the model: ``"none"`` (one rank); ``"ddp"`` (DistributedDataParallel:
            every rank holds all of it; its gradients live in DDP's buckets (``gradient_as_bucket_view``),
            all-reduced after every micro-batch's backward, which keeps no second copy of them during
            accumulation); ``"fsdp"`` (FSDP2 ``fully_shard`` of each repeated block and the
            root, parameters resharded after forward: ZeRO-3); ``"fsdp-no-reshard"`` (kept unsharded from
            forward to backward: ZeRO-2-like); ``"hsdp"`` (sharded within a node, replicated across nodes).
            Under FSDP/HSDP, ``bf16`` is FSDP2's ``MixedPrecisionPolicy``: bf16 parameters for compute, fp32
            sharded master weights and fp32 gradient reduction (as torchtitan trains), not autocast.
        gpus_per_node: ranks per node (the shard group of ``hsdp``); None: all of them on one node.
        pp: pipeline stages: the repeated blocks split evenly over ``pp`` ranks, each micro-batch's
            activations sent from stage to stage (torch.distributed.pipelining). The ``grad_accum``
            micro-batches of a step are the pipeline's micro-batches; the world is ``gpus * pp * tp`` ranks
            (``gpus`` stays the data-parallel count).
        pp_schedule: the order a stage runs its micro-batches' forwards and backwards: ``"gpipe"`` (every
            forward, then every backward: a stage holds all ``grad_accum`` micro-batches' activations) or
            ``"1f1b"`` (one forward, one backward once the pipeline is full: at most ``pp - stage`` held);
            ``"interleaved-1f1b"`` (Narayanan et al. 2021: ``pp_virtual`` stages a rank, a smaller bubble for
            more micro-batches in flight on the first ranks) or ``"zero-bubble"`` (torch's interleaved ZB1P,
            Qi et al. 2024: each backward split into its input half and a later weight half that fills the bubble).
        pp_virtual: stages a rank holds under the interleaved schedules (the looped placement: rank r holds
            stages r, r + pp, ...): the blocks split over ``pp * pp_virtual`` stages. None: 2 for those, 1 else.
        tp: tensor-parallel ranks: each block's attention and MLP matmuls split over ``tp`` ranks
            (DTensor's ``parallelize_module``). Beside ``fsdp`` or ``fsdp-no-reshard`` the ranks form a 2-D mesh,
            ``gpus`` x ``tp`` (torchtitan's layout: TP inside a group of ``tp`` neighbouring ranks, FSDP2 across
            the groups); the ``tp`` ranks of a group train on the same rows.

    Example::

        cfg = Config(micro_batch=4, grad_accum=8, precision="bf16", activation_checkpoint="all")
        cfg.global_batch   # 32
        Config.from_json(cfg.to_json()) == cfg
    """

    micro_batch: int = 1
    precision: str = "fp32"
    grad_accum: int = 1
    activation_checkpoint: str | int | tuple[str, ...] = "none"
    offload_activations: bool = False
    offload_optimizer: bool = False
    optimizer_in_backward: bool = False
    optimizer_8bit: bool = False
    paged_optimizer: bool = False
    base_4bit: bool = False
    loss_chunks: int = 1
    gpus: int = 1
    data_parallel: str = "none"
    gpus_per_node: int | None = None
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual: int | None = None
    tp: int = 1

    def __post_init__(self):
        if not isinstance(self.micro_batch, int) or self.micro_batch < 1:
            raise ConfigError(f"micro_batch must be an integer >= 1, got {self.micro_batch!r}")
        if not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ConfigError(f"grad_accum must be an integer >= 1, got {self.grad_accum!r}")
        if not isinstance(self.loss_chunks, int) or isinstance(self.loss_chunks, bool) or self.loss_chunks < 1:
            raise ConfigError(f"loss_chunks must be an integer >= 1, got {self.loss_chunks!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.offload_optimizer and self.precision == "fp16":
            raise ConfigError("fp16 loss scaling with offload_optimizer is not supported: use bf16 or bf16-pure")
        self._check_layout()
        self._check_model_parallel()
        self._check_in_backward()
        self._check_paged()
        ck = self.activation_checkpoint
        if isinstance(ck, list):
            object.__setattr__(self, "activation_checkpoint", tuple(ck))
        elif isinstance(ck, bool) or not (
            ck in ("none", "all", "selective", "selective-op") or (isinstance(ck, int) and ck >= 1)
            or isinstance(ck, tuple)
        ):
            raise ConfigError(
                "activation_checkpoint must be 'none', 'all', 'selective', 'selective-op', an integer k >= 1 or a list "
                f"of module names, got {ck!r}"
            )

    def _check_in_backward(self) -> None:
        if not self.optimizer_in_backward:
            return
        why = ("accumulation over micro-batches needs the gradients kept: use grad_accum 1" if self.grad_accum > 1
               else "fp16 loss scaling checks every gradient for overflow before any update: use bf16"
               if self.precision == "fp16" else
               "optimizer offload already streams each gradient to the host" if self.offload_optimizer else
               "not built across ranks yet" if self.gpus > 1 else None)
        if why:
            raise ConfigError(f"optimizer_in_backward updates each parameter as soon as its gradient is ready; {why}")

    def _check_paged(self) -> None:
        if not self.paged_optimizer:
            return
        why = ("paging is built for the 8-bit states (bitsandbytes' paged 8-bit AdamW): set optimizer_8bit too"
               if not self.optimizer_8bit else
               "optimizer offload already keeps the states on the host, and steps there" if self.offload_optimizer
               else "not built across ranks yet" if self.gpus > 1 else None)
        if why:
            raise ConfigError(f"paged_optimizer keeps the optimizer states on the host between updates; {why}")

    def _check_layout(self) -> None:
        n, layout, per_node = self.gpus, self.data_parallel, self.gpus_per_node
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_GPUS:
            raise ConfigError(f"gpus must be an integer from 1 to {MAX_GPUS}, got {n!r}")
        if layout not in LAYOUTS:
            raise ConfigError(f"unknown data-parallel layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
        if (n > 1) != (layout != "none"):
            raise ConfigError(f"{n} GPU(s) with data_parallel={layout!r}: use 'none' for one GPU and a layout "
                              "(ddp, fsdp, fsdp-no-reshard, hsdp) for more")
        if per_node is not None and (not isinstance(per_node, int) or isinstance(per_node, bool) or per_node < 1):
            raise ConfigError(f"gpus_per_node must be an integer >= 1, got {per_node!r}")
        if layout == "hsdp" and (per_node is None or n % per_node or n == per_node):
            raise ConfigError(f"hsdp shards within a node and replicates across nodes: gpus ({n}) must be a "
                              f"multiple of gpus_per_node ({per_node}) spanning two or more nodes")
        if layout != "none" and self.precision == "fp16":
            raise ConfigError("fp16 loss scaling across ranks is not supported yet: use bf16 with data_parallel")
        if layout != "none" and (self.offload_optimizer or self.offload_activations):
            raise ConfigError("offload with data_parallel is not supported yet")

    def _check_model_parallel(self) -> None:
        for name in ("pp", "tp"):
            n = getattr(self, name)
            if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_GPUS:
                raise ConfigError(f"{name} must be an integer from 1 to {MAX_GPUS}, got {n!r}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"unknown pipeline schedule {self.pp_schedule!r}; choose one of {', '.join(PP_SCHEDULES)}")
        self._check_virtual()
        if self.pp == 1 and self.tp == 1:
            return
        what = "pipeline" if self.pp > 1 else "tensor"
        if self.pp > 1 and self.grad_accum < self.pp:
            raise ConfigError(f"{self.pp} pipeline stages need at least {self.pp} micro-batches a step to keep every "
                              f"stage busy: grad_accum is {self.grad_accum}")
        rounds = max(1, self.grad_accum // self.pp)  # torch's interleaved schedules run the micro-batches in rounds
        if self.pp > 1 and self.pp_schedule in LOOPED_SCHEDULES and self.grad_accum % rounds:
            raise ConfigError(f"{self.pp_schedule} runs micro-batches in rounds of about {self.pp} (torch's "
                              f"max(1, n // pp) = {rounds} rounds, n a multiple of them): grad_accum {self.grad_accum} "
                              f"is not; a multiple of {self.pp} is")
        for on, words in ((self.offload_optimizer or self.offload_activations, "offload"),
                          (self.optimizer_in_backward, "optimizer_in_backward"),
                          (self.optimizer_8bit or self.base_4bit, "8-bit optimizer states and 4-bit bases"),
                          (self.loss_chunks > 1, "loss_chunks"), (self.precision == "fp16", "fp16 loss scaling"),
                          (self.gpus > 1 and self.data_parallel not in ("fsdp", "fsdp-no-reshard"),
                           f"{self.data_parallel} data parallel beside it (fsdp and fsdp-no-reshard are)"),
                          # torch's weight-gradient pass (stage_backward_weight) looks up each parameter's
                          # AccumulateGrad node, which FSDP2's unsharded parameters are not: KeyError on every rank
                          (self.pp_schedule == "zero-bubble" and self.gpus > 1,
                           "fsdp data parallel beside zero-bubble"),
                          # torch's input-gradient pass (stage_backward_input) fails on the blocks' DTensor
                          # activations: every rank raises "Failed to run stage backward input"
                          (self.pp_schedule == "zero-bubble" and self.tp > 1,
                           "tensor parallelism beside zero-bubble (torch's split backward fails on DTensors)")):
            if on:
                raise ConfigError(f"{words} with {what} parallelism is not supported yet")

    def _check_virtual(self) -> None:
        looped = self.pp_schedule in LOOPED_SCHEDULES
        v = self.pp_virtual
        if v is None:
            object.__setattr__(self, "pp_virtual", 2 if looped else 1)
            return
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"pp_virtual must be an integer >= 1, got {v!r}")
        if looped and v < 2:
            raise ConfigError(f"{self.pp_schedule} interleaves 2 or more stages a rank: pp_virtual is {v}")
        if not looped and v != 1:
            raise ConfigError(f"pp_virtual {v}: {self.pp_schedule} runs one stage a rank (interleaved-1f1b and "
                              "zero-bubble run several)")

    @property
    def stages(self) -> int:
        """Pipeline stages in all: ``pp`` ranks of ``pp_virtual`` each."""
        return self.pp * self.pp_virtual

    @property
    def world(self) -> int:
        """Ranks of the run: data-parallel x pipeline x tensor-parallel."""
        return self.gpus * self.pp * self.tp

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.micro_batch * self.grad_accum * self.gpus

    @property
    def rank_batch(self) -> int:
        """Samples per optimizer step on one rank (its share of the global batch)."""
        return self.micro_batch * self.grad_accum

    @property
    def fsdp(self) -> bool:
        """The layout shards parameters with FSDP2 (fsdp, fsdp-no-reshard, hsdp)."""
        return self.data_parallel in ("fsdp", "fsdp-no-reshard", "hsdp")

    @property
    def shard_group(self) -> int:
        """Ranks that split one copy of the model state: all of them for fsdp, a node's for hsdp."""
        return {"fsdp": self.gpus, "fsdp-no-reshard": self.gpus, "hsdp": self.gpus_per_node}.get(
            self.data_parallel, 1)

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """One line for people, e.g. "micro-batch 4 x 8, bf16, activation checkpointing all, optimizer
        offload"; every table, verdict and log line describes a configuration with it."""
        parts = [f"micro-batch {self.micro_batch} x {self.grad_accum}", self.precision]
        ck = self.activation_checkpoint
        if ck != "none":
            what = ",".join(ck) if isinstance(ck, tuple) else f"1 block in {ck}" if isinstance(ck, int) else ck
            parts.append(f"activation checkpointing {what}")
        parts += self.techniques()
        if self.gpus > 1:
            parts.insert(0, f"{self.gpus} GPUs {self.data_parallel}")
        if self.pp > 1:
            parts.insert(0, f"{self.pp} pipeline stages {self.pp_schedule}" if self.pp_virtual == 1 else
                         f"{self.pp} pipeline ranks of {self.pp_virtual} stages {self.pp_schedule}")
        if self.tp > 1:
            parts.insert(0, f"tensor parallel {self.tp}")
        return ", ".join(parts)

    def techniques(self) -> list[str]:
        """The strategies beyond precision and checkpointing, in words (`describe`, the planner's families)."""
        named = [(self.offload_activations, "activation offload"), (self.offload_optimizer, "optimizer offload"),
                 (self.optimizer_in_backward, "optimizer in backward"),
                 (self.loss_chunks > 1, f"loss in {self.loss_chunks} chunks"),
                 (self.optimizer_8bit, f"{'paged ' if self.paged_optimizer else ''}8-bit optimizer states "
                                       "(changes the math)"),
                 (self.base_4bit, "4-bit NF4 base weights (changes the math)")]
        return [words for on, words in named if on]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if isinstance(d["activation_checkpoint"], tuple):
            d["activation_checkpoint"] = list(d["activation_checkpoint"])
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        d = dict(d)
        if "checkpoint" in d and "activation_checkpoint" not in d:  # memfit 0.1's name (plans, run checkpoints)
            warnings.warn("Config field 'checkpoint' is now 'activation_checkpoint'; the old name is read until "
                          "memfit 0.3", DeprecationWarning, stacklevel=2)
            d["activation_checkpoint"] = d.pop("checkpoint")
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"unknown Config field(s): {', '.join(sorted(unknown))}")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "Config":
        return cls.from_dict(json.loads(text))
