"""Runs for the resume tests (not itself a test module)."""
import contextlib
import copy
from unittest import mock

import memfit
from memfit.runtime import run


@contextlib.contextmanager
def _predicted_once():
    """The three runs are of one workload and configuration: the first run's prediction (a trace in a forked
    child, priced) is made for real and handed, as a copy, to the two runs after it, which would trace the
    same step again (0.3-0.6 s each here). What the tests compare, the weights the runs end with, does not
    read it."""
    real, made = run.predict, {}

    def once(workload, config, dev):
        key = (id(workload), config, dev.name)
        if key not in made:
            made[key] = real(workload, config, dev)
        return copy.deepcopy(made[key])

    with mock.patch.object(run, "predict", once):
        yield


def whole_and_resumed(tmp_path, workload, config, steps: int = 4, global_batch: int = 8):
    """The same deterministic run twice: uninterrupted, and stopped at half-way then resumed. Returns both
    results; a resume is exact when their `model.safetensors` are the same bytes."""
    half = steps // 2
    options = dict(config=config, schedule="constant", progress=False)
    with _predicted_once():
        whole = memfit.train(workload, steps, global_batch, deterministic=True, out=tmp_path / "whole", **options)
        memfit.train(workload, half, global_batch, deterministic=True, checkpoint_every=half, out=tmp_path / "part",
                     **options)
        resumed = memfit.train(workload, steps, global_batch, resume=True, out=tmp_path / "part", **options)
    return whole, resumed
