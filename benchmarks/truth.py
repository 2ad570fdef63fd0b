"""Independent ground truth: the peak of a real CPU training step as the PyTorch profiler's memory
timeline sees it. Shares no counting code with memfit (only the step being measured)."""
from __future__ import annotations

import contextlib
import gc

import torch
from torch.profiler import ProfilerActivity, profile

from memfit.memory.kernels import rank_threads
from memfit.torch_internals import profiler_allocations, profiler_memory_timeline


def profiler_peak(fn) -> int:
    """Run fn() under the profiler and return the peak of CPU-allocator bytes, pre-existing included."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        fn()
    current = peak = 0
    for _, action, _, nbytes in profiler_memory_timeline(prof):
        name = getattr(action, "name", str(action))
        if name in ("PREEXISTING", "CREATE"):
            current += nbytes
        elif name == "DESTROY":
            current -= nbytes
        peak = max(peak, current)
    return peak


def _warm_up(step, workload, config) -> None:
    """Steps until one is not skipped: fp16 loss scaling skips a step whose gradients overflow (its scale
    starts at 2**16), and a skipped step makes no optimizer state, so the step after it would be a first
    step, not the steady one the estimate is of (ViT-MAE in fp16: 23% below it)."""
    for _ in range(10):
        skipped = step.skipped_steps
        step(workload.batch(config.rank_batch))
        if step.skipped_steps == skipped:
            return


def real_step_peak(workload, config, repeats: int = 2) -> int:
    """Warm-up step, then profiled steps on fresh batches (one rank's share): the step memfit.estimate predicts.
    The minimum over `repeats` steps: the profiler also records the odd allocation made elsewhere in the
    process while it runs (seen: +42 KB once in three runs of a 62 KB step), which only ever adds."""
    from memfit.step import TrainStep

    torch.manual_seed(0)
    step = TrainStep(workload, config, "cpu")
    _warm_up(step, workload, config)
    peaks = []
    for _ in range(repeats):
        batch = workload.batch(config.rank_batch)
        peaks.append(profiler_peak(lambda: step(batch)))
        del batch
    return min(peaks)


def allocator_step_peak(workload, config, repeats: int = 2, settle: bool = False) -> int:
    """The peak of a real CPU step by the CPU allocator's own running total of allocated bytes, as the
    profiler reports it with every allocation: the model is built, stepped once and stepped `repeats` more
    times inside one profile, so every live byte was allocated under it; the peak is the highest total
    during the last steps (their minimum, as in `real_step_peak`). Unlike the memory timeline this needs no
    data-flow analysis, which FSDP2's storage resizing trips (profiler "version mismatch").

    Left out: what gloo allocates inside its own collectives (`gloo:*` ops, on its thread): an all-gather
    gathers into a buffer of the output's size and frees it when done, racing the step's own allocations.
    NCCL gathers into the output itself, so a GPU rank has no such buffer; memfit estimates the step's own
    memory and says so for CPU ranks."""
    from torch.autograd.profiler import record_function

    from memfit.step import TrainStep

    torch.manual_seed(0)
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step = TrainStep(workload, config, "cpu")
        _warm_up(step, workload, config)
        for i in range(repeats):
            batch = workload.batch(config.rank_batch)
            gc.collect()
            if settle:
                _settle_gloo()
            with record_function(f"memfit.truth.step{i}"):
                step(batch)
            del batch
    windows, events = profiler_allocations(prof, "memfit.truth.step")
    base = events[0][2] - events[0][1]  # what earlier profiles in this process left live
    running, backend, held = [], 0, set()  # gloo's own blocks: allocated inside a gloo op, freed anywhere
    for t, size, total, op, ptr in events:
        if size > 0 and op.startswith("gloo:"):
            held.add(ptr)
            backend += size
        elif size < 0 and ptr in held:
            held.discard(ptr)
            backend += size
        running.append((t, total - base - backend))
    peaks = []
    for start, end in windows:
        before = [live for t, live in running if t < start]
        inside = [live for t, live in running if start <= t <= end]
        peaks.append(max([before[-1], *inside]))
    return min(peaks)


def on_gloo_ranks(n: int, fn, timeout: float = 300.0) -> list:
    """fn(rank) on each of n forked processes joined in one gloo process group on this machine; the results,
    rank 0 first. A rank that raises fails the call with its error, one that ends without a result fails it at
    once, and ranks that have not all answered within `timeout` seconds fail it too (a rank stuck in a
    collective would otherwise keep its peers and the caller waiting); none is left running."""
    import multiprocessing as mp
    import queue
    import socket
    import time

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    results = ctx.Queue()

    def rank_main(rank: int) -> None:
        import torch.distributed as dist

        try:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
            torch.set_num_threads(rank_threads())  # as `memfit train --gpus` starts its ranks
            results.put((rank, fn(rank)))
            if dist.is_initialized():  # fn may have left the world itself
                dist.destroy_process_group()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            results.put((rank, RuntimeError(repr(e))))

    procs = [ctx.Process(target=rank_main, args=(r,)) for r in range(n)]
    for p in procs:
        p.start()
    got: dict = {}
    answered = False
    try:
        deadline = time.monotonic() + timeout
        while len(got) < n:
            try:
                rank, value = results.get(timeout=1.0)
                got[rank] = value
                continue
            except queue.Empty:
                pass
            silent = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
            if silent and results.empty():  # (a rank's queue is flushed before it exits: read what it put first)
                raise RuntimeError(f"ranks {silent} ended without a result (exit codes "
                                   f"{[procs[r].exitcode for r in silent]})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks {[r for r in range(n) if r not in got]} gave no result in {timeout:.0f} s")
        answered = True
    finally:
        for p in procs:  # after a failure the others may wait on the missing rank: ended at once
            p.join(timeout=10 if answered else 0)
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: v for r, v in got.items() if isinstance(v, RuntimeError)}
    if errors:
        raise RuntimeError(f"ranks failed: {errors}")
    return [got[r] for r in range(n)]


def _settle_gloo() -> None:
    """Let gloo's worker threads drop what they still hold of the last step's collectives before the next step
    is measured: one more collective (a barrier) takes each worker's slot, and a pause lets the threads run."""
    import time

    import torch.distributed as dist

    dist.barrier()
    time.sleep(0.05)


@contextlib.contextmanager
def _gloo_frees_on_time():
    """Each wait on a collective or a send/receive yields the CPU for 2 ms, so that gloo's worker thread drops
    the finished work's tensors before the step goes on, as a GPU stream frees them in order. Without it, on a
    busy machine (several ranks on two cores) the worker runs late and a rank's peak comes out one or more
    buffers high, at random."""
    import time

    import torch.distributed as dist

    work = dist.Work
    wait = work.wait

    def wait_then_yield(self, *args, **kwargs):
        done = wait(self, *args, **kwargs)
        time.sleep(0.002)
        return done

    work.wait = wait_then_yield
    try:
        yield
    finally:
        work.wait = wait


def rank_step_peaks(workload, config, repeats: int = 2, settle: bool = False) -> list[int]:
    """`allocator_step_peak` on each of config.world real ranks (forked processes joined by gloo on this machine),
    each rank stepping on its own share of the batch, its waits yielding to gloo's worker (`_gloo_frees_on_time`):
    every rank's own peak, rank 0 first."""
    def rank_peak(rank: int) -> int:
        with _gloo_frees_on_time():
            return allocator_step_peak(workload, config, repeats, settle)

    return on_gloo_ranks(config.world, rank_peak)


def generate_batch_peak(model, run) -> int:
    """The peak of `run()`, a `generate_batch` call on `model`, weights included: the CPU allocator's running
    total under a profiler started inside the manager's background thread (where the cache, the batch tensors
    and every forward are allocated; the profiler records allocations only on the thread it runs on), plus the
    weights and buffers already live. The caller's thread only queues requests and collects token lists."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    loop = ContinuousBatchingManager._run_generation_loop
    peaks = []

    def profiled(self, **kwargs):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loop(self, **kwargs)
        _, events = profiler_allocations(prof, "memfit.truth")
        base = events[0][2] - events[0][1]  # what earlier profiles in this process left live
        peaks.append(max(total for _, _, total, _, _ in events) - base)

    gc.collect()
    ContinuousBatchingManager._run_generation_loop = profiled
    try:
        run()
    finally:
        ContinuousBatchingManager._run_generation_loop = loop
    weights = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    return weights + peaks[0]


def lowest_rank_peaks(workload, config, estimate: int, runs: int) -> tuple[list[int], int]:
    """Each rank's lowest peak over up to `runs` runs of real gloo ranks, and the runs made: gloo's worker thread
    frees a finished collective's tensors late, which only ever adds to a rank's peak, so runs go on while the
    lowest rank is more than 1% from `estimate` (the minimum can only come down towards the race-free peak: an
    estimate above it still fails, and one below it too)."""
    peaks, made = rank_step_peaks(workload, config, settle=True), 1
    while made < runs and abs(estimate / min(peaks) - 1) > 0.01:
        peaks, made = [min(a, b) for a, b in zip(peaks, rank_step_peaks(workload, config, settle=True))], made + 1
    return peaks, made
