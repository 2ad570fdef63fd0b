"""Training on many ranks: launching them, joining their process group, and the state they share.

`memfit train --gpus N` on one machine starts N copies of itself with torchrun (`launch`); under any launcher
that sets RANK / WORLD_SIZE / MASTER_ADDR (torchrun, Slurm's srun with those exported) each copy joins that
world (`join`): gloo on CPUs, NCCL on GPUs. Each rank trains its share of every global batch (runtime/
trainer.py) under the layout's FSDP2 sharding (strategies/data_parallel.py).

Checkpoints are PyTorch's own distributed checkpoint engine (`torch.distributed.checkpoint`): every rank
writes its own shards of the model and optimizer states, rank 0 commits them with the rest of the run's state
(atomic, checksummed: runtime/checkpoints.py `save_sharded`), and a resume at whatever world size the run now
has (4 -> 2 -> 1) reads each rank's part back. Only the final model export (`model.safetensors`) gathers the
full weights, on rank 0.

Out of memory on any rank: the other ranks are waiting in a collective that rank will never join, so no
agreement inside the step is possible. The rank that ran out writes the next configuration of the recovery
ladder to the run folder (`RECOVERY`) and exits; torchrun ends the others; `run_ranks` starts all of them
again with `--resume`, and every rank continues from the newest checkpoint (or the first step) in that
configuration -- the same math, the steps since the checkpoint redone. Under an outside launcher the same
command with `--resume` does it.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
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


def launch(gpus: int, argv: list[str], launch_id: str | None = None) -> int:
    """Run `memfit <argv>` as `gpus` ranks on this machine with torchrun; its exit status."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
           "--no-python", sys.executable, "-m", "memfit.cli", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": str(rank_threads())}
    if launch_id:
        env["MEMFIT_LAUNCH"] = launch_id
    return subprocess.call(cmd, env=env)


def run_ranks(gpus: int, argv: list[str], out: Path, say=print) -> int:
    """`launch`, started again with `--resume` each time a rank ran out of memory and asked for the next
    configuration (`request_recovery`); the exit status of the last launch."""
    for _ in range(MAX_RESTARTS + 1):
        launch_id = uuid.uuid4().hex
        code = launch(gpus, argv, launch_id)
        request = recovery_request(out)
        if code == 0 or request is None or request.get("launch") != launch_id:
            return code
        say(f"memfit: {request['event']}: starting the {gpus} ranks again")
        if "--resume" not in argv:
            argv = [*argv, "--resume"]
    return code


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
