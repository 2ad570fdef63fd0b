"""Traces kept on disk: a second plan reads what the first traced, and nothing it depends on can change
without changing the key."""
import functools

import pytest
import torch

from memfit import Config
from memfit.memory import trace_cache
from memfit.memory.devices import get_device
from memfit.planner.search import plan, probe_pair
from memfit.workloads import builtin, load_workload


@pytest.fixture
def cache_on(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMFIT_TRACE_CACHE", "1")
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path))
    return tmp_path / "traces"


def _key(workload, config=Config(), device="h100"):
    return trace_cache.key_of(functools.partial(probe_pair, workload, config, get_device(device)))


def test_a_second_plan_traces_nothing_and_answers_the_same(cache_on, monkeypatch):
    wl = builtin("gpt-tiny", layers=2)
    first = plan(wl, 16, budget="1GiB", device="h100")
    assert list(cache_on.glob("*.pkl"))

    def traced(*args, **kwargs):
        raise AssertionError("a cached plan traced again")

    monkeypatch.setattr(trace_cache, "run_isolated_many", traced)
    again = plan(builtin("gpt-tiny", layers=2), 16, budget="1GiB", device="h100")
    assert again.to_dict() == first.to_dict()


def test_the_key_follows_the_model_the_config_the_device_and_the_users_files(cache_on, tmp_path):
    base = _key(builtin("gpt-tiny", layers=4))
    assert base is not None and base == _key(builtin("gpt-tiny", layers=4))
    assert len({base, _key(builtin("gpt-tiny", layers=2)), _key(builtin("gpt-tiny", layers=4), Config(precision="bf16")),
                _key(builtin("gpt-tiny", layers=4), device="a100-80gb")}) == 4
    job = tmp_path / "job"
    job.mkdir()
    (job / "helpers.py").write_text("WIDTH = 32\n")
    (job / "job.py").write_text(
        "import torch\nimport memfit\nfrom helpers import WIDTH\n\n"
        "def workload():\n"
        "    return memfit.Workload(model=lambda: torch.nn.Linear(WIDTH, 4), batch=lambda n: torch.randn(n, WIDTH),\n"
        "                           loss=lambda m, b: m(b).square().mean())\n")
    first = _key(load_workload(f"{job / 'job.py'}:workload"))
    assert first is not None
    (job / "helpers.py").write_text("WIDTH = 64\n")  # a module beside the job file is part of the job
    trace_cache._folder_hash.cache_clear()
    assert _key(load_workload(f"{job / 'job.py'}:workload")) != first


def test_what_cannot_be_described_is_not_cached(cache_on):
    table = torch.zeros(3)  # a tensor in a closure: its values are not part of any key
    wl = builtin("gpt-tiny", layers=2)
    odd = type(wl)(name="odd", model=lambda: torch.nn.Linear(3, 3) if table.sum() == 0 else None, batch=wl.batch,
                   loss=wl.loss)
    assert _key(odd) is None
    assert trace_cache.key_of(lambda: 1) is None  # only partials of describable arguments


def test_off_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMFIT_TRACE_CACHE", "0")
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path))
    plan(builtin("gpt-tiny", layers=1), 8, budget="1GiB", device="h100")
    assert not (tmp_path / "traces").exists()
