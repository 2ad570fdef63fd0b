"""Trainer data: batches depend on (seed, step) only; a Dataset is visited once per epoch in a seeded order."""
import torch
from torch.utils.data import TensorDataset

import memfit
from memfit import Config, Trainer
from memfit.runtime.trainer import dataset_batch
from memfit.workloads import builtin


def test_batches_depend_on_seed_and_step_only():
    wl = builtin("gpt-tiny")
    a, b = Trainer(wl, Config(micro_batch=2), seed=5), Trainer(wl, Config(micro_batch=2), seed=5)
    a.step()
    torch.rand(100)  # the model's RNG stream moving does not move the data
    assert torch.equal(a.batch(3)["tokens"], b.batch(3)["tokens"])
    assert not torch.equal(a.batch(3)["tokens"], Trainer(wl, Config(micro_batch=2), seed=6).batch(3)["tokens"])


def test_a_dataset_is_visited_once_per_epoch_in_a_seeded_order():
    ds = TensorDataset(torch.arange(12).float(), torch.arange(12))
    epoch = torch.cat([dataset_batch(ds, 0, s, 4)[1] for s in range(3)])
    assert sorted(epoch.tolist()) == list(range(12))
    assert epoch.tolist() != list(range(12))  # shuffled
    second = torch.cat([dataset_batch(ds, 0, s, 4)[1] for s in range(3, 6)])
    assert sorted(second.tolist()) == list(range(12)) and second.tolist() != epoch.tolist()
    assert torch.equal(dataset_batch(ds, 0, 4, 4)[1], dataset_batch(ds, 0, 4, 4)[1])


def test_trainer_draws_from_workload_data():
    ds = TensorDataset(torch.randn(20, 4), torch.randn(20, 1))
    wl = memfit.Workload(model=lambda: torch.nn.Linear(4, 1), batch=lambda n: (torch.randn(n, 4), torch.randn(n, 1)),
                         loss=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), data=ds)
    t = Trainer(wl, Config(micro_batch=5))
    x, y = t.batch(0)
    assert x.shape == (5, 4) and any(torch.equal(x[0], row) for row in ds.tensors[0])
    assert isinstance(t.step(), float)
