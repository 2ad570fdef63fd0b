"""Lightning's MemfitBatchSize: the batch size and accumulation set before the first step, no trial step, the
global batch kept, Trainer.fit's profiled peak where predicted; under DDP on two gloo processes it plans
where Lightning's BatchSizeFinder refuses."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import warnings

import pytest

L = pytest.importorskip("lightning.pytorch")

import torch  # noqa: E402
from truth_stacks import run_peak  # noqa: E402

from memfit.errors import ConfigError  # noqa: E402
from memfit.integrations.lightning import MemfitBatchSize  # noqa: E402

# Lightning's own 0-d tensors beyond memfit's step (the logged loss, the closure's result): a few bytes each
SCALARS = 64


class Rows(torch.utils.data.Dataset):
    """Made when read: the dataset holds no tensors."""

    def __len__(self):
        return 4096

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(256, generator=g), torch.randint(0, 10, (), generator=g)


class Net(L.LightningModule):
    def __init__(self, batch_size: int):
        super().__init__()
        self.batch_size = batch_size
        self.net = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 10))
        self.steps = 0  # training_step calls: a trial step would show here

    def training_step(self, batch, i):
        self.steps += 1
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Rows(), batch_size=self.batch_size)


def _trainer(callback, steps=3, **kw):
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    return L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                     callbacks=[callback], **kw)


@pytest.mark.parametrize("precision,clip,budget", [("32-true", 1.0, "17MiB"), ("bf16-mixed", None, "14MiB")])
def test_fit_peaks_where_predicted_with_no_trial_step_and_the_global_batch_kept(precision, clip, budget):
    callback = MemfitBatchSize(budget=budget, device="cpu")

    def run():
        torch.manual_seed(0)
        model = Net(batch_size=512)
        trainer = _trainer(callback, precision=precision, gradient_clip_val=clip)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model)
        return model, trainer

    truth, (model, trainer) = run_peak(run)
    plan = callback.plan
    assert model.batch_size * trainer.accumulate_grad_batches == 512
    assert trainer.accumulate_grad_batches > 1  # the budget forces accumulation
    assert model.steps == 3 * trainer.accumulate_grad_batches  # every training_step call was a real step
    assert plan.peak_bytes <= plan.usable_bytes
    assert abs(plan.peak_bytes - truth) <= SCALARS, (plan.config.describe(), plan.peak_bytes, truth)


def test_refusals_are_one_line():
    with pytest.raises(ConfigError, match="'micro' is not an attribute"):
        _trainer(MemfitBatchSize(budget="1GiB", device="cpu", batch_arg_name="micro")).fit(Net(8))
    with pytest.raises(ConfigError, match="precision '64-true' is not modelled"):
        _trainer(MemfitBatchSize(budget="1GiB", device="cpu"), precision="64-true").fit(Net(8))


def _rank(rank: int, port: int, finder: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")  # as torchrun starts them: Lightning joins, not spawns
    try:
        torch.set_num_threads(1)
        callback = (MemfitBatchSize(budget="17MiB", device="cpu") if finder == "memfit" else
                    L.callbacks.BatchSizeFinder())
        model = Net(batch_size=512)
        trainer = _trainer(callback, steps=2, strategy="ddp", devices=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model)
        results.put((rank, (model.batch_size, trainer.accumulate_grad_batches, model.steps)))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        results.put((rank, f"{type(e).__name__}: {e}"))


def _on_two_ranks(finder: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, finder, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return dict(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def test_under_ddp_every_rank_plans_the_same_where_the_batch_size_finder_raises():
    refused = _on_two_ranks("lightning")
    assert all("not supported with distributed strategies" in v for v in refused.values()), refused
    done = _on_two_ranks("memfit")
    assert done[0] == done[1], done  # the same plan on each rank, nothing exchanged
    assert not isinstance(done[0], str), done
    batch, accum, steps = done[0]
    assert batch * accum == 512 and accum > 1 and steps == 2 * accum
