"""Hugging Face `Trainer` (and TRL's `SFTTrainer`, whose `SFTConfig` is a `TrainingArguments`): the batch size,
accumulation and checkpointing that fit, chosen from an estimate of the step `Trainer` runs, not by crashing.

`trainer_workload` is that step as a memfit `Workload`: the model as the user built it (or from its config),
`Trainer.compute_loss`'s call of the model with its labels and `num_items_in_batch`, the optimizer `args.optim`
names with `Trainer.create_optimizer`'s weight-decay groups, clipping at `max_grad_norm`, transformers' own
activation checkpointing from the arguments and Accelerate's mixed precision (autocast, outputs converted to
fp32). `estimate_training_args` adds what `Trainer.train()` holds beyond memfit's step: the micro-batch
Accelerate's dataloader has already fetched for the next step (on a GPU, every micro-batch of the step too,
as Accelerate puts them there when it fetches them). `fit_training_args` plans with that workload, keeps the
user's global batch, and confirms the arguments it returns with `estimate_training_args`.

With TRL's `SFTConfig` the step is `SFTTrainer`'s instead: its `compute_loss` calls the model with TRL's fused LM
head (`add_fused_lm_head`: per-token log-probabilities, entropy and top-1 in vocabulary tiles, the full logits
never made) and its collator's rows carry an attention mask. On a GPU that head scores only the labelled
positions and folds its tiles with Triton kernels; for a GPU target memfit traces that path (`_gpu_path`).

Trainer's FSDP2 (`args.fsdp`, `fsdp_config` version 2) is traced on rank 0 of a fake world with Accelerate's own
sharding (`Sharding`); bitsandbytes' AdamW and Lion, 8-bit, 32-bit and paged, with their own state layout
(`BitsAndBytesAdamW`, `BitsAndBytesLion`; paged states in unified memory: `_with_paged`). What either does that
memfit does not trace is refused in one line (`not_modelled`, `_check_target`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import sys
import types
import warnings

import torch

from memfit.config import Config
from memfit.errors import ConfigError, EstimateError, PlanError, WorkloadError
from memfit.integrations.loops import plan_runnable, rebuilt, target
from memfit.losses import chunking
from memfit.memory.devices import get_device, nccl_bytes
from memfit.memory.estimate import Category, Estimate, estimate
from memfit.memory.fake import is_fake
from memfit.planner.search import Plan, check_allow, resolve_budget
from memfit.strategies.optimizer_8bit import BLOCK, MIN_SIZE
from memfit.torch_internals import fake_process_group
from memfit.units import fmt_bytes
from memfit.workload import Workload, tensors_of
from memfit.workloads.hf import from_config, load_config, masks_as_in_a_real_run

MISSING = "transformers is not installed: pip install 'memfit[hf]'"
# args.optim values whose optimizer memfit builds as Trainer does (transformers' own handler); the rest of
# OptimizerNames (GaLore, APOLLO, LOMO, bitsandbytes, torchao, schedule-free, ...) are refused
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch", "adafactor", "sgd")
# bitsandbytes' optimizers as transformers builds them for these names (`_get_bitsandbytes_optimizer`): AdamW
# keeps two states, Lion one; "8bit" in the name keeps them in 8 bits, else fp32; "paged" in it pages the large
# ones. Their states are laid out by `BitsAndBytesAdamW` / `BitsAndBytesLion`, for a GPU
BNB = ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "lion_8bit", "lion_32bit",
       "paged_lion_8bit", "paged_lion_32bit")
BNB_8BIT = tuple(name for name in BNB if "8bit" in name)
BNB_PAGED = tuple(name for name in BNB if "paged" in name)
# bitsandbytes 0.50 (`Optimizer8bit.get_state_buffer`): a paged optimizer puts a state of a parameter with this
# many elements or more in CUDA unified memory (`cudaMallocManaged`), a smaller one in PyTorch's allocator
PAGED_MIN = 100_000
# what `allow` may name: the precisions a plan may switch to (they change the math, as memfit plan --allow)
PRECISIONS = {"bf16": "bf16", "fp16": "fp16"}


def _transformers():
    try:
        import transformers
    except ImportError:
        raise WorkloadError(MISSING) from None
    return transformers


def base_workload(model, seq_len: int) -> Workload:
    """The model, batches of `seq_len` tokens with labels, and the model's own loss on them. `model`: an
    `nn.Module` (a transformers model, PEFT-wrapped or not, on any device, meta included: rebuilt with fresh
    tensors, its weights never read), a transformers config, or a memfit `hf:` name."""
    transformers = _transformers()
    if isinstance(model, str):
        if not model.startswith("hf:"):
            raise WorkloadError(f"a transformers model is an nn.Module, a config or an 'hf:' name, got {model!r}")
        return from_config(model[3:], seq=seq_len)
    if isinstance(model, transformers.PretrainedConfig):
        return from_config(model, seq=seq_len)
    if not isinstance(model, torch.nn.Module):
        raise WorkloadError(f"a transformers model is an nn.Module, a config or an 'hf:' name, got "
                            f"{type(model).__name__}")
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    config = getattr(inner, "config", None)
    if not isinstance(config, transformers.PretrainedConfig):
        raise WorkloadError(f"{type(inner).__name__} has no transformers config: memfit makes a transformers "
                            "model's batches from it (for another model, describe the step as a memfit.Workload)")
    config = load_config(config)
    config.architectures = [type(inner).__name__]  # its head decides the batches and the loss
    described = from_config(config, seq=seq_len)
    return dataclasses.replace(described, model=rebuilt(model), name=f"{type(inner).__name__}")


def trainer_workload(model, args, *, seq_len: int, gpus: int | None = None, device: str = "cpu") -> Workload:
    """The step `transformers.Trainer` runs with `args` (a `TrainingArguments`), or `trl.SFTTrainer` with an
    `SFTConfig` (on a GPU `device`, its fused head's GPU path: module doc), as a memfit Workload of one rank; the
    micro-batch, accumulation and
    precision it is traced with are `traced(config_of(args, gpus=gpus))`. `seq_len`: every row's length (for
    SFTTrainer, the length its collator pads the micro-batch to, so rows of one length, or truncated to
    `max_length`, give the exact figure). Under FSDP (`args.fsdp`) it is rank 0's step and must be traced in a
    process group of `gpus` ranks (`estimate_training_args` makes a fake one)."""
    not_modelled(args, gpus)
    return _step(model, args, seq_len, _checkpointing_of(args), _precision_of(args), _sharding(args, gpus),
                 accum=args.gradient_accumulation_steps, gpu=get_device(device).kind == "cuda")


def _optim_name(args) -> str:
    return getattr(args.optim, "value", args.optim)


def _precision_of(args) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def _checkpointing_of(args) -> tuple[bool, dict | None]:
    name = _checkpointing_name()
    return bool(getattr(args, name)), getattr(args, f"{name}_kwargs")


def _step(model, args, seq_len: int, checkpointing: tuple[bool, dict | None], precision: str,
          sharding: "Sharding | None" = None, optim: str | None = None, accum: int = 1,
          gpu: bool = False) -> Workload:
    """`trainer_workload` with transformers' activation checkpointing (on, its keywords), the precision, the
    optimizer's name (None: `args.optim`), the micro-batches a step (`accum`) and whether the target is a GPU
    (SFTTrainer's head takes its GPU path there: `_gpu_path`) given apart from `args`: the
    planner's candidates are estimated without a TrainingArguments made for each (building one resets
    Accelerate's process-wide state, a live Trainer's included)."""
    optim = optim or _optim_name(args)
    # under FSDP Trainer reduces the gradients on the last micro-batch only (`no_sync`), unless sync_each_batch
    deferred = sharding is not None and accum > 1 and not _syncs_each_batch(args)
    micro = [0]  # micro-batches since the model was built: the step calls the loss once for each, in order
    transformers = _transformers()
    sft = _is_sft(args)
    base = base_workload(model, _sft_rows(args, seq_len) if sft else seq_len)
    if sft:
        _refuse_moe(model)
        if gpu:
            _check_gpu_path()
    if sharding is not None and hasattr(model, "get_base_model"):
        raise ConfigError("not modelled by memfit for Trainer: fsdp with a PEFT model (Accelerate then changes "
                          "its wrapping policy for the adapters); no estimate is made for it")
    mixed = precision != "fp32" and sharding is None  # under FSDP2 Accelerate adds no autocast (Sharding)
    built = []

    def build() -> torch.nn.Module:
        m = base.model()
        micro[0] = 0
        on, kwargs = checkpointing
        if on:  # as Trainer._inner_training_loop enables it
            kwargs = dict(kwargs or {})
            every = kwargs.pop("every_n_layers", 1)
            kwargs.pop("offload", None)  # refused by not_modelled where it is set
            kwargs.pop("selective", None)  # TRL's key, dropped by SFTTrainer; refused where it is set
            if hasattr(m, "activation_checkpointing_enable"):
                m.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None, every_n_layers=every)
            else:  # transformers before 5.2x: the old name, no every_n_layers
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)
        if sft:
            _add_fused_lm_head(m)
        if sharding is not None:
            m = sharding.apply(m, precision)
        if mixed:  # Accelerate's mixed precision returns the outputs in fp32 (of the forward SFTTrainer patched)
            from accelerate.utils import convert_outputs_to_fp32

            m.forward = types.MethodType(convert_outputs_to_fp32(m.forward.__func__), m)
        built[:] = [m.train()]
        return built[0]

    def loss(m: torch.nn.Module, batch: dict) -> torch.Tensor:
        """Trainer.compute_loss: the model's loss from its labels, normalised by `num_items_in_batch` where
        the model takes loss keywords (here the micro-batch's own count: memfit weights each micro-batch's
        mean by its share, the same math for the full rows these batches have)."""
        extra = {}
        if "labels" in batch and _accepts_loss_kwargs(m):
            labels = batch["labels"][..., 1:] if _shifts_labels(m) else batch["labels"]
            extra["num_items_in_batch"] = labels.ne(-100).sum()
        if deferred:  # Accelerate's no_sync for FSDP2: the unsharded gradients accumulate until the last
            micro[0] += 1
            m.set_requires_gradient_sync(micro[0] % accum == 0)
        with chunking(1):  # Trainer computes the model's own loss, never memfit's chunked one
            return base.loss(m, {**batch, **extra})

    def optimizer(params) -> torch.optim.Optimizer:
        """Trainer.create_optimizer: the class and keywords `args.optim` names, decay on all but biases and
        norms."""
        wanted = {id(p) for p in params}
        names = dict(built[0].named_parameters())
        decay = set(transformers.Trainer.get_decay_parameter_names(None, built[0]))
        groups = [{"params": [p for n, p in names.items() if id(p) in wanted and p.requires_grad and (n in decay) == d],
                   "weight_decay": args.weight_decay if d else 0.0} for d in (True, False)]
        if optim in BNB:  # with 8-bit states Trainer registers every nn.Embedding's weight for 32-bit ones
            fp32 = {id(m.weight) for m in built[0].modules() if isinstance(m, torch.nn.Embedding)} \
                if optim in BNB_8BIT else set()
            layout = dict(fp32=fp32, bits=8 if optim in BNB_8BIT else 32, paged=optim in BNB_PAGED,
                          lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2))
            if "lion" in optim:
                return BitsAndBytesLion(groups, **layout)
            return BitsAndBytesAdamW(groups, eps=args.adam_epsilon, **layout)
        cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, built[0])
        return cls(groups, **kwargs)

    def sft_batch(n: int) -> dict:
        """DataCollatorForLanguageModeling's rows: the ids, their labels and an attention mask of ones."""
        rows = base.batch(n)
        return {**rows, "attention_mask": torch.ones_like(rows["input_ids"])}

    def sft_loss(m: torch.nn.Module, batch: dict) -> torch.Tensor:
        """SFTTrainer.compute_loss: the fused head's summed negative log-likelihood ("dft" weighs each token by
        its probability) over the labelled tokens, here the micro-batch's own count, as in `loss`. Its metrics
        (entropy, token accuracy, tokens seen) are sums read back with `.item()`: 0-d tensors, left out."""
        with masks_as_in_a_real_run(), _gpu_path() if gpu else contextlib.nullcontext():
            out = m(**batch, use_cache=False, fused_lm_head=True)  # SDPA's mask of ones left out, as transformers
        per_token = -out.log_probs
        if args.loss_type == "dft":
            per_token = per_token * out.log_probs.exp().detach()
        return per_token.sum() / out.label_mask.sum().clamp(min=1)

    clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
    return Workload(model=build, batch=sft_batch if sft else base.batch, loss=sft_loss if sft else loss,
                    optimizer=optimizer, name=f"{'SFTTrainer' if sft else 'Trainer'}({base.name})",
                    max_grad_norm=clip)


class _BitsAndBytesStates:
    """The optimizer states of a bitsandbytes optimizer as Trainer makes it, for an estimate of a GPU step; it
    updates nothing. Laid out as bitsandbytes 0.50 lays them out (`Optimizer2State` / `Optimizer1State.init_state`,
    `STATES` states a parameter): with 8 bits, a parameter of 4,096 elements or more (`min_8bit_size`, every shape,
    1-D too) keeps uint8 states of its own shape and an fp32 absmax vector each, one value per 256 elements of the
    flattened tensor (the last block shorter), and the 256-value fp32 quantization maps (one a state) are made
    once on the device; a smaller parameter, one registered for 32 bits (Trainer registers every nn.Embedding's
    weight with `GlobalOptimManager.register_module_override`, listed in `fp32`) and every parameter of a 32-bit
    optimizer keep fp32 states. Paged, a state of a parameter of `PAGED_MIN` elements or more is made with
    `cudaMallocManaged`, outside PyTorch's allocator: the stand-in leaves it out of the trace, and
    `managed_bytes` counts it (`_with_paged`); its absmax stays in the allocator. The step count is a Python int.
    The update is bitsandbytes' fused CUDA kernel, in place, allocating nothing, so the stand-in allocates
    nothing either (on a CPU bitsandbytes updates through its PyTorch fallback instead: refused there)."""

    STATES = 2

    def __init__(self, params, fp32: set[int], bits: int, paged: bool, **defaults):
        torch.optim.Optimizer.__init__(self, params, {"weight_decay": 0.0, **defaults})
        self.fp32, self.bits, self.paged, self.maps = fp32, bits, paged, None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self._make_state(p)
                self.state[p]["step"] += 1
        return loss

    def layout(self, p: torch.Tensor) -> list[tuple[str, int, torch.dtype, bool]]:
        """(key, elements, dtype, in unified memory) of each state tensor bitsandbytes keeps for `p`, the shared
        quantization maps apart."""
        n = p.numel()
        eight = self.bits == 8 and id(p) not in self.fp32 and n >= MIN_SIZE
        managed = self.paged and n >= PAGED_MIN
        states = range(1, self.STATES + 1)
        out = [(f"state{i}", n, torch.uint8 if eight else torch.float32, managed) for i in states]
        return out + [(f"absmax{i}", -(-n // BLOCK), torch.float32, False) for i in states if eight]

    def managed_bytes(self) -> list[int]:
        """Each trainable parameter's state bytes in CUDA unified memory (none unless paged), in group order."""
        return [sum(n * dtype.itemsize for _, n, dtype, managed in self.layout(p) if managed)
                for group in self.param_groups for p in group["params"]]

    def _make_state(self, p: torch.Tensor) -> None:
        state = self.state[p]
        state["step"] = 0
        layout = self.layout(p)
        eight = layout[0][2] == torch.uint8
        if eight and self.maps is None:  # moved to the device by the first 8-bit parameter, paged or not
            self.maps = tuple(torch.zeros(256, dtype=torch.float32, device=p.device) for _ in range(self.STATES))
        for key, n, dtype, managed in layout:
            if managed:  # cudaMallocManaged's pages: no PyTorch tensor on the device (`_with_paged`)
                continue
            state[key] = torch.zeros(p.shape if key.startswith("state") else (n,), dtype=dtype, device=p.device)
        for i in range(1, self.STATES + 1 if eight else 1):
            state[f"qmap{i}"] = self.maps[i - 1]


class BitsAndBytesAdamW(_BitsAndBytesStates, torch.optim.AdamW):
    """bitsandbytes' AdamW (`adamw_bnb_8bit`, `paged_adamw_8bit`, `paged_adamw_32bit`): two states a parameter
    (`_BitsAndBytesStates`). memfit's own `Adam8bit` is another layout (blocks along rows, 1-D tensors in fp32).
    An AdamW to the planner, whose advice on what else may fit rebuilds AdamW with memfit's states."""

    STATES = 2


class BitsAndBytesLion(_BitsAndBytesStates, torch.optim.Optimizer):
    """bitsandbytes' Lion (`lion_8bit`, `lion_32bit` and their paged names): one state a parameter
    (`_BitsAndBytesStates`), one quantization map."""

    STATES = 1


def _is_sft(args) -> bool:
    """Whether `args` is TRL's SFTConfig: if so, trl is imported already (trl is an optional extra, never
    imported here for plain TrainingArguments)."""
    module = sys.modules.get("trl.trainer.sft_config")
    return module is not None and isinstance(args, module.SFTConfig)


def _sft_rows(args, seq_len: int) -> int:
    """The length of SFTTrainer's micro-batches of rows of `seq_len` tokens: its collator pads them up to
    `pad_to_multiple_of`; a `seq_len` over `max_length` is refused, as SFTTrainer truncates every row to it."""
    if args.max_length is not None and seq_len > args.max_length:
        raise ConfigError(f"seq_len={seq_len} is longer than the SFTConfig's max_length={args.max_length}, to which "
                          f"SFTTrainer truncates every row: plan for seq_len={args.max_length}")
    multiple = args.pad_to_multiple_of or 1
    return -(-seq_len // multiple) * multiple


def _refuse_moe(model) -> None:
    """SFTTrainer turns a Mixture-of-Experts model's router logits and load-balancing loss on (into the fused
    head's forward), which memfit has not checked against a run: refused before any trace, in one line."""
    transformers = _transformers()
    if isinstance(model, str):
        config = load_config(model[3:])
    elif isinstance(model, transformers.PretrainedConfig):
        config = model
    else:
        config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
    if hasattr(config.get_text_config(), "output_router_logits"):
        raise ConfigError(f"not modelled by memfit for SFTTrainer: {config.model_type}, a Mixture-of-Experts model "
                          "(SFTTrainer adds its router logits' load-balancing loss); no estimate is made for it")


def _add_fused_lm_head(m: torch.nn.Module) -> None:
    """TRL's own fused LM head, added as SFTTrainer adds it (to the base model under PEFT, with the outputs
    its metrics read), so that the traced head is TRL's code."""
    from trl.trainer import add_fused_lm_head

    add_fused_lm_head(m.get_base_model() if hasattr(m, "get_base_model") else m,
                      outputs=("log_probs", "entropy", "is_top1"))


@contextlib.contextmanager
def _gpu_path():
    """TRL's fused LM head as it runs on a GPU, for a trace on fake CPU tensors (TRL picks its path by the
    tensors' device, `_use_triton`): only the labelled positions are scored (`hidden_states[mask]`, the outputs
    scattered back with `masked_scatter`), and `ChunkedLogProbFunction` runs its own code with the GPU's three
    kernels in place of the CPU's (`_TritonLogProb`). Module attributes of trl are swapped while the model's
    forward runs, then restored: a GPU-target trace runs alone in its process (a forked child)."""
    from trl.trainer import utils

    with _swapped(utils, _use_triton=lambda device: True, _ChunkedLogProbFunction=_TritonLogProb):
        yield


# what `_gpu_path` swaps in trl (1.16): its fused head's device choice, autograd function and GPU kernels
_GPU_PATH_NAMES = {"trl.trainer.utils": ("_use_triton", "_ChunkedLogProbFunction"),
                   "trl.kernels.chunked_logprob": ("_use_triton", "_forward_kernel", "_backward_kernel", "_addmm_fp32",
                                                   "_MM_OUT_DTYPE")}


def _check_gpu_path() -> None:
    """Refuses, in one line, a trl whose fused head lacks what `_gpu_path` swaps: the trace would silently take
    the CPU's path."""
    import importlib

    import trl

    for module, names in _GPU_PATH_NAMES.items():
        lacking = [n for n in names if not hasattr(importlib.import_module(module), n)]
        if lacking:
            raise ConfigError(f"not modelled by memfit for SFTTrainer: a GPU with trl {trl.__version__}, whose fused "
                              f"LM head has no {module}.{lacking[0]} (memfit follows trl 1.16's GPU path); no "
                              "estimate is made for it")


@contextlib.contextmanager
def _swapped(module, **values):
    """`module`'s attributes set to `values` (one it lacks, added) while inside, as they were after."""
    missing = object()
    saved = {name: getattr(module, name, missing) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(module, name)
            else:
                setattr(module, name, value)


class _TritonKernel:
    """A Triton kernel of TRL's head on fake tensors: launched as `kernel[grid](...)`, it rewrites tensors it is
    given in place (the running statistics; in backward the logits tile, into its gradient) and allocates
    nothing, so it does nothing here. On real tensors it would leave wrong values: refused."""

    def __getitem__(self, grid):
        return self

    def __call__(self, *args, **kwargs):
        if not all(is_fake(a) for a in args if isinstance(a, torch.Tensor)):
            raise EstimateError("TRL's fused LM head's GPU path is traced on fake tensors only")


def _addmm_fp32_on_a_gpu(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """TRL's `_addmm_fp32` on a CUDA device: half-precision operands multiply straight into the fp32 `acc`
    (`addmm` with `out_dtype`, torch 2.8 or later), without the fp32 copies of them its CPU branch makes."""
    from trl.kernels import chunked_logprob

    if chunked_logprob._MM_OUT_DTYPE and a.dtype in (torch.float16, torch.bfloat16):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


@contextlib.contextmanager
def _triton_kernels():
    """`trl.kernels.chunked_logprob` as on a GPU: Triton there (`_use_triton`), its two kernels (`_TritonKernel`),
    `triton.cdiv` for the backward's grid, and `_addmm_fp32`'s CUDA branch."""
    from trl.kernels import chunked_logprob

    kernel = _TritonKernel()
    with _swapped(chunked_logprob, _use_triton=lambda device: True, _forward_kernel=kernel, _backward_kernel=kernel,
                  triton=types.SimpleNamespace(cdiv=lambda a, b: -(-a // b)), _addmm_fp32=_addmm_fp32_on_a_gpu):
        yield


class _TritonLogProb(torch.autograd.Function):
    """TRL's `ChunkedLogProbFunction`, its own forward and backward, each run with the GPU's kernels
    (`_triton_kernels`): what they allocate is TRL's code's, the Triton kernels adding nothing."""

    @staticmethod
    def forward(ctx, *args):
        from trl.kernels import ChunkedLogProbFunction

        with _triton_kernels():
            return ChunkedLogProbFunction.forward(ctx, *args)

    @staticmethod
    def backward(ctx, *grads):
        from trl.kernels import ChunkedLogProbFunction

        with _triton_kernels():
            return ChunkedLogProbFunction.backward(ctx, *grads)


def _accepts_loss_kwargs(m: torch.nn.Module) -> bool:
    """Trainer's rule for passing `num_items_in_batch` to the model."""
    inner = m.get_base_model() if hasattr(m, "get_base_model") else m
    if hasattr(inner, "accepts_loss_kwargs"):
        return bool(inner.accepts_loss_kwargs)
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(inner.forward).parameters.values())


def _shifts_labels(m: torch.nn.Module) -> bool:
    """Trainer's rule for counting a causal LM's items over `labels[..., 1:]`."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    inner = m.get_base_model() if hasattr(m, "get_base_model") else m
    return (LOSS_MAPPING.get(getattr(inner, "loss_type", None)) is ForCausalLMLoss
            and not getattr(getattr(inner, "config", None), "is_encoder_decoder", False))


@dataclasses.dataclass(frozen=True)
class Sharding:
    """Trainer's FSDP2 (`args.fsdp` with `fsdp_config` version 2) over `world` ranks, applied by Accelerate's own
    code (`fsdp2_prepare_model`), as `Trainer` has it applied, so the traced units are Accelerate's.

    Those are not memfit's `fsdp` layout (strategies/data_parallel.py): every transformer layer
    (`transformer_layer_cls_to_wrap`, else the model's `_no_split_modules`) is a unit resharded after its
    forward as `reshard_after_forward` says, the last one too; the input embedding is a unit of its own; the
    final norm and the output head (and the embedding, where its weight is the head's) are one unit kept
    gathered from forward to backward; the root takes the rest. bf16 is `MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=bf16)` with fp32 master weights (Accelerate upcasts them) and no autocast (Accelerate wraps
    the forward in autocast only outside FSDP2). A Config that describes it (`config_of`) has memfit's
    nearest layout, `fsdp` or `fsdp-no-reshard`, and is estimated only through this module.
    """

    world: int
    plugin: dict  # FullyShardedDataParallelPlugin's keywords, from TrainingArguments.fsdp_plugin_args

    @property
    def layout(self) -> str:
        return "fsdp" if self.plugin.get("reshard_after_forward", True) else "fsdp-no-reshard"

    def built_plugin(self):
        """Accelerate's plugin for these arguments; the environment it reads and writes (FSDP_* variables) is
        left as it was. Made afresh for each model: `set_auto_wrap_policy` binds it to one."""
        from accelerate.utils import FullyShardedDataParallelPlugin

        saved = dict(os.environ)
        try:
            return FullyShardedDataParallelPlugin(**self.plugin)
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def apply(self, m: torch.nn.Module, precision: str) -> torch.nn.Module:
        """`m` sharded as `Accelerator.prepare` shards it for Trainer (`fsdp2_prepare_model`), on rank 0's 1-D
        mesh over the current process group. `cpu_ram_efficient_loading` changes how the weights arrive (rank 0
        loads, then broadcasts), not the step's tensors: the trace builds every rank's model as the others do."""
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        from memfit.strategies.data_parallel import device_mesh

        plugin = self.built_plugin()
        plugin.cpu_ram_efficient_loading = False
        if precision != "fp32":  # what AcceleratorState does with the arguments' mixed precision
            plugin.set_mixed_precision(precision)
        device = torch.get_default_device()
        mesh = device_mesh(Config(gpus=self.world, data_parallel="fsdp"), device)
        accelerator = types.SimpleNamespace(
            state=types.SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh={("shard",): mesh},
            parallelism_config=types.SimpleNamespace(fsdp_dim_names=("shard",)), is_main_process=True,
            mixed_precision="no" if precision == "fp32" else precision, device=device)
        plugin.set_auto_wrap_policy(m)
        return fsdp2_prepare_model(accelerator, m)


def _sharding(args, gpus: int | None) -> Sharding | None:
    """The FSDP2 Trainer runs with `args` (None without `args.fsdp`); `not_modelled` has refused the rest."""
    if not args.fsdp:
        return None
    return Sharding(world=gpus or args.world_size, plugin=dict(args.fsdp_plugin_args))


def _syncs_each_batch(args) -> bool:
    """Whether Trainer reduces the gradients after every micro-batch (Accelerate's `sync_each_batch`) rather than
    keeping them unsharded under `no_sync` until the last (`_step` traces either)."""
    kwargs = getattr(args.accelerator_config, "gradient_accumulation_kwargs", None) or {}
    return bool(kwargs.get("sync_each_batch"))


def _fsdp_not_modelled(args, gpus: int | None) -> str | None:
    """Why Trainer's FSDP with `args` on `gpus` ranks is not modelled (None: it is)."""
    config = args.fsdp_config or {}
    if int(config.get("version", 2)) != 2:
        return ("fsdp_config version 1 (FSDP1's flat parameters and its wrapping are not memfit's layouts): use "
                "fsdp_config version 2")
    world = gpus or args.world_size
    if gpus is not None and args.world_size > 1 and gpus != args.world_size:
        return f"gpus={gpus} while this run has {args.world_size} processes"
    if world < 2:
        return ("fsdp in one process: pass gpus=, the number of ranks it will run on (memfit traces rank 0 of "
                "them)")
    if args.fp16:
        return "fsdp with fp16 (FSDP2's sharded gradient scaler): use bf16"
    if _is_sft(args):
        return "fsdp with an SFTConfig (TRL's fused LM head under FSDP2 is not checked)"
    if getattr(args, "parallelism_config", None) is not None:
        return "parallelism_config (Accelerate's device mesh beyond FSDP over every rank)"
    plugin_args = args.fsdp_plugin_args
    if plugin_args.get("auto_wrap_policy") != "TRANSFORMER_BASED_WRAP":
        return (f"fsdp_config auto_wrap_policy={plugin_args.get('auto_wrap_policy')!r} (modelled: "
                "TRANSFORMER_BASED_WRAP, each transformer layer a unit)")
    plugin = Sharding(world, dict(plugin_args)).built_plugin()  # with what FSDP_* variables add
    from torch.distributed.fsdp import CPUOffloadPolicy

    if plugin.activation_checkpointing:
        return ("fsdp_config activation_checkpointing (Accelerate's checkpoint_wrapper around each unit: memfit's "
                "trace of it was 2% above real ranks): use activation_checkpointing=True, transformers' own")
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        return "fsdp_config cpu_offload / fsdp 'offload' (FSDP2's CPUOffloadPolicy keeps the shards in host memory)"
    if plugin.ignored_modules is not None:
        return "ignored_modules (parameters left out of FSDP)"
    return None


def not_modelled(args, gpus: int | None = None) -> None:
    """One clear line for what `Trainer` (or `SFTTrainer`, for an SFTConfig) would do with `args` on `gpus`
    ranks (None: `args.world_size`) that memfit does not model: a number for it would be silently wrong."""
    why, sft = None, _is_sft(args)
    if sft and (args.padding_free or args.packing):
        why = ("padding_free / packing (SFTTrainer then concatenates the rows into one sequence without padding, "
               "its attention from position_ids; memfit models padded rows of seq_len tokens): set "
               "padding_free=False, packing=False")
    elif sft and args.activation_offloading:
        why = "activation_offloading (TRL's saved activations in pinned host memory)"
    elif sft and (args.gradient_checkpointing_kwargs or {}).get("selective"):
        why = "selective activation checkpointing (TRL's gradient_checkpointing_kwargs={'selective': True})"
    elif args.deepspeed:
        why = "DeepSpeed (its ZeRO stages, buffers and offload are not memfit's layouts)"
    elif args.torch_compile:
        why = "torch_compile (a compiled step keeps other tensors than the eager one memfit traces)"
    elif args.optim not in OPTIMIZERS + BNB:
        why = (f"optim={_optim_name(args)!r} (modelled: {', '.join(OPTIMIZERS + BNB)})")
    elif args.optim in BNB and args.fsdp:
        why = "fsdp with bitsandbytes' optimizer states (their layout over FSDP2's shards is not checked)"
    elif getattr(args, "use_liger_kernel", False):
        why = "use_liger_kernel (Liger's fused kernels replace the model's own)"
    elif args.label_smoothing_factor:
        why = "label_smoothing_factor (Trainer's label smoother computes the loss again from the logits)"
    elif getattr(args, "neftune_noise_alpha", None) is not None:
        why = "neftune_noise_alpha"
    elif (getattr(args, f"{_checkpointing_name()}_kwargs") or {}).get("offload"):
        why = "activation checkpointing with offload (saved activations in pinned host memory)"
    elif args.fsdp:
        why = _fsdp_not_modelled(args, gpus)
    elif max(args.world_size, args.n_gpu, gpus or 1) > 1:
        why = (f"{max(args.world_size, args.n_gpu, gpus or 1)} processes or GPUs without FSDP: Accelerate's DDP "
               "keeps its buckets apart from the gradients (gradient_as_bucket_view=False), which memfit's ddp "
               "layout does not")
    if why:
        raise ConfigError(f"not modelled by memfit for {'SFTTrainer' if sft else 'Trainer'}: {why}; no estimate is "
                          "made for it")


def _check_target(args, dev) -> None:
    """bitsandbytes on a CPU is refused: it updates there through its PyTorch fallback. Trainer's fsdp on a CPU
    is refused: Accelerate shards with FSDP only on accelerators, and CPU processes train with
    its DDP (MULTI_CPU) instead."""
    if args.optim in BNB and dev.kind != "cuda":
        raise ConfigError(f"not modelled by memfit for Trainer: optim={_optim_name(args)!r} on a CPU ({dev.name}), "
                          "where bitsandbytes updates through its PyTorch fallback, with whole fp32 copies of 8-bit "
                          "states, and pages nothing (memfit models its fused CUDA kernels); no estimate is made "
                          "for it")
    if args.fsdp and dev.kind != "cuda":
        raise ConfigError(f"not modelled by memfit for Trainer: fsdp on a CPU ({dev.name}), where Accelerate trains "
                          "the processes with DDP instead (FSDP only on accelerators); no estimate is made for it")


def config_of(args, gpus: int | None = None) -> Config:
    """memfit's Config for the step `args` describe on `gpus` ranks (None: `args.world_size`):
    transformers' checkpointing lives in the model (`trainer_workload`), so the Config has none of its own.
    Under FSDP it carries the ranks and memfit's nearest layout (`Sharding`); `traced` is what is estimated."""
    optim = _optim_name(args)
    config = Config(micro_batch=args.per_device_train_batch_size, grad_accum=args.gradient_accumulation_steps,
                    precision=_precision_of(args), optimizer_8bit=optim in BNB_8BIT,
                    paged_optimizer=optim in BNB_8BIT and optim in BNB_PAGED)
    sharding = _sharding(args, gpus)
    return config if sharding is None else config.replace(gpus=sharding.world, data_parallel=sharding.layout)


def traced(config: Config) -> Config:
    """The one-rank Config a Trainer step is traced with: bitsandbytes' 8-bit states are the workload's optimizer
    (`BitsAndBytesAdamW`), not memfit's `optimizer_8bit`; under FSDP, Accelerate's sharding and mixed-precision
    policy are in the workload (`Sharding`), and memfit adds neither its own layout nor autocast."""
    config = config.replace(optimizer_8bit=False, paged_optimizer=False)
    return config if config.gpus == 1 else config.replace(gpus=1, data_parallel="none", precision="fp32")


def estimate_training_args(model, args, *, seq_len: int, device: str = "cpu", gpus: int | None = None) -> Estimate:
    """The peak of `Trainer(model, args).train()`'s steps on `device`, per rank: memfit's estimate of
    `trainer_workload` plus the batches Accelerate's dataloader holds beyond memfit's step (module doc).
    `gpus`: the ranks an FSDP run will have, where this process is not one of them (default
    `args.world_size`); the estimate is made in a fake process group, so call it before any real one."""
    dev = get_device(device)
    wl = trainer_workload(model, args, seq_len=seq_len, gpus=gpus, device=device)
    _check_target(args, dev)
    config = config_of(args, gpus)
    return _with_nccl(_with_loader(wl, config, dev, args, _optim_name(args)), config, dev)


def _with_loader(wl: Workload, config: Config, dev, args=None, optim: str | None = None) -> Estimate:
    """`config`'s step (`traced`, under FSDP on rank 0 of a fake world of its ranks) and the dataloader's; with
    a paged bitsandbytes optimizer (`optim`), its states in unified memory (`_with_paged`); for an SFTConfig
    (`args`) on a GPU, a note on its head's path."""
    run = traced(config)
    with _rank_world(config.gpus):
        est = estimate(wl, run, dev)
    if optim in BNB_PAGED:
        est = _with_paged(wl, est)
    if args is not None and _is_sft(args) and dev.kind == "cuda":
        est.notes.append("SFTTrainer's fused LM head traced on its GPU path (trl's own code, its Triton kernels "
                         "allocating nothing): only labelled positions are scored, every position of these rows; "
                         "fewer labelled (masked prompts) keep less. Not seen: the scratch CUDA's boolean indexing "
                         "and masked_scatter take while they run (a few int64 a position). Not checked on a GPU")
    with torch.device("meta"):
        micro = sum(t.numel() * t.element_size() for t in tensors_of(wl.batch(config.micro_batch)))
    if est.device_peak_bytes is None:  # on a CPU memfit's step holds the global batch already
        extra, why = micro, "the next step's first micro-batch, fetched ahead by Accelerate's dataloader"
        fields = dict(peak_bytes=est.peak_bytes + extra)
    else:
        extra = config.grad_accum * -(-micro // 512) * 512  # the caching allocator's 512-byte rounding
        why = (f"{config.grad_accum + 1} micro-batches on the GPU (the step's {config.grad_accum} and the next "
               "one), as Accelerate's dataloader places them when it fetches them, where memfit's step copies one "
               "at a time (not yet checked on a GPU)")
        fields = {k: getattr(est, k) + extra for k in ("peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
                                                      "device_peak_bytes")}
    breakdown = dict(est.breakdown)
    breakdown[Category.INPUTS] = breakdown.get(Category.INPUTS, 0) + extra
    notes = [*est.notes, f"Trainer's dataloader: {fmt_bytes(extra)} more inputs, {why}"]
    if config.gpus > 1:
        notes.append(f"per rank: rank 0 of {config.gpus}, Trainer's FSDP2 as Accelerate applies it (a unit per "
                     "transformer layer, the input embedding, [final norm, output head] kept gathered, the root), "
                     "traced with a fake process group")
    return dataclasses.replace(est, breakdown=breakdown, notes=notes, **fields)


def _with_paged(wl: Workload, est: Estimate) -> Estimate:
    """A paged bitsandbytes optimizer's states in CUDA unified memory, which PyTorch's allocator never sees (its
    allocated and reserved peaks stay the trace's): the whole of them as host memory (`host_peak_bytes`), where
    the driver keeps them while the GPU has no room, as memfit's own paged states are counted; and on the GPU
    (`device_peak_bytes`, nvidia-smi's view) the largest parameter's, which bitsandbytes prefetches there before
    that parameter's update, on top of the reserved pool. Where the GPU has room the driver leaves more pages
    there (nvidia-smi shows them); paging traffic is not priced in the step time. Counted from the whole model
    built on the meta device, so a trace of fewer blocks (extrapolated) counts them all."""
    with torch.device("meta"):
        model = wl.model()
        sizes = wl.optimizer(list(model.parameters())).managed_bytes()
    managed, largest = sum(sizes), max(sizes, default=0)
    if not managed:
        return est
    note = (f"bitsandbytes' paged states: {fmt_bytes(managed)} in CUDA unified memory ({sum(map(bool, sizes))} "
            f"parameters of {PAGED_MIN:,} elements or more), outside PyTorch's allocator, so not in the allocated or "
            f"reserved peaks; counted as host memory, and {fmt_bytes(largest)} (the largest parameter's, prefetched "
            "before its update) on the GPU; where the GPU has room the driver keeps more of them there (not "
            "checked on a GPU)")
    return dataclasses.replace(est, host_peak_bytes=(est.host_peak_bytes or 0) + managed,
                               device_peak_bytes=est.device_peak_bytes + largest, notes=[*est.notes, note])


def _nccl(config: Config, dev) -> int:
    """NCCL's communicators on each of an FSDP run's GPUs, outside PyTorch's allocator (memfit's catalogue)."""
    return (nccl_bytes(dev, config.gpus, config.data_parallel, None) or 0) if dev.kind == "cuda" and config.gpus > 1 \
        else 0


def _with_nccl(est: Estimate, config: Config, dev) -> Estimate:
    nccl = _nccl(config, dev)
    if not nccl:
        return est
    return dataclasses.replace(est, device_peak_bytes=est.device_peak_bytes + nccl, nccl_bytes=nccl)


def runs(config: Config) -> str | None:
    """Why `Trainer` cannot run a configuration memfit's planner may choose (None: it can)."""
    if config.activation_checkpoint == "selective" or isinstance(config.activation_checkpoint, tuple):
        return "selective checkpointing"
    for on, what in ((config.optimizer_in_backward, "the optimizer step in backward"),
                     (config.loss_chunks > 1, "a loss in chunks"), (config.offload_activations, "activation offload"),
                     (config.offload_optimizer, "optimizer offload"), (config.precision == "bf16-pure", "bf16-pure"),
                     (config.base_4bit, "a 4-bit base"), (config.optimizer_8bit, "8-bit optimizer states")):
        if on:
            return what
    return None


def settings(config: Config) -> dict:
    """The TrainingArguments keywords that run `config` (memfit's configuration of one process)."""
    why = runs(config)
    if why:
        raise ConfigError(f"Trainer cannot run {config.describe()}: {why}")
    ck = config.activation_checkpoint
    name = _checkpointing_name()
    out = {"per_device_train_batch_size": config.micro_batch, "gradient_accumulation_steps": config.grad_accum,
           name: ck != "none", "bf16": config.precision == "bf16", "fp16": config.precision == "fp16"}
    if isinstance(ck, int):
        out[f"{name}_kwargs"] = {"every_n_layers": ck}
    return out


def _checkpointing_name() -> str:
    """transformers 5.2x calls it activation_checkpointing (gradient_checkpointing, the name before, is its
    deprecated alias, to go in v6); without transformers here, the name every version reads."""
    try:
        from transformers import TrainingArguments
    except ImportError:
        return "gradient_checkpointing"
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def fit_training_args(model, args, *, seq_len: int, device: str | None = None, budget=None, allow=(),
                      gpus: int | None = None):
    """`args` with the micro-batch, accumulation and activation checkpointing that fit `budget` on `device`
    fastest, the global batch (per device x accumulation x processes) kept exactly; precision changes only to
    a precision named in `allow` ("bf16", "fp16"). Returns (a copy of args, the Plan); the plan's peak is
    `estimate_training_args` of the copy, per rank. `device`: a catalogue name, else the current CUDA device
    with its free memory as the budget. `gpus`: the ranks of an FSDP run planned from outside it (default
    `args.world_size`). Call it before building the Trainer: a new TrainingArguments resets Accelerate's
    process-wide state (`MemfitCallback` plans inside a built Trainer).

    Example::

        args, plan = fit_training_args(model, TrainingArguments("out", per_device_train_batch_size=32),
                                       seq_len=2048, device="h100", budget="70GiB", allow=("bf16",))
        Trainer(model=model, args=args, train_dataset=data).train()
    """
    best = _fit(model, args, seq_len, device, budget, allow, gpus)
    with warnings.catch_warnings():  # the deprecated alias is mirrored by TrainingArguments itself
        warnings.simplefilter("ignore", FutureWarning)
        return dataclasses.replace(args, auto_find_batch_size=False, **_arguments(best.config, args)), best


def _fit(model, args, seq_len: int, device, budget, allow, gpus: int | None = None) -> Plan:
    """The fastest plan over the precisions and optimizers `allow` lets Trainer switch to; every candidate taken
    is confirmed by an estimate of the step Trainer runs with it."""
    allowed = frozenset([allow] if isinstance(allow, str) else allow)
    planner_allow = check_allow(allowed - set(PRECISIONS))
    optims = [_optim_name(args)]
    if "8bit-optim" in planner_allow:
        optims += _eight_bit_allowed(args, device)
    if planner_allow - {"8bit-optim"}:
        raise ConfigError(f"cannot allow {', '.join(sorted(planner_allow - {'8bit-optim'}))} for Trainer: a switch "
                          "to bitsandbytes' paged optimizers is not planned (their paging under memory pressure is "
                          "not priced in the step time: name optim='paged_adamw_8bit' to have it estimated); "
                          "adapters are the model's, not the arguments'")
    not_modelled(args, gpus)
    dev, limit = target(device, budget)
    _check_target(args, dev)
    user, sharding = config_of(args, gpus), _sharding(args, gpus)
    if sharding is not None and "fp16" in allowed:
        raise ConfigError("cannot allow fp16 for Trainer's fsdp: FSDP2's sharded gradient scaler is not modelled")
    name = _checkpointing_name()

    def as_run(config: Config, precision: str, optim: str) -> Config:
        """A traced candidate as the Config of the run it stands for."""
        eight = optim in BNB_8BIT
        config = config.replace(optimizer_8bit=eight, paged_optimizer=eight and optim in BNB_PAGED)
        return config if sharding is None else config.replace(precision=precision, gpus=sharding.world,
                                                               data_parallel=sharding.layout)

    def confirm_as(precision: str, optim: str):
        def confirm(config: Config) -> Estimate:
            kw = settings(config.replace(precision=precision))
            wl = _step(model, args, seq_len, (kw[name], kw.get(f"{name}_kwargs")), precision, sharding, optim,
                       config.grad_accum, gpu=dev.kind == "cuda")
            return _with_loader(wl, as_run(config.replace(activation_checkpoint="none"), precision, optim), dev,
                                args, optim)
        return confirm

    nccl = _nccl(user, dev)  # outside the traced step: the planner gets the budget without it, then it is added
    if nccl:
        limit = resolve_budget(limit, dev) - nccl
        if limit <= 0:
            raise PlanError(f"nothing fits in {fmt_bytes(limit + nccl)} on {dev.name}: NCCL's communicators alone "
                            f"take {fmt_bytes(nccl)} of each GPU of {user.gpus}")
    plans, errors = [], []
    for precision in dict.fromkeys([user.precision, *(PRECISIONS[a] for a in sorted(allowed) if a in PRECISIONS)]):
        for optim in optims:
            searched = _step(model, args, seq_len, (False, None), precision, sharding, optim,  # confirm: its accum
                             gpu=dev.kind == "cuda")
            try:
                with _rank_world(user.gpus):  # the planner traces rank 0 of the run's ranks
                    found = plan_runnable(searched, user.rank_batch, runs, stack="Trainer",
                                          confirm=confirm_as(precision, optim), budget=limit, device=dev,
                                          precision=precision if sharding is None else "fp32",
                                          offload_activations=False, offload_optimizer=False)
            except PlanError as e:
                errors.append(e)
                continue
            if sharding is not None:
                found.notes.append(f"Trainer's FSDP2 over {sharding.world} ranks: the step time is rank 0's compute, "
                                   "its all-gathers and reduce-scatters left out")
            plans.append(dataclasses.replace(
                found, config=as_run(found.config, precision, optim),
                alternatives=[dataclasses.replace(c, config=as_run(c.config, precision, optim),
                                                  peak_bytes=c.peak_bytes + nccl) for c in found.alternatives],
                estimate=found.estimate and _with_nccl(found.estimate, as_run(found.config, precision, optim), dev),
                budget_bytes=found.budget_bytes + nccl, usable_bytes=found.usable_bytes + nccl,
                peak_bytes=found.peak_bytes + nccl))
    if not plans and nccl:  # the planner saw the budget less NCCL's share and one rank's batch: say so
        raise PlanError(f"{errors[0]} (rank 0's step: {fmt_bytes(nccl)} of the budget left to NCCL's "
                        f"communicators, a rank's share of the global batch)") from errors[0]
    if not plans:
        raise errors[0]
    return min(plans, key=lambda p: p.step_seconds)


def _eight_bit_allowed(args, device) -> list[str]:
    """What `allow=("8bit-optim",)` lets Trainer switch `args.optim` to: bitsandbytes' 8-bit AdamW, with the same
    hyperparameters, for AdamW on a GPU."""
    if _optim_name(args) in BNB_8BIT:
        return []
    if _optim_name(args) not in ("adamw_torch_fused", "adamw_torch"):
        raise ConfigError(f"cannot allow 8bit-optim for Trainer with optim={_optim_name(args)!r}: it replaces "
                          "AdamW with bitsandbytes' 8-bit AdamW (adamw_bnb_8bit)")
    if device is None or get_device(device).kind != "cuda":
        raise ConfigError("cannot allow 8bit-optim for Trainer on a CPU: bitsandbytes' CPU update is not modelled")
    return ["adamw_bnb_8bit"]


def _arguments(config: Config, args) -> dict:
    """The TrainingArguments keywords that run a planned `config`: `settings`, and bitsandbytes' 8-bit AdamW where
    the plan switched to 8-bit states."""
    kw = settings(config.replace(optimizer_8bit=False, paged_optimizer=False))
    if config.optimizer_8bit and _optim_name(args) not in BNB:
        kw["optim"] = "adamw_bnb_8bit"
    return kw


_WORLD: list[int] = []  # the fake world this module has made and is inside, if any


@contextlib.contextmanager
def _rank_world(n: int):
    """A fake world of `n` ranks in which this process is rank 0 (memfit's own, for traces across ranks); inside
    one of this module's already (the planner's, then its confirmations), that one."""
    if n == 1 or _WORLD == [n]:
        yield
        return
    with fake_process_group(n):
        _WORLD.append(n)
        try:
            yield
        finally:
            _WORLD.pop()


def emit(config: Config, style: str) -> str:
    """`config` as `TrainingArguments(...)` keywords and as the flags HfArgumentParser reads (`trainer`),
    or as a `trl sft` command line (`trl`: SFTConfig turns checkpointing and bf16 on by default, so every
    value is given)."""
    kw = settings(config)
    if style == "trl":
        flags = " ".join(f"--{k} {v}" for k, v in kw.items() if not isinstance(v, dict))
        extra = "".join(f" --{k} '{_json(v)}'" for k, v in kw.items() if isinstance(v, dict))
        return f"trl sft --model_name_or_path MODEL --dataset_name DATA {flags}{extra}"
    call = ", ".join(f"{k}={v!r}" for k, v in kw.items() if v is not False)
    flags = " ".join(f"--{k} {v}" if not isinstance(v, bool) else f"--{k}" for k, v in kw.items()
                     if v is not False and not isinstance(v, dict))
    flags += "".join(f" --{k} '{_json(v)}'" for k, v in kw.items() if isinstance(v, dict))
    return f"TrainingArguments({call})\n{flags}"


def _json(value: dict) -> str:
    import json

    return json.dumps(value)


def __getattr__(name: str):
    """`MemfitCallback` is made when first asked for: it subclasses transformers' TrainerCallback, and this
    module must import without transformers (`memfit plan --emit`)."""
    if name == "MemfitCallback":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _callback_class():
    transformers = _transformers()

    class MemfitCallback(transformers.TrainerCallback):
        """Plans at `on_init_end`, before `train()` builds the dataloader, optimizer and checkpointing, and sets
        the arguments that can still change there: the per-device batch size, accumulation (the global batch
        kept) and activation checkpointing; precision was fixed when Trainer was built, so it is kept. On a GPU
        it compares the measured peak of the first `check_steps` steps with the prediction and warns when they
        differ by more than `tolerance`. `.plan` holds the plan.

        Example::

            Trainer(model=model, args=args, train_dataset=data,
                    callbacks=[MemfitCallback(seq_len=2048, budget="70GiB")]).train()
        """

        def __init__(self, *, seq_len: int, budget=None, device: str | None = None, check_steps: int = 3,
                     tolerance: float = 0.05):
            self.seq_len, self.budget, self.device = seq_len, budget, device
            self.check_steps, self.tolerance = check_steps, tolerance
            self.plan: Plan | None = None

        def on_init_end(self, args, state, control, model=None, **kwargs):
            self.plan = _fit(model, args, self.seq_len, self.device, self.budget, ())
            for key, value in {**_arguments(self.plan.config, args), "auto_find_batch_size": False}.items():
                setattr(args, key, value)
            name = _checkpointing_name()
            if name != "gradient_checkpointing":  # the deprecated alias mirrors the new name, as __post_init__ does
                args.gradient_checkpointing = getattr(args, name)
                args.gradient_checkpointing_kwargs = getattr(args, f"{name}_kwargs")

        def on_step_end(self, args, state, control, **kwargs):
            est = self.plan.estimate if self.plan is not None else None
            if not torch.cuda.is_available() or est is None or est.peak_allocated_bytes is None \
                    or state.global_step != self.check_steps:
                return
            measured, predicted = torch.cuda.max_memory_allocated(), est.peak_allocated_bytes
            if abs(measured - predicted) > self.tolerance * predicted:
                warnings.warn(f"memfit predicted a peak of {fmt_bytes(predicted)} allocated; the first "
                              f"{self.check_steps} steps measured {fmt_bytes(measured)} "
                              f"({(measured - predicted) / predicted:+.1%})", stacklevel=2)

    return MemfitCallback
