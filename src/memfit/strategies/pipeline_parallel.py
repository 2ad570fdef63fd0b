"""Pipeline parallelism: the repeated blocks split over `Config.pp` ranks, each micro-batch's activations
sent from stage to stage, on torch.distributed.pipelining's own schedules (`ScheduleGPipe`, `Schedule1F1B`,
`ScheduleInterleaved1F1B`, `ScheduleInterleavedZeroBubble`).

A stage is the workload's own model and loss with the parts other stages own taken out, so any model whose
forward runs its repeated blocks in order splits without being rewritten:

- blocks another stage runs are replaced by a pass-through that holds nothing;
- a stage after the first gets its input at its first block: a forward pre-hook there swaps the hidden
  state for the one received; the embeddings before the blocks, which it does not own, return a zero-stride
  stand-in of the right shape (no bytes) that the swap discards;
- a stage before the last ends at its last block: a forward hook there hands the block's output to the
  engine (which sends it on), and the modules after the blocks (final norm, head) are taken out;
- the last stage runs the workload's loss to the end: its output is the micro-batch's loss, weighted by its
  share of the step's batch as memfit's single-process step weights it.

Every stage is fed the step's micro-batches too (the engine passes keyword arguments to every stage), so the
loss sees its labels, and a stage's rotary tables and masks are computed where they are used, as on one GPU.
Weights shared between an embedding and the head (tied) would need their gradients summed across stages: refused.

The interleaved schedules give a rank several stages (`Config.pp_virtual`), placed as torch's looped schedules
place them: rank r holds stages r, r + pp, r + 2 pp, ... The rank keeps one model holding all its stages' blocks
under the model's own names (one optimizer, one checkpoint as before); each stage is a `_Stage` over that model
which, while its forward runs, takes out the rank's blocks of its earlier stages (and the embeddings, after
stage 0), so a stage starts where its input arrives. For zero bubble this is torch's
`ScheduleInterleavedZeroBubble` (ZB1P) rather than `ScheduleZBVZeroBubble`: the same looped placement and cut as
interleaved 1F1B, so the two differ only in splitting each backward into its input and weight halves (what the
memory comparison between them isolates), and any `pp_virtual` >= 2 works where ZB-V needs exactly 2 in a V.
"""
from __future__ import annotations

import contextlib
import functools
import gc

import torch
import torch.distributed as dist

from memfit.config import Config
from memfit.errors import ConfigError
from memfit.strategies.activation_checkpoint import find_blocks
from memfit.strategies.data_parallel import device_mesh
from memfit.torch_internals import p2p_works_hold_tensors, static_pipeline_metadata
from memfit.workload import split_batch

__all__ = ["PIPELINE_STAND_INS", "Pipeline", "stage_blocks"]


def stage_blocks(blocks: int, stages: int, ranks: int | None = None) -> list[range]:
    """The blocks of each stage: an even split, the first `blocks % stages` stages taking one more."""
    if blocks < stages:
        how = f" ({ranks} ranks x {stages // ranks} stages a rank)" if ranks and ranks != stages else ""
        raise ConfigError(f"{stages} pipeline stages{how} need at least {stages} repeated blocks; the model has "
                          f"{blocks}")
    size, extra = divmod(blocks, stages)
    out, start = [], 0
    for s in range(stages):
        n = size + (s < extra)
        out.append(range(start, start + n))
        start += n
    return out


class _Handoff(Exception):
    """Raised by the hook after a stage's last block: ends the stage's forward with the block's output.
    Control flow, caught by `_Stage.forward`: it never leaves the stage."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden


class _Skipped(torch.nn.Module):
    """A block another stage runs: returns its input hidden state (the stage's pre-hook replaces it)."""

    def forward(self, *args, **kwargs):
        return args[0] if args else kwargs["hidden_states"]


class _Elsewhere(torch.nn.Module):
    """A module after the blocks on a stage before the last: the handoff ends the forward before it."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, *args, **kwargs):
        raise ConfigError(f"pipeline parallelism: {self.name} runs after the repeated blocks on the last stage, but "
                          "this model's forward ran it before an earlier stage's last block: not split yet")


class _EmbeddingStandIn(torch.nn.Module):
    """An embedding a later stage does not own: the right shape and dtype, stride 0, holding no bytes."""

    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.dim, self.dtype = dim, dtype

    def forward(self, ids: torch.Tensor, *args, **kwargs):
        return torch.zeros((), dtype=self.dtype, device=ids.device).expand(*ids.shape, self.dim)


class _Stage(torch.nn.Module):
    """One stage's forward: the workload's loss on the stage's part of the model. `away`: the rank's modules
    another of its stages runs before this one's blocks, each with its stand-in, swapped out while it runs."""

    def __init__(self, model: torch.nn.Module, loss, weight: float, away: list | None = None, lead=None):
        super().__init__()
        self.model = model
        self.loss, self.weight = loss, weight
        self.away = away or []
        # whose on_forward / on_backward the step set (the rank's first stage); not registered as a submodule,
        # which would make a first stage its own child
        object.__setattr__(self, "lead", lead or self)
        self.received: torch.Tensor | None = None
        self.on_forward = self.on_backward = lambda: None

    def forward(self, *received: torch.Tensor, batch):
        self.lead.on_forward()
        self.received = received[0] if received else None
        kept = [(name, _swap(self.model, name, stand_in)) for name, stand_in in self.away]
        try:
            # shape (1,): the engine concatenates the last stage's outputs
            out = (self.loss(self.model, batch).float() * self.weight).reshape(1)
        except _Handoff as handoff:
            out = handoff.hidden
        finally:
            self.received = None
            for name, mod in kept:
                _swap(self.model, name, mod)
        if out.requires_grad:
            out.register_hook(self._backward_starts)
        return out

    def _backward_starts(self, grad):
        self.lead.on_backward()


class Pipeline:
    """This rank's stages of a `config.pp`-rank pipeline of `model`, and the schedule that runs them.

    `model` is the whole model, built identically on every rank (same seed), with memfit's other strategies
    applied; the rank keeps its stages' parts in place. `module` is the rank's first stage (the step hooks its
    phases there); `modules` all of them, in the rank's order."""

    def __init__(self, model: torch.nn.Module, loss, config: Config, device: torch.device):
        self.config, self.device = config, device
        if config.gpus > 1 or config.tp > 1:  # stages of several ranks: this rank's place on the pipeline axis
            axis = device_mesh(config, device)["pp"]
            self.rank, self.group = axis.get_local_rank(), axis.get_group()
        else:
            self.rank, self.group = dist.get_rank(), None
        # beside tensor parallelism the hidden state is a sequence-sharded DTensor: stages pass its local shard
        self.tp_mesh = device_mesh(config, device)["tp"] if config.tp > 1 else None
        # the looped placement torch's interleaved schedules use: rank r holds stages r, r + pp, ...
        self.indices = [self.rank + k * config.pp for k in range(config.pp_virtual)]
        self.first, self.last = self.rank == 0, self.rank == config.pp - 1
        self.names = find_blocks(model)
        if not self.names:
            raise ConfigError("pipeline parallelism splits the repeated blocks: found none in this model")
        split = stage_blocks(len(self.names), config.stages, config.pp)
        self.ranges = [split[g] for g in self.indices]
        self._refuse_tied(model)
        before, after = self._parts(model)
        self._cut(model, before, after)
        self.modules = []
        for k, g in enumerate(self.indices):
            # what the rank's earlier stages run before this one's blocks: out while this one runs
            away = [(self.names[i], _Skipped()) for r in self.ranges[:k] for i in r]
            if g > 0 and self.first:
                away += [(name, _stand_in(model, name)) for name in before]
            self.modules.append(_Stage(model, loss, 1 / config.grad_accum, away,
                                       self.modules[0] if self.modules else None))
        self.module = self.modules[0]
        # the parts taken out can sit in reference cycles (a module and its own methods): freed now, as a real
        # rank must free them, rather than whenever the collector runs (a trace counts every live tensor)
        gc.collect()
        self.engines: list = []
        self.schedule = None
        self.handoff_bytes = 0  # what a stage sends on per micro-batch (known at the first step)

    # ---------------------------------------------------------------------------------------- the split

    def _parts(self, model: torch.nn.Module) -> tuple[list[str], list[str]]:
        """Names of the modules holding parameters before the blocks and after them (registration order, as
        the forward runs them in every model memfit knows; a wrong guess fails loudly in `_Elsewhere`)."""
        container = self.names[0].rpartition(".")[0]
        names = [n for n, _ in model.named_modules()]
        where = names.index(container) if container else 0
        before, after = [], []
        for i, (name, mod) in enumerate(model.named_modules()):
            inside = container == "" or name == container or name.startswith(container + ".")
            if inside or not any(True for _ in mod.parameters(recurse=False)):
                continue
            (before if i < where else after).append(name)
        return before, after

    def _refuse_tied(self, model: torch.nn.Module) -> None:
        owners: dict[int, set[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            owners.setdefault(id(p), set()).add(name.rpartition(".")[0])
        for names in owners.values():
            if len(names) > 1 and len({self._owner_stage(n) for n in names}) > 1:
                raise ConfigError(f"pipeline parallelism: {' and '.join(sorted(names))} share a weight (tied "
                                  "embeddings) across stages, whose gradients would need summing: not supported")

    def _owner_stage(self, module_name: str) -> str:
        for i, block in enumerate(self.names):
            if module_name == block or module_name.startswith(block + "."):
                return f"block {i}"
        return module_name

    @property
    def kept(self) -> list[str]:
        """The names of this rank's own blocks, every stage's."""
        return [self.names[i] for r in self.ranges for i in r]

    def _cut(self, model: torch.nn.Module, before: list[str], after: list[str]) -> None:
        owned = {i for r in self.ranges for i in r}
        for i, name in enumerate(self.names):
            if i not in owned:
                _replace(model, name, _Skipped())
        if not self.first:
            for name in before:
                _replace(model, name, _stand_in(model, name))
        if not self.last:
            for name in after:
                _replace(model, name, _Elsewhere(name))

    def attach(self) -> None:
        """Hook each stage's ends, once the other strategies are applied: the received hidden state goes in
        before FSDP's own pre-forward (which casts it and hooks its gradient), and the handoff comes after FSDP's
        post-forward (which reshards and registers the unit's backward)."""
        modules = dict(self.module.model.named_modules())
        for stage, g, blocks in zip(self.modules, self.indices, self.ranges):
            if g > 0:
                modules[self.names[blocks.start]].register_forward_pre_hook(
                    functools.partial(_receive, stage, self.tp_mesh), with_kwargs=True, prepend=True)
            if g < self.config.stages - 1:
                modules[self.names[blocks.stop - 1]].register_forward_hook(_hand_off)

    # ---------------------------------------------------------------------------------------- the engine

    def step(self, batch, micro_batch: int) -> torch.Tensor:
        """One step's forwards and backwards over `batch`'s micro-batches under the schedule, for every stage
        this rank holds; the mean loss on the rank holding the last stage (zero elsewhere)."""
        from torch.distributed.pipelining import PipelineStage

        n = self.config.grad_accum
        if self.schedule is None:
            handoff = self._handoff_meta(batch, micro_batch)
            self.handoff_bytes = handoff.numel() * handoff.element_size()
            loss_meta = torch.empty(1, device=self.device, requires_grad=True)
            last = self.config.stages - 1
            self.engines = [PipelineStage(stage, g, self.config.stages, self.device,
                                          input_args=() if g == 0 else (handoff,),
                                          output_args=(loss_meta if g == last else handoff,), group=self.group)
                            for stage, g in zip(self.modules, self.indices)]
            kind = _schedule(self.config.pp_schedule)
            self.schedule = kind(self.engines if self.config.pp_virtual > 1 else self.engines[0], n_microbatches=n,
                                 loss_fn=_weighted_loss, scale_grads=False)
            if dist.get_backend() == "fake":
                static_pipeline_metadata(self.schedule)
        losses: list[torch.Tensor] = []
        target = torch.zeros(n, device=self.device) if self.last else None
        fake = dist.get_backend() == "fake"
        with p2p_works_hold_tensors() if fake else contextlib.nullcontext():
            self.schedule.step(batch=batch, target=target, losses=losses)
        if self.last:
            return torch.stack([loss.detach() for loss in losses]).sum()
        return torch.zeros((), device=self.device)

    def _handoff_meta(self, batch, micro_batch: int) -> torch.Tensor:
        """The hidden state stages pass on (shape and dtype): the first block's output for one micro-batch,
        computed without gradients, the RNG left as it was."""
        micro = split_batch(batch, micro_batch)[0]
        model = self.module.model
        seen: list[torch.Tensor] = []

        def grab(module, args, output):
            seen.append(output if isinstance(output, torch.Tensor) else output[0])
            raise _Handoff(seen[-1])

        # this stage's first block: on a later stage it runs on the embedding stand-in's zeros
        first_block = dict(model.named_modules())[self.names[self.ranges[0].start]]
        handle = first_block.register_forward_hook(grab, prepend=True)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                try:
                    self.module.loss(model, micro)
                except _Handoff:
                    pass
        finally:
            handle.remove()
        if not seen:
            raise ConfigError("pipeline parallelism: the model's forward never ran its first repeated block")
        out = _local(seen[0])
        return torch.empty(out.shape, dtype=out.dtype, device=self.device, requires_grad=True)

    def total_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The gradients' L2 norm over every rank's stages, from this rank's."""
        squared = norm.float() ** 2
        dist.all_reduce(squared, group=self.group)
        return squared.sqrt()


def _schedule(name: str):
    """torch's class for a `Config.pp_schedule`."""
    from torch.distributed import pipelining as pp

    return {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B, "interleaved-1f1b": pp.ScheduleInterleaved1F1B,
            "zero-bubble": pp.ScheduleInterleavedZeroBubble}[name]


def _receive(stage: _Stage, tp_mesh, module, args, kwargs):
    """Before a stage's first block: the hidden state it received in place of the one the model computed.
    Beside tensor parallelism that is this rank's shard of the positions, made the sequence-sharded DTensor
    the block takes (its gradient goes back as the local shard)."""
    hidden = stage.received
    if hidden is None and tp_mesh is None:  # the probe for the handoff's shape: the stand-in's zeros pass through
        return None
    if tp_mesh is not None:
        from torch.distributed.tensor import DTensor, Shard

        if hidden is None:  # the probe: the stand-in's zeros, of whole sequences, cut to one rank's positions
            whole = args[0] if args else kwargs.get("hidden_states")
            if whole is None or isinstance(whole, DTensor):
                return None
            hidden = whole.narrow(1, 0, whole.shape[1] // tp_mesh.size())
        hidden = DTensor.from_local(hidden, tp_mesh, [Shard(1)], run_check=False)
    if args:
        return (hidden, *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": hidden}
    raise ConfigError(f"pipeline parallelism: {type(module).__name__} takes its hidden state neither first nor "
                      "as hidden_states")


def _weighted_loss(out: torch.Tensor, target) -> torch.Tensor:
    """The last stage's output is already the micro-batch's loss, weighted by its share of the batch."""
    return out.sum()


def _hand_off(module, args, output):
    raise _Handoff(_local(output if isinstance(output, torch.Tensor) else output[0]))


def _local(hidden: torch.Tensor) -> torch.Tensor:
    """What a stage sends: beside tensor parallelism, the rank's shard of the sequence-sharded hidden state
    (a view: its gradient comes back as a DTensor of the same layout), as torchtitan's stages pass it."""
    return hidden.to_local() if hasattr(hidden, "to_local") else hidden


def _replace(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _swap(model: torch.nn.Module, name: str, new: torch.nn.Module) -> torch.nn.Module:
    """`new` in place of the module named `name`, which is returned."""
    old = model.get_submodule(name)
    _replace(model, name, new)
    return old


def _stand_in(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """An embedding's zero-stride stand-in, for a stage that does not run it."""
    mod = model.get_submodule(name)
    if not isinstance(mod, torch.nn.Embedding):
        raise ConfigError(f"pipeline parallelism: {name} ({type(mod).__name__}) runs before the first block and is "
                          "not an embedding: not split yet")
    return _EmbeddingStandIn(mod.embedding_dim, mod.weight.dtype)


PIPELINE_STAND_INS = (_EmbeddingStandIn, _Elsewhere)  # what holds the place of a module another stage runs
