"""Plain training loops, Accelerate's included: the micro-batch and accumulation picked from an estimate of the
loop's own step (`find_batch_size`), not from out-of-memory retries; and what the other integrations share:
a live model as a factory (`rebuilt`), the device and budget a run has (`target`), and a plan restricted to
what a stack can run (`plan_runnable`).

Nothing here imports transformers, accelerate or lightning: `memfit.find_batch_size` is importable with
memfit alone.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Callable

import torch

from memfit.config import Config
from memfit.errors import ConfigError, PlanError
from memfit.memory.devices import Device, get_device
from memfit.memory.estimate import Estimate, estimate
from memfit.planner.search import Plan, plan
from memfit.units import fmt_bytes
from memfit.workload import Workload


def rebuilt(module: torch.nn.Module, shared: tuple = ()) -> Callable[[], torch.nn.Module]:
    """A factory of copies of `module` whose parameters and buffers are made anew, uninitialised, on the
    device memfit builds on (fake tensors when it traces): the structure, hooks and tied weights of the
    user's own object, none of its values. The module may live on a GPU or the meta device; its weights are
    never copied. `shared`: objects the copy keeps by reference instead of copying (a Lightning trainer)."""
    def build() -> torch.nn.Module:
        memo = {id(obj): obj for obj in shared}
        for t in [*module.parameters(), *module.buffers()]:
            if id(t) not in memo:
                fresh = torch.empty(t.shape, dtype=t.dtype)
                memo[id(t)] = (torch.nn.Parameter(fresh, requires_grad=t.requires_grad)
                               if isinstance(t, torch.nn.Parameter) else fresh)
        return copy.deepcopy(module, memo)
    return build


def target(device: str | None, budget) -> tuple[Device, object]:
    """The device to plan for and its budget: a catalogue name (and the budget given, default the whole
    device), else the current CUDA device with its free memory as the budget."""
    if device is not None:
        return get_device(device), budget
    if not torch.cuda.is_available():
        raise ConfigError("no CUDA device here: name the device to plan for (device='h100', 'cpu', ...; "
                          "`memfit list` shows the catalogue) and a budget")
    dev = get_device(f"cuda:{torch.cuda.current_device()}")
    return dev, budget if budget is not None else torch.cuda.mem_get_info()[0]


def used(est) -> int:
    """What a budget is compared with: nvidia-smi's view on a GPU, live tensor bytes on a CPU (the planner's
    rule)."""
    return est.device_peak_bytes if est.device_peak_bytes is not None else est.peak_bytes


def plan_runnable(workload: Workload, global_batch: int, runs: Callable[[Config], str | None], *, stack: str,
                  confirm: Callable[[Config], Estimate] | None = None, **options) -> Plan:
    """`memfit.plan`, keeping only configurations the stack can run: `runs(config)` says why one cannot
    (None: it can). The planner searches techniques a stack may lack (the optimizer step in backward, a loss
    in chunks, selective checkpointing); where its choice is one, the fastest runnable alternative is taken,
    confirmed by a full estimate if it was not, and the plan says what was passed over. `confirm(config)`:
    the estimate of what the stack itself runs for a configuration (its own checkpointing, its dataloader),
    which then confirms every candidate taken, the chosen one included."""
    found = plan(workload, global_batch, **options)
    device = options.get("device", "cpu")
    passed = []
    ranked = [dataclasses.replace(found, alternatives=[])] + list(found.alternatives)
    for i, cand in enumerate(ranked):
        why = runs(cand.config)
        if why:
            passed.append(f"{cand.config.describe()} ({why})")
            continue
        est = confirm(cand.config) if confirm is not None else cand.estimate or estimate(workload, cand.config, device)
        if used(est) > found.usable_bytes:
            passed.append(f"{cand.config.describe()} (as {stack} runs it, {fmt_bytes(used(est))})")
            continue
        others = [c for c in found.alternatives if c is not cand and not runs(c.config)]
        if i == 0 and confirm is None:
            return dataclasses.replace(found, alternatives=others)
        notes = found.notes if not passed else [
            f"passed over, faster but not what {stack} runs within the budget: {'; '.join(passed)}", *found.notes]
        return dataclasses.replace(found, config=cand.config, peak_bytes=used(est), step_seconds=cand.step_seconds,
                                   samples_per_second=global_batch / cand.step_seconds, estimate=est,
                                   alternatives=others, notes=notes,
                                   confirmed=True)
    raise PlanError(f"nothing {stack} runs fits in {fmt_bytes(found.budget_bytes)} on {found.device} for a global batch "
                    f"of {global_batch}: what fits needs {'; '.join(passed)}")


def find_batch_size(workload: Workload, *, global_batch: int, budget=None, device: str | None = None,
                    precision: str = "fp32", activation_checkpoint="none"):
    """A decorator shaped like Accelerate's `find_executable_batch_size`: the decorated function is called
    with ``batch_size`` and ``grad_accum`` first (then the caller's arguments), chosen so that
    ``batch_size * grad_accum == global_batch`` and the estimated step of `workload` (the loop's own model,
    batch, loss and optimizer, at `precision` and `activation_checkpoint`) fits `budget` on `device`. No
    step is run to find them, so nothing is retried and the global batch never shrinks. The plan is kept on
    the wrapper as ``.plan``.

    Example::

        @memfit.find_batch_size(workload, global_batch=64, budget="20GiB", device="cuda")
        def train(batch_size, grad_accum):
            loader = DataLoader(data, batch_size=batch_size)
            ...
        train()
    """
    def decorator(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            dev, limit = target(device, budget)
            run.plan = plan_runnable(workload, global_batch, _plain_loop_runs, stack="this loop",
                                     budget=limit, device=dev, precision=precision,
                                     activation_checkpoint=activation_checkpoint, offload_activations=False,
                                     offload_optimizer=False, micro_batch=None)
            return fn(run.plan.config.micro_batch, run.plan.config.grad_accum, *args, **kwargs)
        run.plan = None
        return run
    return decorator


def _plain_loop_runs(config: Config) -> str | None:
    """A plain loop trains as written: it accumulates, but does not step the optimizer in backward or chunk
    its loss unless it was written to."""
    if config.optimizer_in_backward:
        return "the optimizer step in backward"
    if config.loss_chunks > 1:
        return "a loss in chunks"
    return None
