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
never made) and its collator's rows carry an attention mask. On a GPU that head runs Triton kernels and scores
only the labelled positions, which memfit does not trace (it traces TRL's torch path, the CPU's): a GPU target
is refused for SFTConfig.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
import warnings

import torch

from memfit.config import Config
from memfit.errors import ConfigError, PlanError, WorkloadError
from memfit.integrations.loops import plan_runnable, rebuilt, target
from memfit.losses import chunking
from memfit.memory.devices import get_device
from memfit.memory.estimate import Category, Estimate, estimate
from memfit.planner.search import Plan, check_allow
from memfit.units import fmt_bytes
from memfit.workload import Workload, tensors_of
from memfit.workloads.hf import from_config, load_config, masks_as_in_a_real_run

MISSING = "transformers is not installed: pip install 'memfit[hf]'"
# args.optim values whose optimizer memfit builds as Trainer does (transformers' own handler); the rest of
# OptimizerNames (GaLore, APOLLO, LOMO, bitsandbytes, torchao, schedule-free, ...) are refused
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch", "adafactor", "sgd")
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


def trainer_workload(model, args, *, seq_len: int) -> Workload:
    """The step `transformers.Trainer` runs with `args` (a `TrainingArguments`), or `trl.SFTTrainer` with an
    `SFTConfig` (its CPU path: module doc), as a memfit Workload; the micro-batch, accumulation and precision
    are `config_of(args)`. `seq_len`: every row's length (for SFTTrainer, the length its collator pads the
    micro-batch to, so rows of one length, or truncated to `max_length`, give the exact figure)."""
    not_modelled(args)
    return _step(model, args, seq_len, _checkpointing_of(args), mixed=bool(args.bf16 or args.fp16))


def _checkpointing_of(args) -> tuple[bool, dict | None]:
    name = _checkpointing_name()
    return bool(getattr(args, name)), getattr(args, f"{name}_kwargs")


def _step(model, args, seq_len: int, checkpointing: tuple[bool, dict | None], mixed: bool) -> Workload:
    """`trainer_workload` with transformers' activation checkpointing (on, its keywords) and mixed precision
    given apart from `args`: the planner's candidates are estimated without a TrainingArguments made for each
    (building one resets Accelerate's process-wide state, a live Trainer's included)."""
    transformers = _transformers()
    sft = _is_sft(args)
    base = base_workload(model, _sft_rows(args, seq_len) if sft else seq_len)
    if sft:
        _refuse_moe(model)
    built = []

    def build() -> torch.nn.Module:
        m = base.model()
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
        with chunking(1):  # Trainer computes the model's own loss, never memfit's chunked one
            return base.loss(m, {**batch, **extra})

    def optimizer(params) -> torch.optim.Optimizer:
        """Trainer.create_optimizer: the class and keywords `args.optim` names, decay on all but biases and
        norms."""
        wanted = {id(p) for p in params}
        names = dict(built[0].named_parameters())
        decay = set(transformers.Trainer.get_decay_parameter_names(None, built[0]))
        cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, built[0])
        groups = [{"params": [p for n, p in names.items() if id(p) in wanted and p.requires_grad and (n in decay) == d],
                   "weight_decay": args.weight_decay if d else 0.0} for d in (True, False)]
        return cls(groups, **kwargs)

    def sft_batch(n: int) -> dict:
        """DataCollatorForLanguageModeling's rows: the ids, their labels and an attention mask of ones."""
        rows = base.batch(n)
        return {**rows, "attention_mask": torch.ones_like(rows["input_ids"])}

    def sft_loss(m: torch.nn.Module, batch: dict) -> torch.Tensor:
        """SFTTrainer.compute_loss: the fused head's summed negative log-likelihood ("dft" weighs each token by
        its probability) over the labelled tokens, here the micro-batch's own count, as in `loss`. Its metrics
        (entropy, token accuracy, tokens seen) are sums read back with `.item()`: 0-d tensors, left out."""
        with masks_as_in_a_real_run():  # the mask of ones is left out, as transformers does where SDPA runs
            out = m(**batch, use_cache=False, fused_lm_head=True)
        per_token = -out.log_probs
        if args.loss_type == "dft":
            per_token = per_token * out.log_probs.exp().detach()
        return per_token.sum() / out.label_mask.sum().clamp(min=1)

    clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
    return Workload(model=build, batch=sft_batch if sft else base.batch, loss=sft_loss if sft else loss,
                    optimizer=optimizer, name=f"{'SFTTrainer' if sft else 'Trainer'}({base.name})",
                    max_grad_norm=clip)


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


def not_modelled(args) -> None:
    """One clear line for what `Trainer` (or `SFTTrainer`, for an SFTConfig) would do with `args` that memfit
    does not model: a number for it would be silently wrong."""
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
    elif args.optim not in OPTIMIZERS:
        why = f"optim={getattr(args.optim, 'value', args.optim)!r} (modelled: {', '.join(OPTIMIZERS)})"
    elif getattr(args, "use_liger_kernel", False):
        why = "use_liger_kernel (Liger's fused kernels replace the model's own)"
    elif args.label_smoothing_factor:
        why = "label_smoothing_factor (Trainer's label smoother computes the loss again from the logits)"
    elif getattr(args, "neftune_noise_alpha", None) is not None:
        why = "neftune_noise_alpha"
    elif (getattr(args, f"{_checkpointing_name()}_kwargs") or {}).get("offload"):
        why = "activation checkpointing with offload (saved activations in pinned host memory)"
    elif args.fsdp:
        why = "fsdp (Trainer's FSDP is not yet mapped onto memfit's FSDP2 layouts)"
    elif args.world_size > 1 or args.n_gpu > 1:
        why = (f"{max(args.world_size, args.n_gpu)} processes or GPUs without FSDP: Accelerate's DDP keeps its "
               "buckets apart from the gradients (gradient_as_bucket_view=False), which memfit's ddp layout does not")
    if why:
        raise ConfigError(f"not modelled by memfit for {'SFTTrainer' if sft else 'Trainer'}: {why}; no estimate is "
                          "made for it")


def _check_target(args, dev) -> None:
    """SFTTrainer on a GPU is refused (module doc): its Triton kernels are not what memfit traces."""
    if _is_sft(args) and dev.kind == "cuda":
        raise ConfigError(f"not modelled by memfit for SFTTrainer: a GPU ({dev.name}), where TRL's fused LM head "
                          "runs Triton kernels on the labelled positions only (memfit traces its torch path, the "
                          "CPU's); no estimate is made for it")


def config_of(args) -> Config:
    """memfit's Config for the step `args` describe: transformers' checkpointing lives in the model
    (`trainer_workload`), so the Config has none of its own."""
    return Config(micro_batch=args.per_device_train_batch_size, grad_accum=args.gradient_accumulation_steps,
                  precision="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32")


def estimate_training_args(model, args, *, seq_len: int, device: str = "cpu") -> Estimate:
    """The peak of `Trainer(model, args).train()`'s steps on `device`: memfit's estimate of
    `trainer_workload` plus the batches Accelerate's dataloader holds beyond memfit's step (module doc)."""
    wl = trainer_workload(model, args, seq_len=seq_len)
    _check_target(args, get_device(device))
    return _with_loader(wl, config_of(args), device)


def _with_loader(wl: Workload, config: Config, device) -> Estimate:
    est = estimate(wl, config, device)
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
    return dataclasses.replace(est, breakdown=breakdown, notes=notes, **fields)


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


def fit_training_args(model, args, *, seq_len: int, device: str | None = None, budget=None, allow=()):
    """`args` with the micro-batch, accumulation and activation checkpointing that fit `budget` on `device`
    fastest, the global batch (per device x accumulation x processes) kept exactly; precision changes only to
    a precision named in `allow` ("bf16", "fp16"). Returns (a copy of args, the Plan); the plan's peak is
    `estimate_training_args` of the copy. `device`: a catalogue name, else the current CUDA device with its
    free memory as the budget. Call it before building the Trainer: a new TrainingArguments resets
    Accelerate's process-wide state (`MemfitCallback` plans inside a built Trainer).

    Example::

        args, plan = fit_training_args(model, TrainingArguments("out", per_device_train_batch_size=32),
                                       seq_len=2048, device="h100", budget="70GiB", allow=("bf16",))
        Trainer(model=model, args=args, train_dataset=data).train()
    """
    best = _fit(model, args, seq_len, device, budget, allow)
    with warnings.catch_warnings():  # the deprecated alias is mirrored by TrainingArguments itself
        warnings.simplefilter("ignore", FutureWarning)
        return dataclasses.replace(args, auto_find_batch_size=False, **settings(best.config)), best


def _fit(model, args, seq_len: int, device, budget, allow) -> Plan:
    allowed = frozenset([allow] if isinstance(allow, str) else allow)
    planner_allow = check_allow(allowed - set(PRECISIONS))
    if planner_allow:
        raise ConfigError(f"cannot allow {', '.join(sorted(planner_allow))} for Trainer yet: the arguments it "
                          "maps to are not modelled (8-bit and paged optimizers keep Embedding states in 32 bits "
                          "under Trainer; adapters are the model's, not the arguments')")
    not_modelled(args)
    dev, limit = target(device, budget)
    _check_target(args, dev)
    user = config_of(args)
    searched = _step(model, args, seq_len, (False, None), mixed=user.precision != "fp32")

    def confirm(config: Config) -> Estimate:
        kw = settings(config)
        name = _checkpointing_name()
        wl = _step(model, args, seq_len, (kw[name], kw.get(f"{name}_kwargs")), mixed=config.precision != "fp32")
        return _with_loader(wl, config.replace(activation_checkpoint="none"), dev)

    plans, errors = [], []
    for precision in dict.fromkeys([user.precision, *(PRECISIONS[a] for a in sorted(allowed))]):
        try:
            plans.append(plan_runnable(searched if precision == user.precision else
                                       _step(model, args, seq_len, (False, None), mixed=precision != "fp32"),
                                       user.global_batch, runs, stack="Trainer", confirm=confirm, budget=limit,
                                       device=dev, precision=precision, offload_activations=False,
                                       offload_optimizer=False))
        except PlanError as e:
            errors.append(e)
    if not plans:
        raise errors[0]
    return min(plans, key=lambda p: p.step_seconds)


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
            for key, value in {**settings(self.plan.config), "auto_find_batch_size": False}.items():
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
