"""Lightning with MemfitBatchSize: the batch size and accumulate_grad_batches set from an estimate before the
first step, no trial steps (python examples/lightning_fit.py; 3 steps on the CPU)."""
import logging

import lightning.pytorch as L
import torch
import torch.nn.functional as F

from memfit.integrations.lightning import MemfitBatchSize


class Net(L.LightningModule):
    def __init__(self, batch_size=512):
        super().__init__()
        self.batch_size = batch_size  # where BatchSizeFinder looks; memfit sets it there too
        self.net = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 10))

    def training_step(self, batch, i):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(4096, 256), torch.randint(0, 10, (4096,)))
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)


logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
model, fit = Net(), MemfitBatchSize(budget="17MiB", device="cpu")
trainer = L.Trainer(accelerator="cpu", max_steps=3, callbacks=[fit], logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model)
print(f"{model.batch_size} x {trainer.accumulate_grad_batches}: predicted peak {fit.plan.peak_bytes / 2**20:.1f} MiB")
