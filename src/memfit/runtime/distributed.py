"""Training on many ranks: launching them, joining their process group, and the state they share.

`memfit train --gpus N` on one machine starts N copies of itself under torch's elastic agent, the launcher
inside torchrun, run in this process (`launch`); under any launcher that sets RANK / WORLD_SIZE / MASTER_ADDR
(torchrun, Slurm's srun with those exported) each copy joins that world (`join`): gloo on CPUs, NCCL on GPUs.
Each rank trains its share of every global batch (runtime/trainer.py) under the layout's FSDP2 sharding
(strategies/data_parallel.py).

Checkpoints are PyTorch's own distributed checkpoint engine (`torch.distributed.checkpoint`): every rank
writes its own shards of the model and optimizer states, rank 0 commits them with the rest of the run's state
(atomic, checksummed: runtime/checkpoints.py `save_sharded`), and a resume at whatever world size the run now
has (4 -> 2 -> 1) reads each rank's part back. Only the final model export (`model.safetensors`) gathers the
full weights, on rank 0.

Out of memory on any rank: the other ranks are waiting in a collective that rank will never join, so no
agreement inside the step is possible. The rank that ran out writes the next configuration of the recovery
ladder to the run folder (`RECOVERY`) and exits; the agent ends the others; `run_ranks` starts all of them
again with `--resume`, and every rank continues from the newest checkpoint (or the first step) in that
configuration -- the same math, the steps since the checkpoint redone. Under an outside launcher the same
command with `--resume` does it.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import sys
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from memfit.errors import RunError
from memfit.memory.kernels import rank_threads

# A rank that dies leaves the others waiting in a collective: they give up after this long.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("MEMFIT_COLLECTIVE_TIMEOUT", "120")))


def launched() -> bool:
    """This process was started by a launcher as one rank of a world (torchrun sets these)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


RECOVERY = "recovery.json"  # in the run folder: the configuration every rank continues in after an OOM
MAX_RESTARTS = 16  # the recovery ladder is shorter than this for any micro-batch below 2**14


def launch(gpus: int, argv: list[str], launch_id: str | None = None, debug: bool = False) -> str | None:
    """Run `memfit <argv>` as `gpus` ranks on this machine under torch's elastic agent, the one torchrun runs,
    here in this process: None when every rank exited 0, else what happened to the rank that failed first,
    in words. Each rank prints its own error; the agent's log lines and its traceback are shown only with
    `debug`."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=gpus, run_id=launch_id or uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0)
    env = dict(OMP_NUM_THREADS=str(rank_threads()), **({"MEMFIT_LAUNCH": launch_id} if launch_id else {}))
    # the agent's modules each set their own logger's level: quieted one by one
    agent_logs = [log for name, log in logging.root.manager.loggerDict.items()
                  if name.startswith("torch.distributed.elastic") and isinstance(log, logging.Logger)]
    levels = [log.level for log in agent_logs]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    saved = {name: os.environ.get(name) for name in [*env, "TORCHELASTIC_SIGNALS_TO_HANDLE"]}
    os.environ.update(env)  # the agent gives its ranks this process's environment
    for log in agent_logs if not debug else ():
        log.setLevel(logging.CRITICAL)
    try:
        elastic_launch(config, sys.executable)("-m", "memfit.cli", *argv)
        return None
    except ChildFailedError as e:
        if debug:
            raise
        rank, failure = _first_failure(e.failures)
        how = (f"was stopped by {failure.signal_name()}" if failure.exitcode < 0
               else f"exited with status {failure.exitcode} (its error is above)")
        return f"rank {rank} of {gpus} {how}; the agent stopped the other ranks"
    except SignalException as e:  # Ctrl-C or a kill reached the agent: it has stopped the ranks
        raise KeyboardInterrupt(f"interrupted ({e.sigval.name}): the {gpus} ranks were stopped") from e
    finally:
        for log, level in zip(agent_logs, levels):
            log.setLevel(level)
        for sig, handler in handlers.items():  # the agent installs its own; this process keeps the ones it had
            signal.signal(sig, handler)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _first_failure(failures: dict) -> tuple:
    """The rank that failed first, and how. The agent stamps a rank stopped by a signal with the second it saw
    it, so a rank killed and its peers can share one: a peer gloo aborted (SIGABRT: its collective lost the
    killed rank) or the agent itself stopped (SIGTERM) is, within that second, the consequence, not the cause."""
    def order(rank):
        failure = failures[rank]
        return failure.timestamp, failure.exitcode < 0 and failure.signal_name() in ("SIGABRT", "SIGTERM"), rank
    rank = min(failures, key=order)
    return rank, failures[rank]


def run_ranks(gpus: int, argv: list[str], out: Path, say=print, debug: bool = False) -> str | None:
    """`launch`, started again with `--resume` each time a rank ran out of memory and asked for the next
    configuration (`request_recovery`); what went wrong in the last launch, or None."""
    for _ in range(MAX_RESTARTS + 1):
        launch_id = uuid.uuid4().hex
        failure = launch(gpus, argv, launch_id, debug)
        request = recovery_request(out)
        if failure is None or request is None or request.get("launch") != launch_id:
            return failure
        say(f"memfit: {request['event']}: starting the {gpus} ranks again")
        if "--resume" not in argv:
            argv = [*argv, "--resume"]
    return failure


def request_recovery(out: Path, step: int, config: dict, event: str) -> None:
    """Record, atomically, the configuration the ranks go on in after an OOM at `step`, for this launch."""
    path = out / RECOVERY
    tmp = path.with_name(f"{RECOVERY}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dict(step=step, config=config, event=event, launch=os.environ.get("MEMFIT_LAUNCH"))))
    os.replace(tmp, path)


def recovery_request(out: Path) -> dict | None:
    try:
        return json.loads((out / RECOVERY).read_text())
    except (OSError, ValueError):
        return None


def join(gpus: int, device: str) -> int:
    """Join the launcher's world of `gpus` ranks (gloo on CPUs, NCCL on GPUs); this rank's number."""
    world = int(os.environ["WORLD_SIZE"])
    if world != gpus:
        raise RunError(f"--gpus {gpus}, but the launcher started {world} ranks")
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
    return dist.get_rank()


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The whole model and optimizer state, name-keyed, gathered on rank 0 (empty on the others); a
    collective every rank calls."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def pipeline_full_model_state(model: torch.nn.Module, config) -> dict:
    """A pipeline's whole model, name-keyed, on rank 0 (empty on the others); a collective every rank calls.
    torch's full state dict keeps its tensors on global rank 0 alone, which holds only the first stage: here
    each stage's first rank makes its stage's tensors whole (FSDP shards gathered one tensor at a time, onto
    the CPU) and rank 0 collects the stages'."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    first = dist.get_rank() % (config.gpus * config.tp) == 0  # the mesh: stages outermost
    own = {}
    for name, t in get_model_state_dict(model).items():
        whole = t.full_tensor() if isinstance(t, DTensor) else t  # a collective over the stage's ranks
        if first:
            own[name] = whole.detach().cpu()
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(own if first else None, parts, dst=0)
    return {k: v for part in parts or [] if part for k, v in part.items()}


def agree(value):
    """Rank 0's `value` on every rank (a small picklable object): one decision the whole world acts on."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(value) -> list:
    """Every rank's `value` (small, picklable), rank 0's first, on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
