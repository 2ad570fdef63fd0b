"""`train`: a whole run. Plan (unless told), then step: data seeded by (seed, step), OOM recovery that
redoes the same global batch with more memory savings, atomic checkpoints, exact resume, metrics, report.

Follow one step in `_Run.loop`: draw the global batch -> `Trainer.step` -> on OOM, `_recover` picks the
next configuration and the same batch is run again -> a non-finite loss stops the run -> log a metrics
line -> maybe checkpoint.

Nothing is written before everything that can be checked has been: the arguments, and on `--resume` the
newest intact checkpoint and the run it belongs to (workload, seed, global batch, precision, length, LR
schedule, determinism), which every checkpoint records.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import gc
import json
import math
import os
import signal
import threading
import time
import warnings
from pathlib import Path

import torch

from memfit.config import Config
from memfit.errors import ConfigError, RunError, WorkloadError, first_line, raised_at
from memfit.memory.devices import defaults_for, get_device
from memfit.memory.isolate import available_host_bytes
from memfit.memory.kernels import CpuWorkspaces
from memfit.memory.measure import measure_step
from memfit.memory.tracker import LiveBytes
from memfit.planner.costmodel import describe, profile_for, step_time_caveat
from memfit.runtime import checkpoints as ckpt
from memfit.runtime import distributed, noise
from memfit.runtime.trainer import Trainer
from memfit.torch_internals import held_by
from memfit.units import fmt_bytes
from memfit.workload import Workload

SCHEDULES = ("cosine", "onecycle", "constant")
HOST_SHARE = 0.8  # of this machine's available memory, what a planned run's offloading may take


@dataclasses.dataclass
class RunResult:
    """What `train` returns: the run folder (`out`: checkpoints, metrics.jsonl, report.json, plots), the steps
    done, the final configuration (OOM recovery may have moved it), the last loss, every metrics record and
    the report (predicted vs measured per configuration)."""
    out: Path
    steps: int
    config: Config
    final_loss: float
    metrics: list
    report: dict
    already_complete: bool = False  # --resume found the run finished and touched nothing


@dataclasses.dataclass
class Prediction:
    """What memfit predicted for one configuration. `peak_bytes` is the figure comparable with the run's
    measurement: live tensor bytes on a CPU, `max_memory_allocated` on a GPU. `source` is "plan" when the
    figures are the plan's own (plan.json), "estimate" when this configuration was estimated for the run.
    `profile` is the `describe` line of the calibration that priced `step_seconds`: a rejected one's mark
    goes with the step time wherever it is shown (`costmodel.step_time_caveat`)."""
    config: Config
    peak_bytes: int | None
    step_seconds: float | None
    source: str
    estimate: object = None  # the Estimate, when there is one in this process (for memory.png)
    profile: str | None = None

    @property
    def described(self) -> str:
        """`source`, with what its step time is worth when a rejected calibration priced it."""
        caveat = step_time_caveat(self.profile) if self.step_seconds is not None else None
        return f"{self.source} ({caveat})" if caveat else self.source


def lr_lambda(schedule: str, steps: int, warmup: int):
    """Multiplier of the optimizer's lr at each step: linear warm-up then cosine to 10%, or constant."""
    if schedule == "constant":
        return lambda s: 1.0

    def cosine(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        progress = min(1.0, (s - warmup) / max(1, steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return cosine


def make_scheduler(optimizer, schedule: str, steps: int, warmup: int):
    if schedule == "onecycle":  # super-convergence: max lr = the optimizer's lr
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[g["lr"] for g in optimizer.param_groups],
                                                   total_steps=steps)
    if schedule not in ("cosine", "constant"):
        raise ConfigError(f"unknown schedule {schedule!r}; choose cosine, onecycle or constant")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(schedule, steps, warmup))


def schedule_rates(schedule: str, lr: float, steps: int, warmup: int, at: list[int]) -> list[float]:
    """The rate each step in `at` (counted from 0) trains at when `schedule` drives an optimizer of rate `lr`:
    read off `make_scheduler`'s own scheduler on a stand-in optimizer, jumped to each step (both schedulers
    compute a step's rate from its number alone), so a run says what it will do, not a copy of the formula."""
    scheduler = make_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr), schedule, steps, warmup)
    rates = []
    with warnings.catch_warnings():  # get_lr() outside step() warns that get_last_lr() is the usual way
        warnings.simplefilter("ignore")
        for step in at:
            scheduler.last_epoch = step
            rates.append(scheduler.get_lr()[0])
    return rates


def schedule_line(schedule: str, lr: float, steps: int, warmup: int) -> str:
    """What the schedule does to the optimizer's own rate `lr`, in one line that a run prints before its first
    step: the default cosine ends a run at a tenth of the rate the workload asked for."""
    if schedule == "constant":
        return f"learning rate: constant, the optimizer's own {lr:.3g}"
    first, last = schedule_rates(schedule, lr, steps, warmup, [0, steps - 1])
    rise = (f"from the optimizer's {lr:.3g}" if first >= lr else
            f"from {first:.3g} up to the optimizer's {lr:.3g}"
            + (f" over {warmup} warm-up steps" if schedule == "cosine" else "") + ", then")
    return (f"learning rate: {schedule} schedule, {rise} down to {last:.3g} at step {steps} (--schedule constant "
            "keeps the optimizer's own)")


GROWTH_STEPS = 8  # live memory between steps rising over this many steps in a row (but one) is a leak
GROWTH_WARNING = "warning: live memory between steps"


def recovery_ladder(config: Config, global_batch: int) -> list[Config]:
    """What to try after an OOM, in order: halve the micro-batch (more accumulation, same global batch),
    then checkpoint selectively, then every block (a pipeline skips micro-batches that do not split the batch
    evenly: its schedule's buffers have one shape). Precision and optimizer offload are never changed: they
    would change the math or the optimizer's state layout. The optimizer step in backward takes one
    micro-batch a step: only its checkpointing changes."""
    out, m = [], config.micro_batch
    while m > 1 and not config.optimizer_in_backward:
        m = max(1, m // 2)
        if config.pp > 1 and global_batch % m:  # a pipeline's micro-batches are of one shape (its buffers')
            continue
        try:
            out.append(config.replace(micro_batch=m, grad_accum=math.ceil(global_batch / m)))
        except ConfigError:  # an interleaved schedule's rounds of micro-batches do not divide this many
            continue
    last = out[-1] if out else config
    for ck in ("selective", "all"):
        if last.activation_checkpoint in ("none", "selective") and ck != last.activation_checkpoint:
            out.append(last.replace(activation_checkpoint=ck))
    if last.activation_checkpoint == "selective-op":  # keeps less than memfit's selective: only "all" is below it
        out.append(last.replace(activation_checkpoint="all"))
    return out


# ------------------------------------------------------------------------------------------ predictions


def _comparable_peak(est) -> int:
    """The estimate's figure for what a run measures: allocator-rounded bytes on a GPU, live bytes on a CPU."""
    return est.peak_allocated_bytes if est.peak_allocated_bytes is not None else est.peak_bytes


def from_plan(p) -> Prediction:
    """The plan's own figures: what plan.json says is what the report compares with."""
    return Prediction(p.config, _comparable_peak(p.estimate), p.step_seconds, "plan", p.estimate, p.profile_source)


def predict(workload: Workload, config: Config, dev) -> Prediction:
    """Peak and step time of `config`, priced as the planner prices a confirmed candidate (a long
    accumulation traced as two micro-steps), so `memfit plan` and a run at the same configuration say the
    same. Across ranks the step time is not predicted (communication is not modelled in a run's report
    yet), and this machine's CPU is not calibrated for it."""
    from memfit.planner.search import price

    profile = profile_for(dev) if config.world == 1 else None
    est, seconds = price(workload, config, dev, profile=profile, timed=profile is not None)
    return Prediction(config, _comparable_peak(est), seconds, "estimate", est,
                      describe(profile) if profile else None)


def _saved_plan(out: Path, config: Config) -> Prediction | None:
    """On resume: the first session's plan.json figures, when the run is still at the planned configuration."""
    try:
        saved = json.loads((out / "plan.json").read_text())
    except (OSError, ValueError):
        return None
    if Config.from_dict(saved["config"]) != config:
        return None
    est = saved.get("estimate") or {}
    peak = est.get("peak_allocated_bytes") or est.get("peak_bytes")
    return Prediction(config, peak, saved.get("step_seconds"), "plan", profile=saved.get("profile"))


# ------------------------------------------------------------------------------------------ determinism


@contextlib.contextmanager
def deterministic_mode(on: bool, threads: int):
    """Same inputs, same bits, for the length of a run: deterministic kernels where PyTorch has a choice
    (`use_deterministic_algorithms`, cuDNN without autotuning, cuBLAS with a fixed workspace) and a fixed
    number of intra-op threads, because a CPU reduction split over another number of threads adds in
    another order. The process's previous settings come back afterwards."""
    if not on:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.get_num_threads(), torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts; harmless on a CPU
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.set_num_threads(before[2])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[3], before[4]


# ------------------------------------------------------------------------------------------ checks


def _check_arguments(steps, global_batch, micro_batch, checkpoint_every, keep_checkpoints, warmup, schedule) -> None:
    for name, value, least in (("steps", steps, 1), ("global batch", global_batch, 1),
                               ("micro-batch", micro_batch, 1), ("checkpoint_every", checkpoint_every, 1),
                               ("keep_checkpoints", keep_checkpoints, 1), ("warmup", warmup, 0)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise ConfigError(f"{name} must be a whole number >= {least}, got {value!r}")
    if schedule is not None and schedule not in SCHEDULES:
        raise ConfigError(f"unknown schedule {schedule!r}; choose {', '.join(SCHEDULES)}")


def _check_resume(path: Path, state: dict, workload: Workload, *, seed, global_batch, steps, schedule, warmup,
                  deterministic, precision) -> dict:
    """Refuse a resume that would not continue the run the checkpoint belongs to; return the run's identity
    with what was not given filled in from the checkpoint."""
    saved = state.get("run") or {}
    data = state["data_state"]
    config = Config.from_dict(state["config"])
    at = state["step"]
    if saved.get("workload", workload.name) != workload.name:
        raise RunError(f"{path}: this folder holds a run of workload {saved['workload']!r}, not {workload.name!r}; "
                       f"resume it with {saved['workload']!r}, or start the new run in another folder")
    if data.get("seed") != seed or data.get("global_batch") != global_batch:
        raise RunError(f"{path}: saved with seed {data.get('seed')} and global batch {data.get('global_batch')}; "
                       f"resuming with seed {seed} and global batch {global_batch} would change the data")
    if precision is not None and precision != config.precision:
        raise RunError(f"{path}: the run trains in {config.precision}; resuming in {precision} would change the math "
                       f"and the optimizer state; resume without --precision or with --precision {config.precision}")
    saved_schedule = saved.get("schedule") or schedule or "cosine"
    if schedule is not None and saved_schedule != schedule:
        raise RunError(f"{path}: the run's LR schedule is {saved_schedule}; resume without --schedule or with "
                       f"--schedule {saved_schedule}")
    schedule = saved_schedule
    saved_steps = saved.get("steps") or (state.get("scheduler") or {}).get("total_steps") or steps
    if at > steps:
        raise RunError(f"{path}: the run is already at step {at}, past --steps {steps}; resume with --steps "
                       f"{max(saved_steps, at)} (or start a shorter run in another folder)")
    if saved_steps != steps and schedule != "constant":
        raise RunError(f"{path}: its {schedule} LR schedule spans {saved_steps} steps and cannot be stretched to "
                       f"{steps}; resume with --steps {saved_steps}")
    saved_warmup = saved.get("warmup", warmup)
    if warmup is not None and saved_warmup != warmup:
        raise RunError(f"{path}: the run warms up over {saved_warmup} steps; resume without --warmup")
    clip = saved.get("max_grad_norm")  # runs saved before clipping existed did not clip
    if clip != workload.max_grad_norm:
        fix = f"--max-grad-norm {clip}" if clip is not None else "no --max-grad-norm"
        raise RunError(f"{path}: the run clips gradients at {clip if clip is not None else 'no norm'}; resuming "
                       f"with max_grad_norm {workload.max_grad_norm} would change the math; resume with {fix}")
    saved_det = bool(saved.get("deterministic", False))
    if deterministic is not None and deterministic != saved_det:
        raise RunError(f"{path}: the run was started {'with' if saved_det else 'without'} --deterministic; "
                       f"resume it {'with' if saved_det else 'without'} it")
    return dict(workload=workload.name, seed=seed, global_batch=global_batch, steps=steps, schedule=schedule,
                warmup=saved_warmup if saved_warmup is not None else max(1, steps // 20),
                max_grad_norm=workload.max_grad_norm, deterministic=saved_det,
                threads=int(saved["threads"]) if saved_det else torch.get_num_threads())


class _Run:
    def __init__(self, workload: Workload, identity: dict, out: Path, device: str, config: Config,
                 budget: int | None, checkpoint_every: int | None, keep_checkpoints: int, console,
                 predictions: dict):
        self.workload, self.identity, self.out, self.device = workload, identity, out, device
        self.steps, self.global_batch, self.seed = identity["steps"], identity["global_batch"], identity["seed"]
        self.budget, self.console, self.checkpoint_every = budget, console, checkpoint_every
        self.keep_checkpoints = keep_checkpoints
        self.predictions = predictions  # Config -> Prediction, for predicted vs measured
        self.trainer = Trainer(workload, config, device=device, seed=self.seed, global_batch=self.global_batch)
        self.rank = torch.distributed.get_rank() if config.world > 1 else 0  # only rank 0 writes the run folder
        console.print(schedule_line(identity["schedule"], self.trainer.optimizer.param_groups[0]["lr"], self.steps,
                                    identity["warmup"]))
        self.scheduler = make_scheduler(self.trainer.optimizer, identity["schedule"], self.steps, identity["warmup"])
        self.metrics_path = out / "metrics.jsonl"
        self.stop_requested = False
        self.saved_step: int | None = None  # the newest checkpoint this run wrote or resumed from
        self.refusals: dict = {}  # activation checkpointing -> why its probe failed, or None
        self.pending: dict[int, list[str]] = {}  # step -> events to log with it (an OOM on another launch)
        self.live: list[int] = []  # tensor bytes live after each step in this configuration, where known
        self.growth_said: str | None = None
        self.tracker = None
        if budget is not None and device == "cpu":  # a virtual device: count live bytes, OOM past the budget
            self.tracker = LiveBytes("cpu", budget=budget, detail=False, workspace=CpuWorkspaces())
        elif budget is not None and device.startswith("cuda"):
            total = torch.cuda.get_device_properties(torch.device(device)).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), torch.device(device))

    # -------------------------------------------------------------------------------- checkpoints
    def intact(self) -> str:
        return ckpt.intact(self.out)

    def save(self, step: int) -> Path:
        """Checkpoint `step`, unless it already is; never with non-finite weights. A full disk or a Ctrl-C
        during the write becomes one line saying which checkpoint is intact (the write is atomic)."""
        path = ckpt.checkpoint_path(self.out, step)
        if self.saved_step == step:
            return path
        e = self.trainer.engine
        if self.trainer.config.world > 1:
            return self._save_ranks(step)
        noise = self.trainer.noise  # its moving averages go on after a resume
        bad = next((n for n, p in e.model.named_parameters() if not torch.isfinite(p).all()), None)
        if bad is not None:
            raise RunError(f"step {step}: parameter {bad} holds NaN or inf, so it was not saved; {self.intact()}")
        try:
            path = ckpt.save_checkpoint(self.out, step, model=e.model, optimizer=e.optimizer, scaler=e.scaler,
                                        scheduler=self.scheduler, config=self.trainer.config,
                                        data_state={"seed": self.seed, "global_batch": self.global_batch},
                                        optimizer_offload=e.optimizer_offload, run=self.identity,
                                        keep=self.keep_checkpoints,
                                        noise=noise.state_dict() if noise is not None else None)
        except OSError as err:
            raise RunError(self._save_failed(err, step)) from err
        except KeyboardInterrupt:
            raise KeyboardInterrupt(f"interrupted while saving step {step}; {self.intact()}") from None
        self.saved_step = step
        return path

    def _save_failed(self, err: OSError, step: int) -> str:
        what = "disk full" if err.errno in (errno.ENOSPC, errno.EDQUOT) else f"{err.strerror or err}"
        return f"{what} while saving step {step}; {self.intact()}"

    def _save_ranks(self, step: int) -> Path:
        """Every rank writes its shards, rank 0 commits the checkpoint, and all learn whether it succeeded."""
        e = self.trainer.engine
        bad = next((n for n, p in e.model.named_parameters()  # this rank's shards
                    if not all(torch.isfinite(x).all() for x in held_by(p))), None)
        bad = next((b for b in distributed.gather(bad) if b is not None), None)
        if bad is not None:
            raise RunError(f"step {step}: parameter {bad} holds NaN or inf, so it was not saved; {self.intact()}")
        try:
            path = ckpt.save_sharded(self.out, step, model=e.model, optimizer=e.optimizer, scheduler=self.scheduler,
                                     config=self.trainer.config,
                                     data_state={"seed": self.seed, "global_batch": self.global_batch},
                                     run=self.identity, keep=self.keep_checkpoints,
                                     flat_optimizer=self.trainer.config.pp > 1)
        except OSError as err:
            raise RunError(self._save_failed(err, step)) from err
        self.saved_step = step
        return path

    def restore(self, path: Path, state: dict) -> int:
        e = self.trainer.engine
        ckpt.restore(state, model=e.model, optimizer=e.optimizer, scaler=e.scaler, scheduler=self.scheduler,
                     optimizer_offload=e.optimizer_offload, path=path)
        self.trainer.step_count = self.saved_step = state["step"]
        self._forget_metrics_from(state["step"])
        if self.trainer.noise is not None:  # the noise scale's moving averages go on where they stopped
            if state.get("noise") is not None:
                self.trainer.noise.load_state_dict(state["noise"])
            else:  # a checkpoint written before they were saved with it: the metrics kept above hold them
                self.trainer.noise.replay(_history(self.out))
        self._log_event(state["step"], f"resumed from {path.name}")
        self.console.print(f"resumed from {path} (step {state['step']} of {self.steps}, "
                           f"{self.trainer.config.describe()})")
        return state["step"]

    def _forget_metrics_from(self, step: int) -> None:
        """A killed run may have logged steps after its last checkpoint; they are run again now, so their old
        records go (one record per step). A line cut short by the kill goes too. Rewritten atomically."""
        if self.rank != 0 or not self.metrics_path.exists():
            return
        kept = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not ("loss" in rec and rec.get("step", -1) >= step):
                kept.append(line + "\n")
        tmp = self.metrics_path.with_name(self.metrics_path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.metrics_path)

    # -------------------------------------------------------------------------------- one step
    def _measured_step(self, batch, measure: bool) -> tuple[float, int | None]:
        """One step; its peak is measured on a GPU, and on a CPU under a budget or when `measure` (a live-bytes
        counter costs a few microseconds an op, so a CPU run without a budget measures only its first steps)."""
        if self.tracker is not None or measure or self.device.startswith("cuda"):
            loss, peak = measure_step(self.trainer.engine, batch, self.tracker)
            return float(loss), peak.bytes
        return float(self.trainer.engine(batch)), None

    def step(self, step: int, events: list, measure: bool = False) -> tuple[float, int | None]:
        batch = self.trainer.batch(step)
        rng = torch.get_rng_state()  # a retried step draws the same dropout masks as the failed one
        while True:
            try:
                loss, peak = self._measured_step(batch, measure)
                self.trainer.step_count = step + 1
                return loss, peak
            except (torch.OutOfMemoryError, RuntimeError) as error:
                oom = _out_of_memory(error)
                if oom is None:
                    raise
                torch.set_rng_state(rng)
                if self.trainer.config.world > 1:
                    self._restart_ranks(step, oom)  # raises
                events.append(self._recover(step, oom))

    def _live_bytes(self) -> int | None:
        """Tensor bytes live between steps: the GPU allocator's count, or the budget's counter on a CPU (a CPU
        run without a budget counts nothing after its first steps)."""
        if self.device.startswith("cuda"):
            return torch.cuda.memory_allocated(torch.device(self.device))
        return self.tracker.current if self.tracker is not None else None

    def _watch_growth(self, step: int, live: int | None) -> None:
        """Warn once when live memory between steps has grown step after step: something keeps memory from
        every step (a leak); `memfit doctor` finds the line."""
        if live is None or self.growth_said:
            return
        self.live.append(live)
        recent = self.live[-GROWTH_STEPS:]
        rises = sum(b > a for a, b in zip(recent, recent[1:]))
        if len(recent) == GROWTH_STEPS and rises >= GROWTH_STEPS - 2:
            per_step = (recent[-1] - recent[0]) / (GROWTH_STEPS - 1)
            self.growth_said = (f"{GROWTH_WARNING} grew in {rises} of the last {GROWTH_STEPS - 1} "
                                f"steps (about {fmt_bytes(per_step)} a step, {fmt_bytes(recent[0])} -> "
                                f"{fmt_bytes(recent[-1])}): something keeps memory from every step; "
                                f"`memfit doctor {self.workload.name} --steps 20` names the line")
            self.console.print(f"[yellow]{self.growth_said}[/]")
            self._log_event(step, self.growth_said)

    def _recover(self, step: int, oom: Exception) -> str:
        """Move this process to the next configuration and say so (the step is then redone)."""
        cand, said = self._step_down(step, oom)
        self.live = []  # another configuration holds other state
        self.trainer.reconfigure(cand)
        msg = "; ".join([*said, f"redoing the same global batch with {cand.describe()}"])
        self.console.print(f"[yellow]{msg}[/]")
        return msg

    def _restart_ranks(self, step: int, oom: Exception) -> None:
        """Out of memory on this rank while the others wait in a collective: record the next configuration
        for every rank (runtime/distributed.py) and stop; all ranks start again from the newest checkpoint."""
        cand, said = self._step_down(step, oom)
        latest = ckpt.latest_checkpoint(self.out)
        where = f"every rank goes on from {latest.name}" if latest else "every rank starts again from the first step"
        event = "; ".join([f"rank {self.rank}: {said[0]}", *said[1:], f"going on with {cand.describe()}"])
        distributed.request_recovery(self.out, step, cand.to_dict(), event)
        raise RunError(f"{event}; {where} (`memfit train --gpus` restarts the ranks itself; under another "
                       "launcher, run the same command with --resume)") from oom

    def _step_down(self, step: int, oom: Exception) -> tuple[Config, list[str]]:
        """Free what the failed attempt held; the next configuration of the recovery ladder that this
        model can run, and what was said on the way. Gradients are dropped (the step starts from zero
        gradients anyway); the optimizer has not stepped: OOMs are raised before or inside forward/backward,
        and the optimizer step allocates nothing the trace did not see."""
        e = self.trainer.engine
        phase = getattr(e, "phase", "?")
        e.optimizer.zero_grad(set_to_none=True)
        if phase == "optimizer" or (e.in_backward is not None and e.in_backward.updated):
            where = "the optimizer step" if phase == "optimizer" else "backward, after the optimizer updated some"
            raise RunError(f"step {step}: out of memory in {where}; parameters may be partly updated, so the run "
                           f"stops here; {self.intact()}") from oom
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
        old = self.trainer.config
        skipped = []
        ladder = recovery_ladder(old, self.global_batch // old.gpus)
        for i, cand in enumerate(ladder):
            if cand.activation_checkpoint != old.activation_checkpoint:  # a strategy the run has not run yet
                self._probe([c for c in ladder[i:] if c.activation_checkpoint != old.activation_checkpoint])
                if self.refusals[cand.activation_checkpoint]:
                    skipped.append(f"activation checkpointing {cand.activation_checkpoint} not tried: "
                                   f"{self.refusals[cand.activation_checkpoint]}")
                    continue
            return cand, [f"step {step}: out of memory ({phase}) at {old.describe()}{self._held(old)}", *skipped]
        if old.world > 1:  # saving is a collective the other ranks, stuck in the step, cannot join
            raise RunError("; ".join([f"rank {self.rank}: step {step}: out of memory at {old.describe()} and "
                                      "nothing smaller is left to try", *skipped, self.intact()])) from oom
        path = self.save(step)
        raise RunError("; ".join([f"step {step}: out of memory at {old.describe()} and nothing smaller is left to "
                                  f"try", *skipped, f"checkpoint written to {path}"])) from oom

    def _held(self, config: Config) -> str:
        """What the estimate says `config`'s step holds at its peak, when the run has its estimate."""
        est = getattr(self.predictions.get(config), "estimate", None)
        if est is None:
            return ""
        held = ", ".join(f"{c} {fmt_bytes(n)}" for c, n in sorted(est.breakdown.items(), key=lambda kv: -kv[1]) if n)
        return f" (estimated peak {fmt_bytes(est.peak_bytes)} in {est.peak_phase}: {held})"

    def _probe(self, configs: list[Config]) -> None:
        """Verify each checkpointing among `configs` not verified yet with a fake probe (together, in forked
        children): `self.refusals` maps it to why it cannot run on this model, or None."""
        from memfit.planner.search import refusals

        todo = list({c.activation_checkpoint: c for c in configs
                     if c.activation_checkpoint not in self.refusals}.values())
        if todo:
            verdicts = refusals(self.workload, todo, get_device(self.device))
            self.refusals.update({c.activation_checkpoint: why for c, why in zip(todo, verdicts)})

    def _log_event(self, step: int, text: str) -> None:
        if self.rank != 0:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({"step": step, "event": text}) + "\n")

    # -------------------------------------------------------------------------------- the loop
    def loop(self, start: int, progress: bool) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        # Ctrl-C finishes the step and checkpoints; Python lets only the main thread install a handler
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, self._interrupt) if main else None
        columns = [TextColumn("step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[info]}"),
                   TimeRemainingColumn()]
        try:
            with Progress(*columns, console=self.console, disable=not progress, transient=False) as bar:
                task = bar.add_task("train", total=self.steps, completed=start, info="")
                for step in range(start, self.steps):
                    events: list[str] = self.pending.pop(step, [])
                    t0 = time.perf_counter()
                    try:
                        loss, peak = self.step(step, events, measure=step < start + 3)
                    except KeyboardInterrupt as e:
                        if e.args:
                            raise
                        raise KeyboardInterrupt(f"stopped during step {step}, nothing of it saved; "
                                                f"{self.intact()}") from None
                    except Exception as e:
                        if not raised_at(e):  # memfit's or torch's own failure: as it is
                            raise
                        raise WorkloadError(f"step {step}: the workload's training step raised: {first_line(e)}; "
                                            f"{self.intact()}") from e
                    seconds = time.perf_counter() - t0
                    if not math.isfinite(loss):  # its weights went through an optimizer step: none is saved
                        self._log_event(step, f"stopped: loss is {loss}")
                        raise RunError(f"step {step}: the loss is {loss}; the run stops without saving anything "
                                       f"of this step ({self.intact()}); a lower learning rate or a look at the "
                                       "data may help")
                    lr = self.trainer.optimizer.param_groups[0]["lr"]
                    with warnings.catch_warnings():  # a step GradScaler skipped is not a misordered scheduler
                        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
                        self.scheduler.step()
                    cfg = self.trainer.config
                    rec = dict(step=step, loss=loss, lr=lr, step_seconds=seconds,
                               samples_per_second=self.global_batch / seconds, peak_bytes=peak,
                               micro_batch=cfg.micro_batch, grad_accum=cfg.grad_accum,
                               activation_checkpoint=cfg.to_dict()["activation_checkpoint"],
                               skipped_fp16_steps=self.trainer.engine.skipped_steps, events=events)
                    if self.trainer.engine.grad_norm is not None:  # before clipping: what the clip acted on
                        rec["grad_norm"] = float(self.trainer.engine.grad_norm)
                    if self.trainer.noise is not None:  # batch-size advice, when the step accumulated
                        rec.update(self.trainer.noise.metrics())
                    live = self._live_bytes()
                    if live is not None:
                        rec["live_bytes"] = live
                        self._watch_growth(step, live)
                    if cfg.world > 1 and step < start + 3:  # the steps every rank measures: each rank's own peak
                        rec["rank_peak_bytes"] = distributed.gather(peak)
                    if self.rank == 0:
                        with open(self.metrics_path, "a") as f:
                            f.write(json.dumps(rec) + "\n")
                    info = f"loss {loss:.4f} · {rec['samples_per_second']:.0f} samples/s"
                    if peak is not None:
                        info += f" · peak {fmt_bytes(peak)}"
                        if cfg in self.predictions and self.predictions[cfg].peak_bytes is not None:
                            info += f" (predicted {fmt_bytes(self.predictions[cfg].peak_bytes)})"
                    bar.update(task, completed=step + 1, info=info)
                    done = step + 1
                    if self.stop_requested or (self.checkpoint_every and done % self.checkpoint_every == 0):
                        self.save(done)
                    if self.stop_requested:
                        break
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    def _interrupt(self, signum, frame):
        if self.stop_requested:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.stop_requested = True
        self.console.print("[yellow]Ctrl-C: finishing this step, then writing a checkpoint (again to abort)[/]")


def _out_of_memory(error: BaseException) -> torch.OutOfMemoryError | None:
    """The OOM behind `error`, if one is: a pipeline stage's forward re-raises what its module raised as a
    RuntimeError "from" it (torch.distributed.pipelining), which would otherwise kill the rank unrecovered."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, torch.OutOfMemoryError):
            return error
        error, seen = error.__cause__, seen + 1
    return None


def _history(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def train(workload: Workload, steps: int, global_batch: int, *, budget=None, device: str = "cpu",
          config: Config | None = None, micro_batch: int | None = None, precision: str | None = None,
          seed: int = 0, out: str | Path | None = None, checkpoint_every: int | None = None, keep_checkpoints: int = 2,
          resume: bool = False, schedule: str | None = None, warmup: int | None = None, progress: bool = True,
          console=None, deterministic: bool | None = None, gpus: int = 1,
          data_parallel: str | None = None, allow=(), tp: int = 1, pp: int = 1,
          pp_schedule: str = "1f1b", pp_virtual: int | None = None) -> RunResult:
    """Train for `steps` optimizer steps of `global_batch` samples. Without `config` (or `micro_batch`) the
    planner chooses one for the budget; with one, it is the starting point OOM recovery may still change.

    Args:
        workload: the job (`Workload`).
        steps: optimizer steps of the whole run (a resume runs up to it).
        global_batch: samples per optimizer step; accumulation makes it up whatever the micro-batch.
        budget: memory to fit in: bytes, ``"24GiB"``, ``"80GB"`` or ``"50%"`` of the device. On a CPU it is a
            virtual device of that size (an allocation past it raises ``torch.OutOfMemoryError``, which OOM
            recovery handles); on a GPU, the process's memory fraction; with `gpus`, each rank's (an OOM on
            any rank restarts all of them in the next configuration). None: no limit.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (the device present).
        config: the configuration to start from (its ``grad_accum`` is recomputed for `global_batch`).
        micro_batch: start from this micro-batch instead of planning.
        precision: the precision of a run not planned; None: the device's default (``defaults_for``).
        seed: seeds the initial weights, the data and dropout.
        out: the run folder (default: a new one under ``./runs/``).
        checkpoint_every: save training state every N steps (always at the end and on Ctrl-C).
        keep_checkpoints: how many checkpoints the run folder keeps, the newest; an older one is deleted once
            a newer one is complete.
        resume: continue from the newest intact checkpoint in `out`, after checking it belongs to this run.
        schedule: cosine (warm-up, then down to 10%), onecycle or constant; None: as the run being resumed
            was started (cosine for a new run).
        warmup: warm-up steps of the cosine schedule (default: 5% of the run).
        progress: show a progress bar.
        console: a ``rich.console.Console`` for the run's messages.
        deterministic: kernels and thread count fixed (see `deterministic_mode`) so that a run resumed after
            an interruption ends bit for bit where the uninterrupted run ends, on the same machine and
            PyTorch build. None: as the run being resumed was started (off for a new run).
        gpus: ranks to train on; more than one needs a launcher (`memfit train --gpus N` starts the ranks),
            and this process is one of them (runtime/distributed.py). Not planned yet: the micro-batch
            defaults to the rank's share of the global batch.
        data_parallel: the layout across ranks (`Config.data_parallel`); default fsdp.
        tp: of the `gpus` ranks, how many split each block's matmuls (`Config.tp`); the data-parallel ranks
            are gpus / tp.
        pp, pp_schedule: of the `gpus` ranks, how many pipeline stages the blocks split over, and their
            schedule (`Config.pp`, `Config.pp_schedule`); the data-parallel ranks are gpus / (pp x tp).
        pp_virtual: stages a pipeline rank holds under the interleaved schedules (`Config.pp_virtual`).
        allow: techniques that change the math the plan may use (`plan`'s `allow`: "8bit-optim").

    Returns:
        `RunResult`: the run folder, steps done, final configuration and loss, metrics and the report.

    Ctrl-C finishes the step, writes a checkpoint and the report, then raises KeyboardInterrupt; a second
    Ctrl-C stops at once. A non-finite loss raises RunError without saving anything of that step.

    Example::

        result = train(builtin("sort"), steps=100, global_batch=64, budget="64MiB", out="runs/sort")
        result.report["samples_per_second"], result.final_loss
    """
    from rich.console import Console

    console = console or Console()
    _check_arguments(steps, global_batch, micro_batch, checkpoint_every, keep_checkpoints, warmup, schedule)
    layout = _check_layout(gpus, data_parallel, global_batch, micro_batch, budget, tp, pp)
    if gpus > 1 and int(os.environ["RANK"]) != 0:
        console = Console(quiet=True)  # rank 0 speaks for the run
    out = Path(out) if out else default_run_dir(workload)
    state = path = None
    # ranks started again after an OOM (runtime/distributed.py) before any checkpoint begin at the first step
    recovery = distributed.recovery_request(out) if resume and gpus > 1 else None
    if resume and (recovery is None or ckpt.list_checkpoints(out)):
        found = ckpt.load_latest(out, hash_shards=gpus == 1)  # ranks hash the shards between them once joined
        if found is None:
            what = "complete" if not ckpt.list_checkpoints(out) else "intact"
            raise RunError(f"--resume: no {what} checkpoint under {out}")
        path, state = found
        if pp > 1 and not state.get("shards"):
            raise RunError(unsharded_on_stages(path))
        identity = _check_resume(path, state, workload, seed=seed, global_batch=global_batch, steps=steps,
                                 schedule=schedule, warmup=warmup, deterministic=deterministic,
                                 precision=precision or (config.precision if config else None))
        if state["step"] == steps and (out / "model.safetensors").exists() and (out / "report.json").exists():
            console.print(f"already complete: step {steps} of {steps} in {out}; nothing to do")
            history = _history(out)
            losses = [r["loss"] for r in history if "loss" in r]
            return RunResult(out=out, steps=steps, config=Config.from_dict(state["config"]),
                             final_loss=losses[-1] if losses else float("nan"), metrics=history,
                             report=json.loads((out / "report.json").read_text()), already_complete=True)
    else:
        if ckpt.list_checkpoints(out):  # a fresh run among them would resume into the old one
            raise RunError(f"{out} already holds checkpoints of a run (newest: step {ckpt.list_checkpoints(out)[-1][0]}); "
                           "resume it with --resume, or start the new run in another folder")
        identity = dict(workload=workload.name, seed=seed, global_batch=global_batch, steps=steps,
                        schedule=schedule or "cosine",
                        warmup=warmup if warmup is not None else max(1, steps // 20),
                        max_grad_norm=workload.max_grad_norm, deterministic=bool(deterministic),
                        threads=torch.get_num_threads())
    with deterministic_mode(identity["deterministic"], identity["threads"]):
        return _train(workload, identity, out, state, path, budget=budget, device=device, config=config,
                      micro_batch=micro_batch, precision=precision, checkpoint_every=checkpoint_every,
                      keep_checkpoints=keep_checkpoints, progress=progress, console=console, gpus=gpus, layout=layout,
                      recovery=recovery, allow=allow, tp=tp, pp=pp, pp_schedule=pp_schedule, pp_virtual=pp_virtual)


def unsharded_on_stages(path) -> str:
    """Why a one-process checkpoint does not resume on pipeline stages (DCP's resharding needs DCP shards)."""
    return (f"{path}: a checkpoint of one process holds its optimizer state by position in the whole model, which "
            "a pipeline stage cannot take its part of: resume it without --pp")


def default_run_dir(workload: Workload) -> Path:
    """A new run folder under ./runs/, named after the workload and the time."""
    return Path("runs") / f"{workload.name.replace('/', '_').replace(':', '_')}-{datetime.datetime.now():%Y%m%d-%H%M%S}"


def _check_layout(gpus, data_parallel, global_batch, micro_batch, budget, tp=1, pp=1) -> str:
    """The layout for `gpus` ranks (`tp` of them splitting each block, `pp` pipeline stages), after checking
    what a run across ranks needs."""
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise ConfigError(f"gpus must be a whole number >= 1, got {gpus!r}")
    for n, what in ((tp, "tensor parallel over"), (pp, "a pipeline of")):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"{what} {n!r} ranks: a whole number >= 1")
    if gpus % (tp * pp):
        raise ConfigError(f"{pp} pipeline stage(s) x {tp} tensor-parallel rank(s) do not divide {gpus} ranks")
    dp = gpus // (tp * pp)
    layout = data_parallel or ("fsdp" if dp > 1 else "none")
    if gpus == 1:
        return layout
    if not distributed.launched():
        raise RunError(f"training on {gpus} GPUs needs one process per rank: run `memfit train --gpus {gpus}` "
                       "(it starts them itself) or start this under torchrun")
    if global_batch % (dp * (micro_batch or 1)):
        raise ConfigError(f"global batch {global_batch} does not split into {dp} data-parallel ranks x "
                          f"micro-batch {micro_batch or 1}")
    return layout


def _train(workload, identity, out, state, path, *, budget, device, config, micro_batch, precision,
           checkpoint_every, keep_checkpoints, progress, console, gpus=1, layout="none", recovery=None,
           allow=(), tp=1, pp=1, pp_schedule="1f1b", pp_virtual=None) -> RunResult:
    from memfit.planner.search import plan, resolve_budget
    from memfit.report.plots import plot_loss, plot_memory_timeline, plot_noise_scale

    steps, global_batch = identity["steps"], identity["global_batch"]
    dev = get_device(device)
    budget_bytes = resolve_budget(budget, dev) if budget is not None else None
    predictions: dict[Config, Prediction] = {}
    chosen = None
    if gpus > 1:
        return _train_on_ranks(workload, identity, out, state, path, device=device, dev=dev, config=config,
                               micro_batch=micro_batch, precision=precision, checkpoint_every=checkpoint_every,
                               keep_checkpoints=keep_checkpoints, progress=progress, console=console, gpus=gpus,
                               layout=layout, budget=budget_bytes, recovery=recovery, tp=tp, pp=pp,
                               pp_schedule=pp_schedule, pp_virtual=pp_virtual)
    if state is not None:  # the run goes on in the configuration it was saved in
        config = _on_one_rank(Config.from_dict(state["config"]), global_batch)
        start = _saved_plan(out, config) or predict(workload, config, dev)
    elif config is None and micro_batch is None:
        host = int(HOST_SHARE * available_host_bytes()) if dev.kind == "cuda" else None  # offload's room here
        chosen = plan(workload, global_batch, budget=budget, device=dev, precision=precision, allow=allow,
                      host_memory=host)
        config, start = chosen.config, from_plan(chosen)
    else:
        config = config or Config(micro_batch=micro_batch, precision=precision or defaults_for(dev).precision)
        config = config.replace(grad_accum=math.ceil(global_batch / config.micro_batch))
        start = predict(workload, config, dev)
    predictions[config] = start
    out.mkdir(parents=True, exist_ok=True)  # everything checked: from here on the run writes
    if chosen is not None:
        (out / "plan.json").write_text(json.dumps(chosen.to_dict(), indent=1))
        caveat = step_time_caveat(chosen.profile_source)
        console.print(f"plan: {config.describe()}, predicted peak {fmt_bytes(chosen.peak_bytes)}, "
                      f"{chosen.samples_per_second:.1f} samples/s{f' ({caveat})' if caveat else ''} "
                      f"(saved to {out / 'plan.json'})")
    run = _Run(workload, identity, out, dev.name if dev.kind == "cpu" else device, config, budget_bytes,
               checkpoint_every, keep_checkpoints, console, predictions)
    if state is not None:
        run.restore(path, state)
    elif run.metrics_path.exists():
        run.metrics_path.unlink()
    run.loop(run.trainer.step_count, progress)
    final = run.trainer.config
    finished = run.trainer.step_count >= steps
    if finished:
        run.save(steps)
        ckpt.export_safetensors(run.trainer.model, out / "model.safetensors")
    history = _history(out)
    losses = [r for r in history if "loss" in r]
    report = _report(workload, history, predictions, final, identity, run.device, dev)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    if any(math.isfinite(r["loss"]) for r in losses):  # (a run never logs a non-finite loss; older logs might)
        plot_loss(losses, out / "loss.png", title=f"{workload.name}: training loss")
    if report["batch_size_advice"]["measured_steps"]:
        plot_noise_scale(history, out / "noise_scale.png", global_batch,
                         title=f"{workload.name}: gradient noise scale (batch-size advice)")
    shown = predictions.get(final) or start
    if shown.estimate is not None:
        plot_memory_timeline(shown.estimate, out / "memory.png",
                             title=f"{workload.name}: memory of one step at {shown.config.describe()} (predicted)")
    if run.stop_requested and not finished:
        raise KeyboardInterrupt(f"interrupted: checkpoint of step {run.trainer.step_count} written to "
                                f"{ckpt.checkpoint_path(out, run.trainer.step_count)}; resume with --resume")
    return RunResult(out=out, steps=run.trainer.step_count, config=final,
                     final_loss=losses[-1]["loss"] if losses else float("nan"), metrics=history, report=report)


def _on_one_rank(config: Config, global_batch: int) -> Config:
    """A configuration saved across ranks, continued in one process (the same global batch per step)."""
    if config.world == 1:
        return config
    return config.replace(gpus=1, data_parallel="none", gpus_per_node=None, tp=1, pp=1,
                          grad_accum=math.ceil(global_batch / config.micro_batch))


def rank_micro_batch(share: int, pp: int = 1) -> int:
    """The largest micro-batch that splits a data-parallel rank's `share` of the rows evenly (a pipeline's
    schedule runs micro-batches of one shape) into at least `pp` of them (each stage busy)."""
    if share < pp:
        raise ConfigError(f"a data-parallel rank's {share} row(s) of the global batch cannot make the {pp} "
                          "micro-batches a step that keep every pipeline stage busy: raise --global-batch")
    return max(m for m in range(1, share // pp + 1) if share % m == 0)


def _train_on_ranks(workload, identity, out, state, path, *, device, dev, config, micro_batch, precision,
                    checkpoint_every, keep_checkpoints, progress, console, gpus, layout, budget,
                    recovery, tp=1, pp=1, pp_schedule="1f1b", pp_virtual=None) -> RunResult:
    """`_train` as one of `gpus` ranks (gpus / (pp x tp) data-parallel ones, each `tp` ranks splitting the blocks,
    which draw the same rows, in each of `pp` pipeline stages): rank 0 predicts (before the world exists: the
    estimate traces a fake one), every rank joins, trains its share, checkpoints together; rank 0 writes the run
    folder. Under a budget, every rank counts its own memory; an OOM on any rank restarts all of them in the next
    configuration (runtime/distributed.py), recorded in the run folder and applied here."""
    from memfit.report.plots import plot_loss, plot_memory_timeline

    steps, global_batch = identity["steps"], identity["global_batch"]
    saved = Config.from_dict(state["config"]) if state is not None else config
    if recovery is not None and state is not None and recovery["step"] < state["step"]:
        recovery = None  # the checkpoint is newer than the OOM: its configuration already is the recovered one
    if recovery is not None:
        saved, micro_batch = Config.from_dict(recovery["config"]), None
    dp = gpus // (tp * pp)
    share = global_batch // dp  # a data-parallel rank's rows
    micro = micro_batch or (saved.micro_batch if saved is not None else rank_micro_batch(share, pp))
    if share % micro or share // micro < pp:  # a resume on fewer ranks, or more stages, than it was chosen for
        micro = rank_micro_batch(share, pp)
    config = Config(micro_batch=micro, grad_accum=share // micro,
                    precision=(saved.precision if saved is not None else precision or defaults_for(dev).precision),
                    activation_checkpoint=saved.activation_checkpoint if saved is not None else "none",
                    gpus=dp, data_parallel=layout, tp=tp, pp=pp, pp_schedule=pp_schedule, pp_virtual=pp_virtual)
    rank0 = int(os.environ["RANK"]) == 0
    start = Prediction(config, None, None, "rank 0 predicts")
    if rank0:  # memory per rank; the step time is not predicted (predict)
        start = predict(workload, config, dev)
    rank = distributed.join(gpus, device)
    try:
        if state is not None:
            ckpt.check_shards_together(path, state)
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            if recovery is None:  # left by an earlier run in this folder that never resumed
                (out / distributed.RECOVERY).unlink(missing_ok=True)
        run = _Run(workload, identity, out, dev.name if dev.kind == "cpu" else device, config, budget,
                   checkpoint_every, keep_checkpoints, console, {config: start})
        if recovery is not None:
            run.pending[recovery["step"]] = [recovery["event"]]
        if state is not None:
            run.restore(path, state)
        elif rank == 0 and run.metrics_path.exists():
            run.metrics_path.unlink()
        run.loop(run.trainer.step_count, progress and rank == 0)
        finished = run.trainer.step_count >= steps
        if finished:
            run.save(steps)
        model_state = (distributed.full_state(run.trainer.model, run.trainer.optimizer)[0] if pp == 1 else
                       distributed.pipeline_full_model_state(run.trainer.model, config))
        history = _history(out) if rank == 0 else []
        report = {}
        if rank == 0:
            if finished:
                ckpt.export_safetensors(None, out / "model.safetensors", state_dict=model_state)
            report = _report(workload, history, {config: start}, config, identity, run.device, dev)
            report["world_size"] = gpus
            (out / "report.json").write_text(json.dumps(report, indent=1))
            losses = [r for r in history if "loss" in r]
            if any(math.isfinite(r["loss"]) for r in losses):
                plot_loss(losses, out / "loss.png", title=f"{workload.name}: training loss ({gpus} ranks)")
            plot_memory_timeline(start.estimate, out / "memory.png",
                                 title=f"{workload.name}: memory of one step on rank 0 at {config.describe()} "
                                       "(predicted)")
        losses = [r for r in history if "loss" in r]
        # every rank done with the world before any leaves it: a rank tearing gloo down while rank 0 still
        # writes the report was seen to abort in C++ ("terminate called without an active exception")
        torch.distributed.barrier()
        return RunResult(out=out, steps=run.trainer.step_count, config=config,
                         final_loss=losses[-1]["loss"] if losses else float("nan"), metrics=history, report=report)
    finally:
        distributed.leave()


def peak_measure(device: str) -> str:
    """What a run's measured peak is, in words: on a CPU it is not the process's memory."""
    return "torch.cuda.max_memory_allocated" if device.startswith("cuda") else "live tensor bytes (CPU)"


def _process_peak_rss() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if os.uname().sysname == "Darwin" else rss * 1024  # macOS counts bytes, Linux KiB


def _report(workload, history: list[dict], predictions: dict, final: Config, identity: dict, device: str,
            dev) -> dict:
    """Predicted vs measured per configuration the run trained in (OOM recovery may have moved it), each
    prediction of the configuration it is compared with; the top-level figures are the final configuration's."""
    groups: dict[Config, list[dict]] = {}
    for r in (r for r in history if "loss" in r):
        cfg = final.replace(micro_batch=r["micro_batch"], grad_accum=r.get("grad_accum", final.grad_accum),
                            activation_checkpoint=r.get("activation_checkpoint", final.activation_checkpoint))
        groups.setdefault(cfg, []).append(r)
    rows = []
    for cfg, recs in groups.items():
        if cfg not in predictions and torch.distributed.is_initialized():
            # a fake world cannot be made beside the real one (a configuration of an earlier launch: an OOM's,
            # or a resume's on another layout)
            predictions[cfg] = Prediction(cfg, None, None, "not predicted: run on ranks before this launch")
        if cfg not in predictions:
            try:
                predictions[cfg] = predict(workload, cfg, dev)
            except Exception as e:  # noqa: BLE001 - the run is done; its report says what could not be predicted
                predictions[cfg] = Prediction(cfg, None, None, f"not predicted: {type(e).__name__}: {e}"[:200])
        p = predictions[cfg]
        steady = [r for r in recs[1:] if not r["events"]] or recs  # a config's first step pays for its warm-up
        times = sorted(r["step_seconds"] for r in steady)
        peaks = [r["peak_bytes"] for r in recs if r["peak_bytes"] is not None]
        rows.append(dict(config=cfg.to_dict(), steps=len(recs), first_step=recs[0]["step"],
                         predicted_peak_bytes=p.peak_bytes, measured_peak_bytes=max(peaks) if peaks else None,
                         predicted_step_seconds=p.step_seconds, measured_step_seconds=times[len(times) // 2],
                         prediction_source=p.described))
    last = next((r for r in rows if Config.from_dict(r["config"]) == final), rows[-1] if rows else None)
    top = {k: (last or {}).get(k) for k in ("predicted_peak_bytes", "measured_peak_bytes", "predicted_step_seconds",
                                             "measured_step_seconds", "prediction_source")}
    median = top["measured_step_seconds"]
    return dict(config=final.to_dict(), steps=sum(r["steps"] for r in rows), **top,
                measured_peak_is=peak_measure(device),
                samples_per_second=identity["global_batch"] / median if median else None,
                process_peak_rss_bytes=_process_peak_rss(),
                oom_recoveries=sum(len(r["events"]) for r in history if "loss" in r),
                schedule=identity["schedule"], warmup=identity["warmup"],  # the rates per step: metrics.jsonl's lr
                deterministic=identity["deterministic"], threads=torch.get_num_threads(), configs=rows,
                batch_size_advice=noise.advice(history, identity["global_batch"], final.gpus),
                live_growth=next((r["event"] for r in history if r.get("event", "").startswith(GROWTH_WARNING)), None))
