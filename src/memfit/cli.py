"""The `memfit` command. Errors are one line on stderr and exit status 2; --debug shows the traceback."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

from memfit import __version__
from memfit.config import LAYOUTS, PP_SCHEDULES, PRECISIONS, Config
from memfit.errors import ConfigError, PlanError, RunError, WorkloadError


def _activation_checkpoint_arg(text: str):
    if text in ("none", "all", "selective", "selective-op"):
        return text
    if text.isdigit():
        return int(text)
    return tuple(name for name in text.split(",") if name)


def _options(args) -> dict:
    """Options of a built-in, or keyword arguments of a workload function: --seq when given and repeated
    -o key=value (a number where the value reads as one, so that `-o lr=3e-4` is a float)."""
    opts = {}
    for item in args.option or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise WorkloadError(f"option {item!r} must be key=value")
        opts[key] = _number(value)
    if args.seq is not None:
        opts["seq"] = args.seq
    return opts


def _number(text: str) -> int | float | str:
    """An -o value: an int or a float where it reads as one, else the text as given."""
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        return float(text) if any(c.isdigit() for c in text) else text
    except ValueError:
        return text


def _workload(args):
    """The workload the command line names, with LoRA on it if --lora says so (its syntax checked first)."""
    from memfit.workloads import load_workload

    options = None
    if args.lora:
        from memfit.workloads.lora import parse_lora

        options = parse_lora(args.lora)
    workload = load_workload(args.workload, **_options(args))
    if args.max_grad_norm is not None:
        workload = dataclasses.replace(workload, max_grad_norm=args.max_grad_norm)
    if options is None:
        return workload
    from memfit.workloads.lora import lora

    return lora(workload, **options)


_LORA_HELP = ("fine-tune with LoRA (peft): base frozen, adapters trained; r=16,alpha=32,targets=q_proj,v_proj,"
              "dropout=0.05 (each optional; default r=8, peft's alpha and per-architecture targets, no dropout; "
              "targets=all-linear: every Linear layer)")


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", help="built-in name (gpt-7b, resnet, mlp, hf:llama, ...) or path/to/job.py:function")
    _add_workload_options(p)


def _add_workload_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq", type=int, help="sequence length for built-in language models (to a workload function: "
                                           "its keyword argument seq)")
    p.add_argument("-o", "--option", action="append", metavar="KEY=VALUE",
                   help="option for a built-in workload, or a keyword argument of your workload function "
                        "(path/to/job.py:function called as function(KEY=VALUE, ...); numbers as int or float)")
    p.add_argument("--lora", metavar="KEY=VALUE,...", help=_LORA_HELP)
    p.add_argument("--max-grad-norm", type=float, metavar="NORM",
                   help="clip the gradients' total L2 norm to NORM before each optimizer step (default: the "
                        "workload's own, none for built-ins)")


_PRECISION_HELP = ("fp32; bf16 = bf16 autocast, fp32 weights; fp16 = fp16 autocast + loss scaling; "
                   "bf16-pure = bf16 weights, gradients and optimizer state, no fp32 master copy")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--micro-batch", type=int,
                   help="samples per forward/backward pass (default: 1, or the smallest the model trains at)")
    p.add_argument("--grad-accum", type=int,
                   help="micro-steps per optimizer step (default: 1; with --pp, the stages' count, the fewest that "
                        "keep every stage busy)")
    p.add_argument("--precision", choices=PRECISIONS,
                   help=_PRECISION_HELP + " (default: the device's: fp32 on a CPU; on a GPU bf16, or fp16 without it)")
    p.add_argument("--activation-checkpoint", "--checkpoint", type=_activation_checkpoint_arg, default="none",
                   help="activation checkpointing: none | all | selective | selective-op (torchtitan's) | "
                        "k (every k-th block) | name,name,... (--checkpoint: the old spelling, read until 0.3)")
    p.add_argument("--offload-activations", action="store_true",
                   help="keep activations saved for backward in host memory between forward and backward")
    p.add_argument("--offload-optimizer", action="store_true",
                   help="keep fp32 master weights and optimizer state in host memory; the optimizer steps there")
    p.add_argument("--optimizer-in-backward", action="store_true",
                   help="update each parameter and free its gradient as soon as backward produces it (same math; "
                        "one micro-batch a step, no fp16)")
    p.add_argument("--loss-chunks", type=int, default=1,
                   help="compute the loss in this many pieces of tokens, each chunk's logits made again in backward "
                        "(same math; language models: memfit's GPT, transformers' causal LMs)")
    p.add_argument("--optimizer-8bit", action="store_true",
                   help="Adam's moments in 8 bits, block-wise scaled (2 bytes a parameter instead of 8; changes the math)")
    p.add_argument("--paged-optimizer", action="store_true",
                   help="with --optimizer-8bit: the 8-bit states live in host memory, each parameter's paged to the "
                        "GPU for its own update (bitsandbytes' paged 8-bit AdamW under memory pressure; one GPU)")
    p.add_argument("--base-4bit", action="store_true",
                   help="QLoRA: the frozen Linear layers' weights in 4-bit NF4 (0.52 bytes a weight; with --lora; "
                        "changes the math)")
    p.add_argument("--gpus", type=int, default=1,
                   help="data-parallel ranks; every memory figure is per rank (default: %(default)s)")
    p.add_argument("--data-parallel", choices=LAYOUTS,
                   help="how ranks hold the model: ddp | fsdp (FSDP2, ZeRO-3) | fsdp-no-reshard (ZeRO-2-like) | "
                        "hsdp (shard in a node, replicate across) (default: fsdp with --gpus > 1)")
    p.add_argument("--gpus-per-node", type=int, help="ranks per node, hsdp's shard group (default: 8)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks splitting each block's matmuls, beside --gpus (default: %(default)s)")
    _add_pipeline_args(p, "pipeline stages the repeated blocks split over, beside --gpus; figures are the highest "
                          "stage's, each stage's in a table")
    p.add_argument("--config", help="a Config as JSON (a file path or the JSON text); flags are ignored")


def _add_pipeline_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--pp", type=int, default=1, help=f"{what} (default: %(default)s)")
    p.add_argument("--pp-schedule", choices=PP_SCHEDULES, default="1f1b",
                   help="the order a stage runs its micro-batches (torch.distributed.pipelining's schedules): gpipe "
                        "(every forward, then every backward), 1f1b (one forward, one backward once the pipeline is "
                        "full: fewer held), interleaved-1f1b (--pp-virtual stages a rank, rank r holding r, r + pp, "
                        "...: a smaller bubble, more held on the first ranks) or zero-bubble (torch's "
                        "ScheduleInterleavedZeroBubble, ZB1P, same placement: each backward split into its input "
                        "and weight halves) (default: %(default)s)")
    p.add_argument("--pp-virtual", type=int,
                   help="stages a rank holds under interleaved-1f1b and zero-bubble (default: 2 for those, else 1)")


def _config_json(text: str) -> Config:
    """--config: a Config as JSON, or a file holding one or a plan (`memfit plan --json`, a run's plan.json)."""
    if not text.lstrip().startswith("{"):
        try:
            with open(text) as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"--config {text}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--config: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError("--config: expected a JSON object (a Config, or a plan holding one)")
    return Config.from_dict(data["config"] if isinstance(data.get("config"), dict) else data)


_ALLOW_HELP = ("techniques that change the math, searched with the rest when named (comma-separated): 8bit-optim "
               "(Adam's moments in 8 bits), paged-optim (the 8-bit moments in host memory, paged to the GPU one "
               "parameter at a time: bitsandbytes' paged 8-bit AdamW), lora (r=16, alpha=32 adapters, the base "
               "frozen), qlora (lora, and the base's weights in 4 bits too)")


def _allow(text: str | None) -> tuple[str, ...]:
    return tuple(t.strip() for t in (text or "").split(",") if t.strip())


def _config(args, device=None) -> Config:
    """The configuration the flags (or --config) describe; without --precision, the device's default."""
    from memfit.memory.devices import defaults_for, get_device

    if args.config:
        return _config_json(args.config)
    precision = args.precision or defaults_for(device or get_device("cpu")).precision
    layout = args.data_parallel or ("fsdp" if args.gpus > 1 else "none")
    per_node = args.gpus_per_node or (8 if layout == "hsdp" else None)  # HGX/DGX nodes hold 8 GPUs
    pp = getattr(args, "pp", 1)
    return Config(micro_batch=args.micro_batch or 1, grad_accum=args.grad_accum or pp, precision=precision,
                  activation_checkpoint=args.activation_checkpoint, offload_activations=args.offload_activations,
                  offload_optimizer=args.offload_optimizer, optimizer_in_backward=args.optimizer_in_backward,
                  optimizer_8bit=args.optimizer_8bit, paged_optimizer=args.paged_optimizer, base_4bit=args.base_4bit,
                  loss_chunks=args.loss_chunks,
                  gpus=args.gpus, data_parallel=layout, gpus_per_node=per_node, tp=getattr(args, "tp", 1), pp=pp,
                  pp_schedule=getattr(args, "pp_schedule", "1f1b"), pp_virtual=getattr(args, "pp_virtual", None))


def _check_counts(args, *names: str) -> None:
    """Counts are whole numbers >= 1, checked before anything is loaded or traced."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def _one_process(args, why: str) -> None:
    """Refuse --pp where a command runs or describes one process's model: each stage needs its own rank."""
    if getattr(args, "pp", 1) > 1 and not args.config:
        raise ConfigError(f"--pp {args.pp}: {why}; `memfit estimate --pp` gives each stage's figures")


def _smallest(args, run, config: Config):
    """`run(config)`, and when no micro-batch was given a note on the one used: 1, or the smallest the model
    trains at when it rejects 1 (BatchNorm over one sample)."""
    from memfit.memory.estimate import MicroBatchError

    if args.micro_batch is not None or args.config:
        return run(config), None
    try:
        return run(config), f"micro-batch not given: {config.micro_batch} (--micro-batch to choose)"
    except MicroBatchError as e:
        note = (f"micro-batch not given: {e.smallest}, the smallest {e.workload} trains at (at {e.micro_batch}: "
                f"{e.reason})")
        return run(config.replace(micro_batch=e.smallest)), note


def cmd_estimate(args) -> int:
    from memfit.memory.devices import get_device
    from memfit.memory.extrapolate import estimate_blocks

    _check_counts(args, "micro_batch", "grad_accum", "pp")
    timeline = args.html or args.plot
    if args.blocks == "auto" and timeline:
        raise ConfigError("--html and --plot draw the step's timeline, which needs every block traced: "
                          "leave out --blocks auto")
    device = get_device(args.device)
    config = _config(args, device)
    workload = _workload(args)
    blocks = args.blocks or ("all" if timeline else "auto")
    try:
        est, note = _smallest(args, lambda c: estimate_blocks(workload, c, device, blocks), config)
    except WorkloadError as e:
        if args.precision or args.config or config.precision == "fp32":
            raise
        raise WorkloadError(f"{str(e).strip().splitlines()[0]} (in {config.precision}, the default on "
                            f"{device.name}; --precision fp32 to estimate it in fp32)") from e
    if note:
        est.notes.insert(0, note)
    if args.html:
        from memfit.report.html import write_timeline_html
        write_timeline_html(est, args.html)
    if args.plot:
        from memfit.report.plots import plot_memory_timeline
        plot_memory_timeline(est, args.plot)
    if args.json:
        print(json.dumps(est.to_dict()))
    else:
        from rich.console import Console

        from memfit.report.tables import estimate_view
        Console().print(estimate_view(est))
    return 0


def cmd_summary(args) -> int:
    from memfit.memory.summary import summarize

    _check_counts(args, "micro_batch", "grad_accum", "pp")
    _one_process(args, "summary's table is of one process's whole model")
    config = _config(args)
    workload = _workload(args)
    rows, note = _smallest(args, lambda c: summarize(workload, c), config)
    if args.json:
        print(json.dumps([r.__dict__ for r in rows]))
        if note:  # stdout stays the rows alone
            print(f"memfit: note: {note}", file=sys.stderr)
    else:
        from rich.console import Console

        from memfit.report.tables import summary_view
        Console().print(summary_view(workload.name, rows, note))
    return 0


def cmd_plan(args) -> int:
    from memfit.memory.devices import get_device
    from memfit.planner.search import check_allow, check_batches, gpu_counts, plan, resolve_budget

    _check_counts(args, "global_batch", "micro_batch", "verify_steps", "gpus_per_node")
    check_allow(_allow(args.allow))
    counts = gpu_counts(args.gpus)
    device = get_device(args.device)
    if resolve_budget(args.budget, device) < 1:
        raise PlanError(f"--budget must be more than 0 bytes, got {args.budget!r}")
    if not args.max_micro_batch:
        if args.global_batch is None:
            raise PlanError("plan needs --global-batch (samples per optimizer step)")
        check_batches(args.global_batch, args.micro_batch)
    workload = _workload(args)
    fixed = dict(precision=args.precision, micro_batch=args.micro_batch,
                 activation_checkpoint=args.activation_checkpoint,
                 offload_activations=True if args.offload_activations else None,
                 offload_optimizer=True if args.offload_optimizer else None)
    if args.max_micro_batch:
        from memfit.planner.search import max_micro_batch
        result = max_micro_batch(workload, budget=args.budget, device=device, **fixed)
        if args.json:
            print(json.dumps(result))
        else:
            from rich.console import Console
            from memfit.report.tables import max_batch_view
            Console().print(max_batch_view(result))
        return 0
    if counts != [1] and (args.max_micro_batch or args.verify):
        raise PlanError("--max-micro-batch and --verify are for one GPU so far")
    if len(counts) > 1:
        from memfit.planner.search import plan_counts
        rows = plan_counts(workload, args.global_batch, counts, budget=args.budget, device=device,
                           data_parallel=args.data_parallel, gpus_per_node=args.gpus_per_node,
                           allow=_allow(args.allow), host_memory=args.host_memory, **fixed)
        if args.json:
            print(json.dumps([dict(gpus=r["gpus"], why=r["why"], efficiency=r.get("efficiency"),
                                   plan=r["plan"].to_dict() if r["plan"] else None) for r in rows]))
        else:
            from rich.console import Console
            from memfit.report.tables import counts_view
            Console().print(counts_view(rows, workload.name, args.global_batch, device.name))
        if args.plot:
            from memfit.report.plots import plot_scaling
            plot_scaling(rows, args.plot, title=f"{workload.name}, global batch {args.global_batch} on {device.name}: "
                                                "predicted scaling")
        return 0
    if args.plot:
        raise PlanError("--plot draws a range of GPU counts (--gpus 8-512)")
    if args.emit:  # only what that stack runs: Trainer has no optimizer step in backward, chunked loss, offload
        from memfit.integrations.loops import plan_runnable
        from memfit.integrations.transformers import emit, runs
        if counts != [1] or args.verify or _allow(args.allow):
            raise PlanError("--emit writes one process's Trainer arguments: not with --gpus, --verify or --allow yet")
        result = plan_runnable(workload, args.global_batch, runs, stack="Trainer", budget=args.budget, device=device,
                               **{**fixed, "offload_activations": False, "offload_optimizer": False})
    else:
        result = plan(workload, args.global_batch, budget=args.budget, device=device, gpus=counts[0],
                      data_parallel=args.data_parallel, gpus_per_node=args.gpus_per_node, allow=_allow(args.allow),
                      host_memory=args.host_memory, **fixed)
    verified = None
    if args.verify:
        from memfit.runtime.verify import verify
        verified = verify(workload, result, steps=args.verify_steps)
    if args.json:
        out = result.to_dict()
        if verified:
            out["verify"] = verified
        if args.emit:
            out["emit"] = emit(result.config, args.emit)
        print(json.dumps(out))
    else:
        from rich.console import Console
        from memfit.report.tables import plan_view, verify_view
        console = Console()
        console.print(plan_view(result))
        if verified:
            console.print(verify_view(verified))
        if args.emit:
            print(emit(result.config, args.emit))
    return 0


def cmd_calibrate(args) -> int:
    from memfit.planner.costmodel import calibrate, cpu_key, describe, save_profile

    profile = calibrate(args.device)
    if profile.problems:  # the profile in use, if any, stays
        raise PlanError(f"calibration rejected, nothing saved: {'; '.join(profile.problems)}; run it on a quiet machine")
    path = save_profile(profile, cpu_key() if args.device == "cpu" else profile.device)
    if args.json:
        print(json.dumps(profile.to_dict()))
    else:
        print(f"{profile.device}: {describe(profile)}; dropout {1e9 / profile.rng_rate:.1f} ns per random number"
              + (f"; page faults {profile.fault_seconds * 2**30 * 1e3:.0f} ms per fresh GiB" if profile.fault_seconds
                 else "")
              + (f"; host link {profile.link_bandwidth / 1e9:.1f} GB/s" if profile.kind == "cuda" else "")
              + f"\nsaved to {path}")
    return 0


def cmd_train(args) -> int:
    from rich.console import Console

    from memfit.runtime.run import train

    from memfit.runtime import distributed
    from memfit.runtime.run import default_run_dir

    _check_counts(args, "gpus", "keep_checkpoints", "tp", "pp")
    config = _config_json(args.config) if args.config else None
    if config is not None:  # the ranks split as the configuration says
        args.tp, args.pp, args.pp_schedule = config.tp, config.pp, config.pp_schedule
        args.pp_virtual = config.pp_virtual
    if args.gpus % args.tp:
        raise ConfigError(f"--tp {args.tp} does not divide --gpus {args.gpus}")
    if args.pp > 1 and args.gpus < args.pp * args.tp:
        raise ConfigError(f"--pp {args.pp} runs each stage on its own rank{'s' if args.tp > 1 else ''}: --gpus "
                          f"{args.pp * args.tp} or more (--gpus counts every rank)")
    if args.gpus % (args.pp * args.tp):
        raise ConfigError(f"--pp {args.pp}{f' x --tp {args.tp}' if args.tp > 1 else ''} does not divide --gpus "
                          f"{args.gpus}: every pipeline stage needs the same number of ranks")
    dp = args.gpus // (args.pp * args.tp)
    if args.tp > 1 or args.pp > 1:  # refused here in one line rather than by every rank once launched
        _model_parallel_config(args, dp)
    allow = _allow(args.allow)
    if {"lora", "qlora"} & set(allow):
        from memfit.planner.search import lora_flag
        raise ConfigError(f"train runs one model: a LoRA plan (memfit plan --allow lora or qlora) is trained with "
                          f"--lora {lora_flag()} (the options the plan names; --base-4bit for QLoRA's)")
    if config is not None and config.world != args.gpus:
        raise ConfigError(f"--config is for {config.world} GPU(s); --gpus is {args.gpus}")
    if args.resume and args.pp > 1 and args.out and not distributed.launched():  # before any rank starts
        from memfit.runtime.checkpoints import latest_checkpoint, shards_path
        from memfit.runtime.run import unsharded_on_stages
        latest = latest_checkpoint(args.out)
        if latest is not None and not shards_path(latest).is_dir():
            raise ConfigError(unsharded_on_stages(latest))
    workload = _workload(args)
    if args.gpus > 1 and not distributed.launched():
        if args.device.startswith("cuda"):
            import torch
            if torch.cuda.device_count() < args.gpus:
                raise ConfigError(f"--gpus {args.gpus} on --device {args.device}: this machine has "
                                  f"{torch.cuda.device_count()} GPU(s); run one launcher per node (torchrun, Slurm)")
        if args.global_batch % dp:
            raise ConfigError(f"--global-batch {args.global_batch} does not split over {dp} data-parallel ranks")
        if args.out is None:  # every rank must write into the same run folder
            args.out = str(default_run_dir(workload))
            args.argv += ["--out", args.out]
        failure = distributed.run_ranks(args.gpus, args.argv, Path(args.out), say=lambda m: print(m, file=sys.stderr),
                                        debug=args.debug)
        if failure:
            from memfit.runtime.checkpoints import intact
            raise RunError(f"{failure}; {intact(args.out, ' (the same command with --resume goes on from it)')}")
        return 0
    console = Console()
    result = train(workload, args.steps, args.global_batch, budget=args.budget, device=args.device,
                   micro_batch=args.micro_batch, precision=args.precision, seed=args.seed, out=args.out,
                   checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints,
                   resume=args.resume, schedule=args.schedule,
                   progress=not args.no_progress, console=console, deterministic=args.deterministic,
                   gpus=args.gpus, data_parallel=args.data_parallel, config=config, allow=allow, tp=args.tp,
                   pp=args.pp, pp_schedule=args.pp_schedule, pp_virtual=args.pp_virtual)
    if args.gpus > 1 and not result.report:
        return 0  # ranks other than 0 say nothing
    from memfit.report.tables import run_view
    console.print(run_view(result))
    if workload.name == "sort" and (result.out / "model.safetensors").exists():
        from memfit.workloads.demo import show
        for given, answer, truth in show(result_model(result, workload)):
            mark = "[green]✓[/]" if answer == truth else "[red]✗[/]"
            console.print(f"  sort {given} → {answer} {mark}")
    return 0


def _model_parallel_config(args, dp: int) -> Config:
    """The configuration the ranks will make, built here so what it refuses (a split not built yet, too few
    micro-batches for the stages) is one line before any rank starts."""
    from memfit.runtime.run import rank_micro_batch

    share = args.global_batch // dp if args.global_batch % dp == 0 else args.global_batch
    micro = args.micro_batch or rank_micro_batch(share, args.pp)
    return Config(micro_batch=micro, grad_accum=max(1, share // micro), gpus=dp,
                  data_parallel=(args.data_parallel or "fsdp") if dp > 1 else "none", tp=args.tp, pp=args.pp,
                  pp_schedule=args.pp_schedule, pp_virtual=args.pp_virtual)


def result_model(result, workload):
    """The trained model, rebuilt from the run's final weights (the run itself keeps no state around)."""
    from safetensors.torch import load_file

    from memfit.runtime.checkpoints import load_model_state
    model = workload.model()
    load_model_state(model, load_file(str(result.out / "model.safetensors")))
    return model.eval()


def _describe_workload(name: str) -> dict:
    """What a built-in name builds, read off the model itself (made on the meta device: no memory, no time)."""
    import torch

    from memfit.workload import WorkloadError
    from memfit.workloads import builtin

    try:
        wl = builtin(name)
        with torch.device("meta"):
            model, sample = wl.model(), wl.batch(1)
    except WorkloadError as e:  # hf: without transformers
        return {"name": name, "model": str(e), "parameters": None, "sample": ""}
    if wl.name != name:
        kind = f"same as {wl.name}"
    elif hasattr(model, "cfg"):  # memfit's own GPT, dense or MoE
        c = model.cfg
        moe = hasattr(c, "experts")
        ffn = f"top-{c.top_k} of {c.experts} experts of ffn {c.ffn}" if moe else f"ffn {c.ffn}"
        kind = (f"Llama-shaped {'MoE' if moe else 'GPT'}: {c.layers} layers, d_model {c.d_model}, {c.heads} heads, "
                f"{ffn}, vocab {c.vocab}")
    elif name.startswith("hf:"):
        c = model.config
        kind = f"{type(model).__name__}, toy size: {c.num_hidden_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}"
    else:
        kind = type(model).__name__
    items = sample.items() if isinstance(sample, dict) else enumerate(sample)
    shapes = [" ".join(x for x in (f"{key}:" if isinstance(key, str) else "", "×".join(map(str, t.shape[1:])),
                                   str(t.dtype).removeprefix("torch.")) if x) for key, t in items]
    return {"name": name, "model": kind, "parameters": sum(p.numel() for p in model.parameters()),
            "sample": ", ".join(shapes)}


def cmd_doctor(args) -> int:
    """Four doctors behind one door: --oom explains an out-of-memory message (with a workload, what the step
    holds at its peak and the fastest configuration that fits); a snapshot pickle is explained; a workload is
    watched for leaks over --steps real steps; --serve calls a request handler --requests times and says what
    the requests leave alive."""
    from memfit.memory.devices import get_device

    _check_counts(args, "micro_batch", "grad_accum", "steps", "pp")
    if args.serve is not None:
        from memfit.runtime.leaks import load_handler, watch_service

        if args.target or args.oom is not None:
            raise ConfigError("--serve watches a request handler on its own; leave out the workload, snapshot or --oom")
        report = watch_service(load_handler(args.serve), args.requests, name=args.serve)
        print(report.render())
        return 1 if report.growing else 0  # as for leaks in training steps: growth fails a script
    if args.oom is not None:
        from memfit.memory.snapshot import explain_oom, parse_oom_message

        parsed = parse_oom_message(args.oom)
        if parsed is None:
            raise ConfigError("--oom: not a CUDA out-of-memory message (it reads \"CUDA out of memory. Tried to "
                              "allocate ...\"); paste the whole line")
        for line in explain_oom(parsed):
            print(line)
        if args.target:
            _doctor_oom_plan(args, parsed)
        return 0
    if not args.target:
        raise ConfigError("doctor needs a workload, a snapshot (.pickle) or --oom MESSAGE")
    if Path(args.target).suffix in (".pickle", ".pkl"):
        from memfit.memory.snapshot import explain_snapshot, render

        context = get_device(args.device).context_bytes if args.device else 0
        print(render(explain_snapshot(args.target, context_bytes=context)))
        return 0
    from memfit.runtime.leaks import find_leaks

    if args.device and get_device(args.device).kind != "cpu":
        raise ConfigError("the leak finder runs real steps on this machine's CPU; leave out --device")
    _one_process(args, "the leak finder runs real steps in this one process")
    args.workload = args.target
    report = find_leaks(_workload(args), _config(args), steps=args.steps)
    print(report.render())
    return 1 if report.leaks else 0  # like a linter: a leak found fails a script that runs the doctor


def _doctor_oom_plan(args, parsed: dict) -> None:
    """What the workload's step holds at its peak and the fastest configuration that fits the GPU's memory."""
    from memfit.memory.devices import get_device
    from memfit.memory.estimate import estimate
    from memfit.planner.costmodel import step_time_caveat
    from memfit.planner.search import plan
    from memfit.units import fmt_bytes, fmt_seconds

    if not args.device:
        raise ConfigError("with a workload, --oom needs the GPU: --device h100 (a100-80gb, rtx-4090, ...)")
    device = get_device(args.device)
    args.workload = args.target
    workload, config = _workload(args), _config(args, device)
    est = estimate(workload, config, device=device)
    held = ", ".join(f"{c} {fmt_bytes(n)}" for c, n in est.breakdown.items() if n)
    print(f"{workload.name} at {config.describe()} on {device.name}: peak {fmt_bytes(est.peak_bytes)} in "
          f"{est.peak_phase} ({held}); nvidia-smi would show {fmt_bytes(est.device_peak_bytes or est.peak_bytes)}")
    blocks = ", ".join(f"{m} {fmt_bytes(n)}" for m, n in est.modules[:3])
    if blocks:
        print(f"  largest activations then: {blocks}")
    budget = parsed.get("total") or device.memory_bytes
    try:
        best = plan(workload, config.global_batch, budget=budget, device=device)
    except PlanError as e:
        print(f"no configuration of global batch {config.global_batch} fits {fmt_bytes(budget)}: {e}")
        return
    caveat = step_time_caveat(best.profile_source)
    print(f"fastest configuration that fits {fmt_bytes(budget)}: {best.config.describe()} — peak "
          f"{fmt_bytes(best.peak_bytes)}, {fmt_seconds(best.step_seconds)} a step"
          f"{f' ({caveat})' if caveat else ''} (`memfit plan` explains the choice)")


def cmd_infer(args) -> int:
    """Serving memory: what fits, for vLLM (sized on the device) or transformers (run on this CPU with --run)."""
    settings = dict(max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization, tp=args.tp,
                    block_size=args.block_size, vllm_version=args.vllm_version)
    if args.run:
        from memfit.inference.run import run_generate_batch

        plan = {}
        if args.engine == "transformers":  # the GPU plan's ContinuousBatchingConfig, run in the model's dtype
            from memfit.inference.kv import model_dtype
            from memfit.inference.serve import infer, model_config

            planned = infer(args.model, device=args.device, engine="transformers", **settings)
            plan = dict(num_blocks=planned.num_blocks, max_batch_tokens=planned.settings["max_num_batched_tokens"],
                        dtype=model_dtype(model_config(args.model)))
        result = run_generate_batch(args.model, requests=args.concurrency or 4, context=args.context or 256, **plan)
        print(json.dumps(result) if args.json else result["summary"])
        return 0
    from memfit.inference.serve import infer, inverse

    if (args.concurrency is None) != (args.context is None):
        raise ConfigError("--concurrency and --context go together: N requests of L tokens each")
    answer = None
    if args.concurrency is not None:
        answer = inverse(args.model, args.concurrency, args.context, device=args.device, engine=args.engine,
                         **{k: v for k, v in settings.items() if k not in ("max_model_len", "gpu_memory_utilization")})
        result = answer["inference"]
    else:
        result = infer(args.model, device=args.device, engine=args.engine, **settings)
    if args.json:
        out = result.to_dict()
        if answer:
            out["inverse"] = {k: v for k, v in answer.items() if k != "inference"}
        print(json.dumps(out))
    else:
        from rich.console import Console

        from memfit.inference.view import render
        Console().print(render(result, answer))
    return 0


def cmd_list(args) -> int:
    from memfit.memory.devices import DEVICES, aliases_of, device_names
    from memfit.workloads import BUILTIN_NAMES
    from memfit.workloads.hf import SMALL_CONFIGS

    names = [n for n in BUILTIN_NAMES if not n.startswith("hf:")] + [f"hf:{t}" for t in SMALL_CONFIGS]
    workloads = [_describe_workload(n) for n in names]
    gpus = [{"name": n, "description": DEVICES[n].description, "memory_bytes": DEVICES[n].memory_bytes,
             "bf16": DEVICES[n].bf16, "aliases": aliases_of(n)} for n in device_names()]
    if args.json:
        print(json.dumps({"workloads": workloads, "devices": gpus}))
        return 0
    from rich.console import Console
    from rich.table import Table

    from memfit.units import fmt_bytes
    console = Console()
    console.width = max(console.width, 120)
    table = Table(title="built-in workloads (memfit estimate NAME; options: --seq, -o key=value)",
                  title_justify="left", show_edge=False)
    for col in ("name", "model", "parameters", "one sample"):
        table.add_column(col, justify="right" if col == "parameters" else "left")
    for w in workloads:
        table.add_row(w["name"], w["model"], f"{w['parameters']:,}" if w["parameters"] is not None else "-", w["sample"])
    console.print(table)
    console.print(f"{', '.join(f'hf:{t}' for t in SMALL_CONFIGS)} are toy sizes for a quick check, not the "
                  "published models; "
                  "hf:path/to/config.json builds the real architecture from its config (no weights are downloaded).",
                  style="dim")
    table = Table(title="GPU catalogue (--device NAME)", title_justify="left", show_edge=False)
    for col in ("name", "card", "memory", "bf16", "also typed as"):
        table.add_column(col, justify="right" if col == "memory" else "left")
    for g in gpus:
        table.add_row(g["name"], g["description"], fmt_bytes(g["memory_bytes"]), "yes" if g["bf16"] else "no",
                      ", ".join(g["aliases"]) or "-")
    console.print(table)
    console.print("memory is what PyTorch can use (below the marketed size). Names ignore case, and the card's own "
                  "spellings work too (h100-80gb, 'NVIDIA A100-SXM4-40GB'); --device cpu is this machine, cuda the "
                  "GPU present.", style="dim")
    return 0


def _add_estimate_command(sub) -> None:
    """`memfit estimate`: one step's peak for one configuration."""
    p = sub.add_parser("estimate", help="peak memory of one training step, traced on fake tensors")
    _add_workload_args(p)
    _add_config_args(p)
    p.add_argument("--device", default="cpu", help="cpu, cuda, or a catalogue GPU: h100, a100-80gb, rtx-4090, ...")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--html", metavar="PATH", help="the step's memory timeline as one self-contained HTML page: "
                                                  "by category and block, the peak's tensors with their source lines")
    p.add_argument("--plot", metavar="PNG", help="the step's memory timeline as a PNG chart")
    p.add_argument("--blocks", choices=("all", "auto"),
                   help="auto (the default): a deep model's step counted from copies of 1, 2 and 3 blocks (of its "
                        "layer pattern's period for a hybrid, or 0, 1 and 2 periods), checked event for event "
                        "against the third, where the copies, two at a time, hold at most half its blocks on a core "
                        "and three quarters in all; its lists name a block's modules with '#' for the index. all: "
                        "every block traced (the default with --html or --plot, which draw the step's timeline)")
    p.set_defaults(fn=cmd_estimate)


def _add_plan_command(sub) -> None:
    """`memfit plan`: the search, the choices a user may fix, and what the answer is written as."""
    p = sub.add_parser("plan", help="the fastest configuration that fits a memory budget")
    _add_workload_args(p)
    p.add_argument("--global-batch", type=int, help="samples per optimizer step")
    p.add_argument("--budget", help="memory budget: 24GiB, 80GB, bytes, or 50%% of the device (default: all of it)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, or a catalogue GPU")
    p.add_argument("--micro-batch", type=int, help="fix the micro-batch")
    p.add_argument("--precision", choices=PRECISIONS, help="fix the precision: " + _PRECISION_HELP)
    p.add_argument("--activation-checkpoint", "--checkpoint", type=_activation_checkpoint_arg,
                   help="fix activation checkpointing: none | all | selective | selective-op | k | name,name,... "
                        "(--checkpoint: the old spelling, read until 0.3)")
    p.add_argument("--offload-activations", action="store_true", help="force activation offload")
    p.add_argument("--offload-optimizer", action="store_true", help="force optimizer offload")
    p.add_argument("--max-micro-batch", action="store_true", help="the largest micro-batch that fits, config fixed")
    p.add_argument("--gpus", default="1",
                   help="plan per rank for this many GPUs, or a range (8-512: each power of two in it, a table) "
                        "(default: %(default)s)")
    p.add_argument("--data-parallel", choices=LAYOUTS, help="fix the layout across ranks (default: searched)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node, hsdp's shard group (default: 8)")
    p.add_argument("--allow", metavar="TECHNIQUE,...", help=_ALLOW_HELP)
    p.add_argument("--host-memory", metavar="SIZE",
                   help="host memory offloading may use on the GPU's machine, e.g. 64GiB (default: not limited; "
                        "the plan says what it needs)")
    p.add_argument("--verify", action="store_true", help="run the plan for a few real steps and compare")
    p.add_argument("--verify-steps", type=int, default=3, help="real steps --verify times (default: %(default)s)")
    p.add_argument("--plot", metavar="PNG", help="with a range of --gpus: throughput and scaling efficiency by count")
    p.add_argument("--emit", choices=("trainer", "trl"),
                   help="plan only what Hugging Face Trainer runs and print it as TrainingArguments keywords and the "
                        "flags HfArgumentParser reads (trainer), or as a `trl sft` command line (trl)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(fn=cmd_plan)


def _add_train_command(sub) -> None:
    """`memfit train`: the run, its checkpoints and resume, and where its ranks run."""
    p = sub.add_parser("train", help="run training: plan, recover from OOM, checkpoint, resume, report")
    p.add_argument("workload", nargs="?", default="sort",
                   help="as for estimate; default: a small GPT learning to sort digits")
    _add_workload_options(p)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps to run (default: %(default)s)")
    p.add_argument("--global-batch", type=int, default=64, help="samples per optimizer step (default: %(default)s)")
    p.add_argument("--budget", help="memory budget (on a CPU: a virtual device of that size)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda / cuda:N, the GPU present")
    p.add_argument("--micro-batch", type=int, help="start from this micro-batch instead of planning")
    p.add_argument("--precision", choices=PRECISIONS, help="fix the precision (default: planned): " + _PRECISION_HELP)
    p.add_argument("--config", help="start from this configuration instead of planning: a Config as JSON, or a file "
                                    "holding one or a plan (memfit plan --json > plan.json)")
    p.add_argument("--allow", metavar="TECHNIQUE,...", help="for the plan a run makes: " + _ALLOW_HELP)
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the model's initial weights, the data and dropout (default: %(default)s)")
    p.add_argument("--out", help="run folder (default: a new one under ./runs/)")
    p.add_argument("--checkpoint-every", type=int, default=100, metavar="N",
                   help="save a checkpoint every N steps, and at the end and on Ctrl-C (default: %(default)s)")
    p.add_argument("--keep-checkpoints", type=int, default=2, metavar="N",
                   help="checkpoints the run folder keeps, the newest N; an older one is deleted once a newer one is "
                        "complete (default: %(default)s)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    p.add_argument("--schedule", choices=["cosine", "onecycle", "constant"],
                   help="learning-rate schedule, which changes the optimizer's own rate. cosine (the default): linear "
                        "warm-up over the first 5%% of steps to the optimizer's rate, then down to 10%% of it at the "
                        "end; onecycle: from 1/25 of it up to it and down to 1/250,000 of it; constant: the "
                        "optimizer's rate throughout. The run prints the rates; with --resume, the run's own")
    p.add_argument("--deterministic", action="store_true", default=None,
                   help="deterministic kernels and a fixed thread count, so that a resumed run ends bit for bit as "
                        "the uninterrupted run would (same machine and PyTorch); with --resume, as the run started")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the final report still prints)")
    p.add_argument("--gpus", type=int, default=1,
                   help="ranks to train on: started here under torch's elastic agent, torchrun's launcher (N CPU "
                        "processes with gloo on a CPU), or the world of an outside launcher (default: %(default)s)")
    p.add_argument("--data-parallel", choices=[x for x in LAYOUTS if x not in ("none", "hsdp")],
                   help="layout across ranks (default: fsdp)")
    p.add_argument("--tp", type=int, default=1,
                   help="of the --gpus ranks, how many split each block's matmuls (tensor parallel); the data-parallel "
                        "ranks are gpus / tp (default: %(default)s)")
    _add_pipeline_args(p, "of the --gpus ranks, how many pipeline stages the repeated blocks split over; the "
                          "data-parallel ranks are gpus / (pp x tp), each stage's own fsdp ranks")
    p.set_defaults(fn=cmd_train)


def _add_doctor_command(sub) -> None:
    """`memfit doctor`: leaks in real steps, an allocator snapshot, an OOM message, a serving handler."""
    p = sub.add_parser("doctor", help="explain memory: leaks in a workload's real steps, a CUDA allocator "
                                      "snapshot (.pickle), or an out-of-memory message (--oom)")
    p.add_argument("target", nargs="?", help="a workload (watched for leaks) or a snapshot from "
                                             "torch.cuda.memory._dump_snapshot (.pickle)")
    _add_workload_options(p)
    _add_config_args(p)
    p.add_argument("--steps", type=int, default=20, help="real steps the leak finder watches (default: %(default)s)")
    p.add_argument("--oom", metavar="MESSAGE", help="a CUDA out-of-memory message to explain; with a workload and "
                                                    "--device, also what its step holds and a configuration that fits")
    p.add_argument("--device", help="the GPU: its context size for a snapshot, its catalogue entry for --oom")
    p.add_argument("--serve", metavar="FILE.py:FUNCTION", help="a serving process's request handler (or "
                   "module:function), called with no arguments once a request in this process: which tensors the "
                   "requests leave alive and what keeps them, told from memory the allocator only caches")
    p.add_argument("--requests", type=int, default=20, help="requests --serve makes (default: %(default)s)")
    p.set_defaults(fn=cmd_doctor)


def _add_infer_command(sub) -> None:
    """`memfit infer`: serving memory as an engine sizes it."""
    p = sub.add_parser("infer", help="serving memory: KV cache tokens and concurrent requests that fit (vLLM), "
                                     "or a real continuous-batching run on this CPU (--run)")
    p.add_argument("model", help="hf:path/to/config.json, a cached Hub id (hf:org/name) or a model type (hf:llama)")
    p.add_argument("--device", default="h100", help="the GPU serving it (default: %(default)s)")
    p.add_argument("--engine", default="vllm", help="vllm (default) or transformers (continuous batching: "
                                                   "num_blocks and max_batch_tokens; with --run, served on this CPU)")
    p.add_argument("--max-model-len", type=int, help="longest request in tokens (default: the model's positions)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM's share of the GPU (default: 0.9)")
    p.add_argument("--max-num-seqs", type=int, help="requests per step (default: vLLM's for the GPU: 1024 on 70 GiB "
                                                    "and more, else 256)")
    p.add_argument("--max-num-batched-tokens", type=int, help="tokens per step, the profile run's (default: 8192 on "
                                                              "70 GiB and more, else 2048)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's) or fp8")
    p.add_argument("--quantization", default="none", help="weights: none, fp8, int8 (W8A8) or int4 (AWQ/GPTQ)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks; figures are per rank")
    p.add_argument("--block-size", type=int, help="tokens per KV block (default: 16)")
    p.add_argument("--vllm-version", default="0.19", help="the vLLM release whose profile run is traced: its "
                                                          "sampler changed in 0.17 (default: %(default)s)")
    p.add_argument("--concurrency", type=int, help="with --context: the smallest setting that holds this many requests")
    p.add_argument("--context", type=int, help="with --concurrency: tokens per request")
    p.add_argument("--run", action="store_true", help="generate with transformers' continuous batching on this CPU "
                                                      "with the planned cache and compare the peak with the estimate")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(fn=cmd_infer)


def _add_calibrate_command(sub) -> None:
    """`memfit calibrate`: this machine's rates for the step-time model."""
    p = sub.add_parser("calibrate", help="measure this machine's device for the step-time model")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="this machine's CPU (default) or the GPU present")
    p.add_argument("--json", action="store_true", help="the profile as one JSON object on stdout")
    p.set_defaults(fn=cmd_calibrate)


def _add_list_command(sub) -> None:
    """`memfit list`: the built-ins and the GPU catalogue."""
    p = sub.add_parser("list", help="the built-in workloads and the GPU catalogue")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(fn=cmd_list)


def _add_summary_command(sub) -> None:
    """`memfit summary`: the per-module table."""
    p = sub.add_parser("summary", help="per-module table: output shapes, parameters, saved activations, FLOPs")
    _add_workload_args(p)
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="the rows as one JSON list on stdout")
    p.set_defaults(fn=cmd_summary)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memfit", description="Fit a PyTorch training run into the memory you have.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--version", action="version", version=f"memfit {__version__}", help="print the version")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_estimate_command(sub)
    _add_plan_command(sub)
    _add_train_command(sub)
    _add_doctor_command(sub)
    _add_infer_command(sub)
    _add_calibrate_command(sub)
    _add_list_command(sub)
    _add_summary_command(sub)

    for p in sub.choices.values():  # --debug anywhere on the line; SUPPRESS keeps `memfit --debug cmd` working
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    return parser


@contextlib.contextmanager
def _progress_line():
    """A plan that traces for more than 2 s says what it traces on stderr: one line rewritten in place on a
    terminal, a line per stage (and at most one every 5 s) otherwise; the line is cleared when it ends."""
    from memfit.planner.search import progress_to

    tty = sys.stderr.isatty()
    last = {"stage": None, "at": 0.0, "shown": False}

    def write(text: str) -> None:
        stage = text.rpartition(":")[0]
        now = time.monotonic()
        if tty:
            sys.stderr.write(f"\r\033[Kmemfit: {text}")
        elif stage != last["stage"] or now - last["at"] >= 5:
            sys.stderr.write(f"memfit: {text}\n")
        else:
            return
        sys.stderr.flush()
        last.update(stage=stage, at=now, shown=True)

    try:
        with progress_to(write):
            yield
    finally:
        if tty and last["shown"]:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = False
    try:
        args = build_parser().parse_args(argv)
        args.argv = list(argv)
        debug = args.debug
        with _progress_line() if args.fn in (cmd_plan, cmd_train) else contextlib.nullcontext():
            return args.fn(args)
    except KeyboardInterrupt as e:  # a run says which checkpoint it wrote or left intact
        print(f"memfit: {e}" if str(e) else "memfit: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the user gets one line, the developer --debug
        if debug:
            raise
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"memfit: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
