"""Pipeline parallelism: each stage estimated on fake tensors as its own rank, against real gloo ranks running
torch.distributed.pipelining's schedules, and the schedules' closed forms."""
import pytest
import torch
from torch import nn

import memfit
from memfit import Config
from memfit.errors import ConfigError
from memfit.strategies.pipeline_parallel import stage_blocks
from memfit.workloads import builtin


def test_blocks_split_evenly_and_the_first_stages_take_what_is_left():
    assert stage_blocks(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_blocks(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    with pytest.raises(ConfigError, match="at least 4 repeated blocks"):
        stage_blocks(3, 4)


def _llama():
    import transformers

    from memfit.workloads import hf

    config = transformers.AutoConfig.for_model("llama", hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    return hf.from_config(config, name="hf:llama", seq=32)


@pytest.mark.parametrize("name,schedule,checkpoint", [("gpt-tiny", "1f1b", "none"), ("gpt-tiny", "gpipe", "all"),
                                                      ("llama", "1f1b", "all")])
def test_every_stage_estimate_matches_its_real_gloo_rank(name, schedule, checkpoint):
    """Two ranks (forked, gloo) run the schedule on the stages memfit cuts; each measures its own peak with
    the CPU allocator's running total (benchmarks/truth.py). The stages differ (embedding, head and loss,
    micro-batches in flight), so each is compared with its own rank. Measured exact to tens of bytes
    (the scalars a step keeps); 0.2% leaves room for kernel workspaces on another processor, and is a fifth
    of the one activation a gloo send holds past its micro-batch's backward under 1F1B."""
    from truth import rank_step_peaks

    wl = builtin("gpt-tiny") if name == "gpt-tiny" else _llama()
    cfg = Config(micro_batch=2, grad_accum=4, pp=2, pp_schedule=schedule, activation_checkpoint=checkpoint)
    est = memfit.estimate(wl, cfg)
    real = rank_step_peaks(wl, cfg)
    assert [s["peak_bytes"] for s in est.stages] == pytest.approx(real, rel=0.002)
    assert est.peak_bytes == max(s["peak_bytes"] for s in est.stages)


def test_stages_of_data_parallel_ranks_match_their_real_ranks():
    """Two stages of two FSDP2 ranks each (a 2 x 2 mesh, the pipeline outermost): each stage is traced as its
    first rank. gloo's worker thread frees a collective's tensors late, which only ever adds to a rank's peak
    (BENCHMARKS.md, data parallel): each stage's estimate is compared with the lowest peak among its ranks
    over up to RACE_RUNS runs, as the data-parallel tests do."""
    from test_data_parallel import RACE_RUNS
    from truth import rank_step_peaks

    wl = builtin("gpt-tiny")
    cfg = Config(micro_batch=2, grad_accum=4, pp=2, gpus=2, data_parallel="fsdp", activation_checkpoint="all")
    est = [s["peak_bytes"] for s in memfit.estimate(wl, cfg).stages]

    def lowest(peaks):  # each stage's lowest rank
        return [min(peaks[s * cfg.gpus:(s + 1) * cfg.gpus]) for s in range(cfg.pp)]

    peaks = rank_step_peaks(wl, cfg)
    for _ in range(RACE_RUNS - 1):
        if est == pytest.approx(lowest(peaks), rel=0.01):
            break
        peaks = [min(a, b) for a, b in zip(peaks, rank_step_peaks(wl, cfg))]
    assert est == pytest.approx(lowest(peaks), rel=0.01)


def _train(config: Config, steps: int = 3):
    from torch.distributed.tensor import DTensor

    from memfit.runtime.trainer import Trainer

    trainer = Trainer(builtin("gpt-tiny"), config, seed=0, global_batch=16)
    losses = [trainer.step() for _ in range(steps)]
    return losses, {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().numpy().copy()
                    for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("schedule,gpus", [("gpipe", 1), ("1f1b", 1), ("1f1b", 2)])
def test_a_pipeline_trains_as_one_process(schedule, gpus):
    """Each stage keeps its parameters under the model's own names; together they are the whole model. Every
    micro-batch's loss is weighted by its share of the batch, as one process weights it, and each stage
    runs the same ops on the same values in the same order: fp32, 1e-5 as for the data-parallel layouts
    (over FSDP2 ranks the gradients are averaged, where the order of the sums differs)."""
    from truth import on_gloo_ranks

    one_losses, one_weights = _train(Config(micro_batch=4, grad_accum=4))
    cfg = Config(micro_batch=4, grad_accum=4 // gpus, pp=2, pp_schedule=schedule, gpus=gpus,
                 data_parallel="fsdp" if gpus > 1 else "none")
    results = on_gloo_ranks(cfg.world, lambda rank: _train(cfg))
    weights = {}
    for stage in range(cfg.pp):
        stage_weights = results[stage * gpus][1]
        assert not set(weights) & set(stage_weights)  # no parameter on two stages
        weights.update(stage_weights)
    for losses, _ in results:
        assert losses == pytest.approx(one_losses, rel=1e-5)
    assert set(weights) == set(one_weights)
    for name, w in one_weights.items():
        torch.testing.assert_close(torch.from_numpy(weights[name]), torch.from_numpy(w), rtol=1e-5, atol=1e-5,
                                   msg=name)


def test_one_f_one_b_holds_the_micro_batches_the_closed_form_says():
    """GPipe runs every forward before any backward: stage s holds all n micro-batches' activations, one more
    per micro-batch (A_s, measured as gpipe(n+1) - gpipe(n)). 1F1B holds k = min(pp - s, n): n - k fewer,
    while the engine's receive buffers for the other micro-batches stay allocated on every stage after the
    first (one hidden state each). The traced activations at each stage's peak follow that exactly."""
    wl = builtin("gpt-tiny", layers=4)
    pp, n, micro = 4, 6, 2
    hidden = micro * 64 * 64 * 4  # gpt-tiny: seq 64, d_model 64, fp32

    def activations(schedule, count):
        est = memfit.estimate(wl, Config(micro_batch=micro, grad_accum=count, pp=pp, pp_schedule=schedule))
        return [s["breakdown"]["activations"] for s in est.stages]

    gpipe, gpipe_more, one_f = activations("gpipe", n), activations("gpipe", n + 1), activations("1f1b", n)
    for s in range(pp):
        per_micro_batch = gpipe_more[s] - gpipe[s]
        k = min(pp - s, n)
        idle_buffers = (n - k) * hidden if s > 0 else 0
        assert one_f[s] == gpipe[s] - (n - k) * per_micro_batch + idle_buffers, s


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_what_a_pipeline_cannot_split_is_refused_in_one_line():
    tied = memfit.Workload(model=Tied, batch=lambda n: torch.randint(0, 50, (n, 8)),
                           loss=lambda m, b: m(b).logsumexp(-1).mean())
    with pytest.raises(ConfigError, match="tied embeddings"):
        memfit.estimate(tied, Config(grad_accum=2, pp=2))
    with pytest.raises(ConfigError, match="at least 4 repeated blocks"):
        memfit.estimate(builtin("gpt-tiny"), Config(grad_accum=4, pp=4))
    with pytest.raises(ConfigError, match="at least 2 micro-batches"):
        Config(pp=2)
    with pytest.raises(ConfigError, match="not supported yet"):
        Config(pp=2, grad_accum=2, offload_optimizer=True)
