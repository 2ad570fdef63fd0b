"""A loop of one's own (Accelerate's or plain PyTorch): memfit.find_batch_size hands it the micro-batch and
accumulation for a global batch of 512 within a budget, from an estimate instead of out-of-memory retries
(python examples/own_loop.py)."""
import torch
import torch.nn.functional as F

import memfit

step = memfit.Workload(  # the loop's own model, batch, loss and optimizer, for the estimate
    model=lambda: torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 10)),
    batch=lambda n: (torch.randn(n, 256), torch.randint(0, 10, (n,))),
    loss=lambda model, b: F.cross_entropy(model(b[0]), b[1]),
    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))


@memfit.find_batch_size(step, global_batch=512, budget="16MiB", device="cpu")
def train(batch_size, grad_accum, steps=3):
    model = step.model()
    optimizer = step.optimizer(model.parameters())
    for _ in range(steps):
        for _ in range(grad_accum):
            (step.loss(model, step.batch(batch_size)) / grad_accum).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return batch_size, grad_accum


print("micro-batch %d x %d accumulated" % train())
