"""`train`: a whole run. Plan (unless told), then step: data seeded by (seed, step), OOM recovery that
redoes the same global batch with more memory savings, atomic checkpoints, exact resume, metrics, report.

Follow one step in `_Run.loop`: draw the global batch -> `Trainer.step` -> on OOM, `_recover` picks the
next configuration and the same batch is run again -> log a metrics line -> maybe checkpoint.
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import torch

from memfit.config import Config
from memfit.memory.devices import get_device
from memfit.memory.estimate import estimate
from memfit.memory.tracker import LiveBytes
from memfit.runtime import checkpoints as ckpt
from memfit.runtime.trainer import Trainer
from memfit.units import fmt_bytes
from memfit.workload import Workload


class RunError(Exception):
    """The run cannot go on (nothing fits, a bad resume); a checkpoint was written where possible."""


@dataclasses.dataclass
class RunResult:
    out: Path
    steps: int
    config: Config
    final_loss: float
    metrics: list
    report: dict


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
        raise ValueError(f"unknown schedule {schedule!r}; choose cosine, onecycle or constant")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(schedule, steps, warmup))


def recovery_ladder(config: Config, global_batch: int) -> list[Config]:
    """What to try after an OOM, in order: halve the micro-batch (more accumulation, same global batch),
    then checkpoint selectively, then every block. Precision and optimizer offload are never changed: they
    would change the math or the optimizer's state layout."""
    out, m = [], config.micro_batch
    while m > 1:
        m = max(1, m // 2)
        out.append(config.replace(micro_batch=m, grad_accum=math.ceil(global_batch / m)))
    last = out[-1] if out else config
    for ck in ("selective", "all"):
        if last.checkpoint in ("none", "selective") and ck != last.checkpoint:
            out.append(last.replace(checkpoint=ck))
    return out


class _Run:
    def __init__(self, workload: Workload, steps: int, global_batch: int, out: Path, device: str,
                 config: Config, seed: int, budget: int | None, checkpoint_every: int | None,
                 schedule: str, warmup: int, console, predicted=None):
        self.workload, self.steps, self.global_batch, self.out = workload, steps, global_batch, out
        self.device, self.seed, self.budget, self.console = device, seed, budget, console
        self.checkpoint_every = checkpoint_every
        self.schedule, self.warmup = schedule, warmup
        self.predicted = predicted  # Estimate of the starting configuration, for predicted vs measured
        self.trainer = Trainer(workload, config, device=device, seed=seed, global_batch=global_batch)
        self.scheduler = make_scheduler(self.trainer.optimizer, schedule, steps, warmup)
        self.metrics_path = out / "metrics.jsonl"
        self.stop_requested = False
        self.tracker = None
        if budget is not None and device == "cpu":  # a virtual device: count live bytes, OOM past the budget
            self.tracker = LiveBytes("cpu", budget=budget, detail=False)
        elif budget is not None and device.startswith("cuda"):
            total = torch.cuda.get_device_properties(torch.device(device)).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), torch.device(device))

    # -------------------------------------------------------------------------------- checkpoints
    def save(self, step: int) -> Path:
        e = self.trainer.engine
        return ckpt.save_checkpoint(self.out, step, model=e.model, optimizer=e.optimizer, scaler=e.scaler,
                                    scheduler=self.scheduler, config=self.trainer.config,
                                    data_state={"seed": self.seed, "global_batch": self.global_batch},
                                    optimizer_offload=e.optimizer_offload)

    def resume(self) -> int:
        path = ckpt.latest_checkpoint(self.out)
        if path is None:
            return 0
        state = ckpt.load_checkpoint(path)
        data = state["data_state"]
        if data.get("seed") != self.seed or data.get("global_batch") != self.global_batch:
            raise RunError(f"{path}: saved with seed {data.get('seed')} and global batch {data.get('global_batch')}; "
                           f"resuming with seed {self.seed} and global batch {self.global_batch} would change the data")
        total = (state.get("scheduler") or {}).get("total_steps")  # onecycle's length is part of its state
        if total is not None and total != self.steps:
            raise RunError(f"{path}: its onecycle LR schedule spans {total} steps and cannot be stretched to "
                           f"{self.steps}; resume with --steps {total}")
        saved = Config.from_dict(state["config"])
        if saved != self.trainer.config:
            self.trainer.reconfigure(saved)  # a configuration OOM recovery had moved to
        e = self.trainer.engine
        ckpt.restore(state, model=e.model, optimizer=e.optimizer, scaler=e.scaler, scheduler=self.scheduler,
                     optimizer_offload=e.optimizer_offload)
        self.trainer.step_count = state["step"]
        self._forget_metrics_from(state["step"])
        self._log_event(state["step"], f"resumed from {path.name}")
        return state["step"]

    def _forget_metrics_from(self, step: int) -> None:
        """A killed run may have logged steps after its last checkpoint; they are run again now, so their old
        records go (one record per step). A line cut short by the kill goes too. Rewritten atomically."""
        if not self.metrics_path.exists():
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
        tracker = self.tracker or (LiveBytes("cpu", detail=False) if measure and self.device == "cpu" else None)
        if tracker is not None:
            tracker.track(self.trainer.engine.state_tensors())
            tracker.peak = tracker.current
            with tracker:
                loss = self.trainer.engine(batch)
            if tracker is not self.tracker:
                tracker.close()
            return float(loss), tracker.peak
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            loss = float(self.trainer.engine(batch))
            return loss, torch.cuda.max_memory_allocated()
        return float(self.trainer.engine(batch)), None

    def step(self, step: int, events: list, measure: bool = False) -> tuple[float, int | None]:
        batch = self.trainer.batch(step)
        rng = torch.get_rng_state()  # a retried step draws the same dropout masks as the failed one
        while True:
            try:
                loss, peak = self._measured_step(batch, measure)
                self.trainer.step_count = step + 1
                return loss, peak
            except torch.OutOfMemoryError as oom:
                events.append(self._recover(step, oom))
                torch.set_rng_state(rng)

    def _recover(self, step: int, oom: Exception) -> str:
        """Free what the failed attempt held and move to the next configuration. Gradients are dropped (the
        step starts from zero gradients anyway); the optimizer has not stepped: OOMs are raised before or
        inside forward/backward, and the optimizer step allocates nothing the trace did not see."""
        e = self.trainer.engine
        phase = getattr(e, "phase", "?")
        e.optimizer.zero_grad(set_to_none=True)
        if phase == "optimizer":
            raise RunError(f"step {step}: out of memory inside the optimizer step; parameters may be partly "
                           "updated, so the run stops here (resume from the last checkpoint)") from oom
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
        old = self.trainer.config
        for cand in recovery_ladder(old, self.global_batch):
            self.trainer.reconfigure(cand)
            msg = (f"step {step}: out of memory ({phase}) at {_describe(old)}; redoing the same global batch with "
                   f"{_describe(cand)}")
            self.console.print(f"[yellow]{msg}[/]")
            return msg
        path = self.save(step)
        raise RunError(f"step {step}: out of memory at {_describe(old)} and nothing smaller is left to try; "
                       f"checkpoint written to {path}") from oom

    def _log_event(self, step: int, text: str) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({"step": step, "event": text}) + "\n")

    # -------------------------------------------------------------------------------- the loop
    def loop(self, start: int, progress: bool) -> list[dict]:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        records: list[dict] = []
        # Ctrl-C finishes the step and checkpoints; Python lets only the main thread install a handler
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, self._interrupt) if main else None
        columns = [TextColumn("step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[info]}"),
                   TimeRemainingColumn()]
        try:
            with Progress(*columns, console=self.console, disable=not progress, transient=False) as bar:
                task = bar.add_task("train", total=self.steps, completed=start, info="")
                for step in range(start, self.steps):
                    events: list[str] = []
                    t0 = time.perf_counter()
                    loss, peak = self.step(step, events, measure=step < start + 3)
                    seconds = time.perf_counter() - t0
                    lr = self.trainer.optimizer.param_groups[0]["lr"]
                    self.scheduler.step()
                    skipped = self.trainer.engine.skipped_steps
                    rec = dict(step=step, loss=loss, lr=lr, step_seconds=seconds,
                               samples_per_second=self.global_batch / seconds, peak_bytes=peak,
                               micro_batch=self.trainer.config.micro_batch, skipped_fp16_steps=skipped,
                               events=events)
                    records.append(rec)
                    with open(self.metrics_path, "a") as f:
                        f.write(json.dumps(rec) + "\n")
                    info = f"loss {loss:.4f} · {rec['samples_per_second']:.0f} samples/s"
                    if peak is not None:
                        info += f" · peak {fmt_bytes(peak)}"
                        if self.predicted is not None:
                            info += f" (predicted {fmt_bytes(self.predicted.peak_bytes)})"
                    bar.update(task, completed=step + 1, info=info)
                    done = step + 1
                    if self.stop_requested or (self.checkpoint_every and done % self.checkpoint_every == 0):
                        self.save(done)
                    if self.stop_requested:
                        self.console.print(f"interrupted: checkpoint at step {done} written; resume with --resume")
                        break
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        return records

    def _interrupt(self, signum, frame):
        if self.stop_requested:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.stop_requested = True
        self.console.print("[yellow]Ctrl-C: finishing this step, then writing a checkpoint (again to abort)[/]")


def _describe(cfg: Config) -> str:
    text = f"micro-batch {cfg.micro_batch} x {cfg.grad_accum}"
    if cfg.checkpoint != "none":
        text += f", checkpoint {cfg.checkpoint}"
    return text


def train(workload: Workload, steps: int, global_batch: int, *, budget=None, device: str = "cpu",
          config: Config | None = None, micro_batch: int | None = None, precision: str | None = None,
          seed: int = 0, out: str | Path | None = None, checkpoint_every: int | None = None,
          resume: bool = False, schedule: str = "cosine", warmup: int | None = None, progress: bool = True,
          console=None) -> RunResult:
    """Train for `steps` optimizer steps of `global_batch` samples. Without `config` (or `micro_batch`) the
    planner chooses one for the budget; with one, it is the starting point OOM recovery may still change."""
    from rich.console import Console

    from memfit.planner.search import plan, resolve_budget
    from memfit.report.plots import plot_loss, plot_memory_timeline

    console = console or Console()
    if steps < 1 or global_batch < 1:
        raise ValueError("steps and global batch must be >= 1")
    out = Path(out) if out else Path("runs") / f"{workload.name.replace('/', '_').replace(':', '_')}-" \
                                               f"{datetime.datetime.now():%Y%m%d-%H%M%S}"
    if resume and ckpt.latest_checkpoint(out) is None:
        raise RunError(f"--resume: no complete checkpoint under {out}")
    if not resume and ckpt.list_checkpoints(out):  # a fresh run among them would resume into the old one
        raise RunError(f"{out} already holds checkpoints of a run (newest: step {ckpt.list_checkpoints(out)[-1][0]}); "
                       "resume it with --resume, or start the new run in another folder")
    out.mkdir(parents=True, exist_ok=True)
    dev = get_device(device)
    budget_bytes = resolve_budget(budget, dev) if budget is not None else None
    predicted = None
    if config is None and micro_batch is None:
        chosen = plan(workload, global_batch, budget=budget, device=dev, precision=precision)
        config, predicted = chosen.config, chosen.estimate
        (out / "plan.json").write_text(json.dumps(chosen.to_dict(), indent=1))
        console.print(f"plan: {_describe(config)}, {config.precision}, predicted peak {fmt_bytes(chosen.peak_bytes)}, "
                      f"{chosen.samples_per_second:.1f} samples/s (saved to {out / 'plan.json'})")
    else:
        config = config or Config(micro_batch=micro_batch, precision=precision or "fp32")
        config = config.replace(grad_accum=math.ceil(global_batch / config.micro_batch))
        predicted = estimate(workload, config, device=dev)
    run = _Run(workload, steps, global_batch, out, dev.name if dev.kind == "cpu" else device, config, seed,
               budget_bytes, checkpoint_every, schedule, warmup if warmup is not None else max(1, steps // 20),
               console, predicted)
    start = run.resume() if resume else 0
    if start == 0 and not resume and run.metrics_path.exists():
        run.metrics_path.unlink()
    records = run.loop(start, progress)
    final = run.trainer.config
    if run.trainer.step_count >= steps:
        run.save(steps)
        ckpt.export_safetensors(run.trainer.model, out / "model.safetensors")
    history = [json.loads(line) for line in run.metrics_path.read_text().splitlines() if line.strip()]
    losses = [r for r in history if "loss" in r]
    report = _report(records, predicted, final, global_batch)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    if losses:
        plot_loss(losses, out / "loss.png", title=f"{workload.name}: training loss")
    if predicted is not None:
        plot_memory_timeline(predicted, out / "memory.png", title=f"{workload.name}: memory of one step (predicted)")
    return RunResult(out=out, steps=run.trainer.step_count, config=final,
                     final_loss=losses[-1]["loss"] if losses else float("nan"), metrics=history, report=report)


def _report(records: list[dict], predicted, config: Config, global_batch: int) -> dict:
    steady = records[1:] or records  # the first step pays for allocator and kernel warm-up
    times = sorted(r["step_seconds"] for r in steady)
    peaks = [r["peak_bytes"] for r in steady if r["peak_bytes"] is not None]
    median = times[len(times) // 2] if times else None
    from memfit.planner.costmodel import profile_for, step_seconds
    predicted_seconds = None
    if predicted is not None:
        try:
            predicted_seconds = step_seconds(profile_for(get_device(predicted.device)), predicted,
                                             config.grad_accum / max(1, Config.from_dict(predicted.config).grad_accum))
        except Exception:  # noqa: BLE001 - a report without a time prediction is still a report
            predicted_seconds = None
    return dict(config=config.to_dict(), steps=len(records),
                predicted_peak_bytes=predicted.peak_bytes if predicted else None,
                measured_peak_bytes=max(peaks) if peaks else None,
                predicted_step_seconds=predicted_seconds, measured_step_seconds=median,
                samples_per_second=global_batch / median if median else None,
                oom_recoveries=sum(len(r["events"]) for r in records))
