"""Runs for the resume tests (not itself a test module)."""
import memfit


def whole_and_resumed(tmp_path, workload, config, steps: int = 4, global_batch: int = 8):
    """The same deterministic run twice: uninterrupted, and stopped at half-way then resumed. Returns both
    results; a resume is exact when their `model.safetensors` are the same bytes."""
    half = steps // 2
    options = dict(config=config, schedule="constant", progress=False)
    whole = memfit.train(workload, steps, global_batch, deterministic=True, out=tmp_path / "whole", **options)
    memfit.train(workload, half, global_batch, deterministic=True, checkpoint_every=half, out=tmp_path / "part",
                 **options)
    resumed = memfit.train(workload, steps, global_batch, resume=True, out=tmp_path / "part", **options)
    return whole, resumed
