"""Pipeline parallelism: each stage estimated on fake tensors as its own rank, against real gloo ranks running
torch.distributed.pipelining's schedules, and the schedules' closed forms."""
import functools

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


_WORKLOADS = {"gpt-tiny": lambda: builtin("gpt-tiny"), "gpt-tiny-4": lambda: builtin("gpt-tiny", layers=4),
              "llama": lambda: _llama()}


@functools.cache
def _stages_estimate(name: str, schedule: str, checkpoint: str = "none") -> memfit.Estimate:
    """Two pipeline ranks, 4 micro-batches of 2: traced once for the tests that read it."""
    cfg = Config(micro_batch=2, grad_accum=4, pp=2, pp_schedule=schedule, activation_checkpoint=checkpoint)
    return memfit.estimate(_WORKLOADS[name](), cfg)


@pytest.mark.parametrize("name,schedule,checkpoint", [("gpt-tiny", "1f1b", "none"), ("gpt-tiny", "gpipe", "all"),
                                                      ("llama", "1f1b", "all"), ("gpt-tiny-4", "zero-bubble", "none")])
def test_every_stage_estimate_matches_its_real_gloo_rank(name, schedule, checkpoint):
    """Two ranks (forked, gloo) run the schedule on the stages memfit cuts; each measures its own peak with
    the CPU allocator's running total (benchmarks/truth.py). The stages differ (embedding, head and loss,
    micro-batches in flight), so each is compared with its own rank. Measured exact to tens of bytes
    (the scalars a step keeps); 0.2% leaves room for kernel workspaces on another processor, and is a fifth
    of the one activation a gloo send holds past its micro-batch's backward under 1F1B. Zero bubble: two
    stages a rank (4 blocks), traced together as the rank; the interleaved rows are in the benchmark."""
    from truth import rank_step_peaks

    est = _stages_estimate(name, schedule, checkpoint)
    real = rank_step_peaks(_WORKLOADS[name](), Config.from_dict(est.config))
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


def _train(config: Config, steps: int = 3, layers: int = 2):
    from torch.distributed.tensor import DTensor

    from memfit.runtime.trainer import Trainer

    trainer = Trainer(builtin("gpt-tiny", layers=layers), config, seed=0, global_batch=16)
    losses = [trainer.step() for _ in range(steps)]
    return losses, {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().numpy().copy()
                    for n, p in trainer.model.named_parameters()}


@functools.cache
def _one_process(layers: int):
    """The single-process run every layout is compared with: trained once per depth."""
    return _train(Config(micro_batch=4, grad_accum=4), layers=layers)


@pytest.mark.parametrize("schedule,gpus", [("gpipe", 1), ("1f1b", 1), ("1f1b", 2), ("interleaved-1f1b", 2),
                                           ("zero-bubble", 1)])
def test_a_pipeline_trains_as_one_process(schedule, gpus):
    """Each stage keeps its parameters under the model's own names; together they are the whole model. Every
    micro-batch's loss is weighted by its share of the batch, as one process weights it, and each stage
    runs the same ops on the same values in the same order: fp32, 1e-5 as for the data-parallel layouts
    (over FSDP2 ranks the gradients are averaged, where the order of the sums differs). The interleaved
    schedules run 4 stages on 2 ranks: gpt-tiny with 4 blocks."""
    from truth import on_gloo_ranks

    layers = 4 if schedule in ("interleaved-1f1b", "zero-bubble") else 2
    one_losses, one_weights = _one_process(layers)
    cfg = Config(micro_batch=4, grad_accum=4 // gpus, pp=2, pp_schedule=schedule, gpus=gpus,
                 data_parallel="fsdp" if gpus > 1 else "none")
    results = on_gloo_ranks(cfg.world, lambda rank: _train(cfg, layers=layers))
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
    first (one hidden state each). The traced activations at each stage's peak follow that exactly. n = pp + 1:
    every stage holds fewer than all n, stage s by s + 1. Three stages of a block each: a first, a middle (which
    both receives and sends) and a last."""
    wl = builtin("gpt-tiny", layers=3)
    pp, n, micro = 3, 4, 2
    hidden = micro * 64 * 64 * 4  # gpt-tiny: seq 64, d_model 64, fp32

    def activations(schedule, count):
        est = memfit.estimate(wl, Config(micro_batch=micro, grad_accum=count, pp=pp, pp_schedule=schedule))
        return [s["breakdown"]["activations"] for s in est.stages]

    gpipe, gpipe_more, one_f = activations("gpipe", n), activations("gpipe", n + 1), activations("1f1b", n)
    for s in range(pp):
        per_micro_batch = gpipe_more[s] - gpipe[s]
        k = min(pp - s, n)
        idle_buffers = (n - k) * hidden if s > 0 else 0
        assert per_micro_batch > 0 and n - k == s + 1, s
        assert one_f[s] == gpipe[s] - (n - k) * per_micro_batch + idle_buffers, s


def test_interleaving_holds_more_on_the_first_rank_and_zero_bubble_holds_weight_inputs_longer():
    """The orderings the literature states, on the traces (gpt-tiny with 4 blocks, pp 2, 4 micro-batches).
    Interleaved 1F1B (Narayanan et al. 2021): torch's schedule runs 2 + 2 (pp - 1 - rank) warm-up forwards of
    one-block stages, so rank 0 holds 5 block-micro-batches at its first backward where 1F1B's stage 0 holds 2
    micro-batches of 2 blocks, 4 (Korthikanti et al. 2022: p (1 + (p - 1) / (p v)) micro-batches' worth against
    p). Zero bubble (Qi et al. 2024) defers each weight-gradient half, whose inputs stay held meanwhile: the
    last rank, which starts its backwards first, holds more than under interleaved 1F1B on the same stages.
    The in-flight counts are checked exactly where one module's bytes show them. Activations only: parameters, gradients and optimizer state are the same bytes under all three."""
    def activations(schedule):
        return [s["breakdown"]["activations"] for s in _stages_estimate("gpt-tiny-4", schedule).stages]

    one_f, interleaved, zero_bubble = activations("1f1b"), activations("interleaved-1f1b"), activations("zero-bubble")
    assert interleaved[0] > one_f[0]
    assert zero_bubble[1] > interleaved[1]
    # the embedding's outputs at rank 0's peak (the figures are rank 0's under both) count stage 0's micro-batches
    # in flight: 2 under 1F1B, 3 under interleaved (stage 0 of micro-batches 0 and 1, stage 2 of 0 and 1, then
    # stage 0 of 2 before the first backward)
    hidden = 2 * 64 * 64 * 4  # micro-batch 2, seq 64, d_model 64, fp32
    for schedule, in_flight in (("1f1b", 2), ("interleaved-1f1b", 3)):
        est = _stages_estimate("gpt-tiny-4", schedule)
        assert est.peak_bytes == est.stages[0]["peak_bytes"]
        assert dict(est.modules)["embed"] == in_flight * hidden, schedule
    held = ("parameters", "gradients", "optimizer_state")
    states = [[{k: s["breakdown"][k] for k in held} for s in _stages_estimate("gpt-tiny-4", schedule).stages]
              for schedule in ("1f1b", "interleaved-1f1b", "zero-bubble")]
    assert states[1] == states[0] and states[2] == states[0]


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
    with pytest.raises(ConfigError, match=r"8 pipeline stages \(4 ranks x 2 stages a rank\) need at least 8"):
        stage_blocks(4, Config(grad_accum=4, pp=4, pp_schedule="interleaved-1f1b").stages, 4)
    with pytest.raises(ConfigError, match=r"max\(1, n // pp\) = 2 rounds, n a multiple of them\): grad_accum 5"):
        Config(pp=2, grad_accum=5, pp_schedule="zero-bubble")
    with pytest.raises(ConfigError, match="zero-bubble interleaves 2 or more stages a rank"):
        Config(pp=2, grad_accum=2, pp_schedule="zero-bubble", pp_virtual=1)
    with pytest.raises(ConfigError, match="fsdp data parallel beside zero-bubble"):
        Config(pp=2, grad_accum=2, pp_schedule="zero-bubble", gpus=2, data_parallel="fsdp")
    with pytest.raises(ConfigError, match="not supported yet"):
        Config(pp=2, grad_accum=2, offload_optimizer=True)


# ------------------------------------------------------------------------------------ the CLI and memfit train


def _stage_of(name: str) -> int:
    """gpt-tiny over 2 stages: the embedding and block 0 on the first, block 1, the norm and the head on the last."""
    return 0 if name.startswith(("embed.", "layers.0.")) else 1


def test_cli_estimate_shows_every_stage_and_the_one_that_bounds_the_budget(capsys):
    """`memfit estimate --pp 2`: the usual figures are the highest stage's; a table gives each stage's peak,
    parameters and peak phase, and --json carries them as `stages`. The stages' parameters, counted from each
    stage's own trace, add up to the whole model's: each holds only its part."""
    import json

    from memfit.cli import main
    from memfit.units import fmt_bytes

    args = ["estimate", "gpt-tiny", "--pp", "2", "--pp-schedule", "gpipe", "--micro-batch", "2"]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    stages = data["stages"]
    assert data["config"]["pp"] == 2 and data["config"]["pp_schedule"] == "gpipe"
    assert data["config"]["grad_accum"] == 2  # not given: one micro-batch per stage
    assert [s["stage"] for s in stages] == [0, 1]
    assert data["peak_bytes"] == max(s["peak_bytes"] for s in stages)
    assert sum(s["parameters"] for s in stages) == sum(p.numel() for p in builtin("gpt-tiny").model().parameters())
    assert main(args) == 0
    text = capsys.readouterr().out
    assert f"peak {fmt_bytes(data['peak_bytes'])} of live tensors, reached in the" in text  # the summary line
    assert "pipeline stages (2, gpipe)" in text
    for s in stages:
        row = next(line for line in text.splitlines() if line.split("│")[0].strip() == str(s["stage"]))
        assert [c.strip() for c in row.split("│")] == [str(s["stage"]), f"{s['parameters']:,}",
                                                       fmt_bytes(s["peak_bytes"]), s["peak_phase"]]
    bound = max(stages, key=lambda s: s["peak_bytes"])["stage"]
    assert f"stage {bound} bounds the budget: {fmt_bytes(data['peak_bytes'])}" in " ".join(text.split())


def test_the_estimate_table_has_a_row_per_rank_naming_the_stages_it_holds():
    """Under interleaved 1F1B a rank holds stages r and r + pp: a row per rank, its stages named, the figures
    the rank's (the estimate traced for the ordering test above, so no trace of its own)."""
    from rich.console import Console

    from memfit.report.tables import estimate_view
    from memfit.units import fmt_bytes

    est = _stages_estimate("gpt-tiny-4", "interleaved-1f1b")
    console = Console(width=200, record=True)
    console.print(estimate_view(est))
    text = console.export_text()
    words = " ".join(text.split())  # the title wraps at the table's width
    assert "pipeline ranks (2, interleaved-1f1b): each its own rank, holding 2 stages" in words
    for s, holds in zip(est.stages, ("0, 2", "1, 3")):
        row = next(line for line in text.splitlines() if line.split("│")[0].strip() == str(s["stage"]))
        assert [c.strip() for c in row.split("│")] == [str(s["stage"]), holds, f"{s['parameters']:,}",
                                                       fmt_bytes(s["peak_bytes"]), s["peak_phase"]]
    assert f"rank 0 bounds the budget: {fmt_bytes(est.peak_bytes)}" in words


def test_cli_trains_two_stages_and_the_run_resumes_on_one_process_and_on_stages(tmp_path, capfd):
    """`memfit train --gpus 2 --pp 2`: each stage's rank writes only its stage's parameters and optimizer state
    with DCP, under the model's own names. From its step-2 checkpoint (the later one removed, as if the run had
    stopped there) the run goes on on one process and on two stages again, under the default cosine schedule
    (each stage's learning rate must come back with it): all three give the one-process run's losses. A
    one-process checkpoint is refused on stages, in one line, before any rank starts."""
    import json
    import shutil

    import torch.distributed.checkpoint as dcp

    from memfit.cli import main
    from memfit.runtime.run import train

    common = ["gpt-tiny", "--global-batch", "8", "--steps", "4", "--no-progress"]
    out = tmp_path / "stages"
    assert main(["train", *common, "--gpus", "2", "--pp", "2", "--checkpoint-every", "2", "--out", str(out)]) == 0
    capfd.readouterr()
    report = json.loads((out / "report.json").read_text())
    assert report["world_size"] == 2 and report["config"]["pp"] == 2 and report["config"]["grad_accum"] == 2

    shards = out / "checkpoints" / "step-00000002.dcp"
    where: dict[str, set] = {}
    for index, item in dcp.FileSystemReader(str(shards)).read_metadata().storage_data.items():
        where.setdefault(index.fqn, set()).add(item.relative_path)
    model_names = builtin("gpt-tiny").model().state_dict().keys()
    assert {k.removeprefix("model.") for k in where if k.startswith("model.")} == set(model_names)
    for name in model_names:
        rank_file = {f"__{_stage_of(name)}_0.distcp"}
        assert where[f"model.{name}"] == rank_file, name
        assert where[f"optimizer.state.{name}.exp_avg"] == rank_file, name

    for target in ("one", "stages"):
        resumed = tmp_path / f"resumed-on-{target}"
        shutil.copytree(out, resumed)
        for later in (resumed / "checkpoints").glob("step-00000004*"):
            shutil.rmtree(later) if later.is_dir() else later.unlink()
        more = ["--gpus", "2", "--pp", "2"] if target == "stages" else []
        assert main(["train", *common, *more, "--resume", "--out", str(resumed)]) == 0
        capfd.readouterr()
        records = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "loss" in r] == [0, 1, 2, 3]
        assert any(r.get("event") == "resumed from step-00000002.pt" for r in records)
        target_losses = [r["loss"] for r in records if "loss" in r]
        if target == "one":
            one_losses = target_losses
        else:
            stage_losses = target_losses
    whole = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if "loss" in line]
    one = train(builtin("gpt-tiny"), 4, 8, micro_batch=4, out=tmp_path / "one", progress=False)
    expected = [r["loss"] for r in one.metrics]
    assert whole == pytest.approx(expected, rel=1e-5)
    assert one_losses == pytest.approx(expected, rel=1e-5)
    assert stage_losses == pytest.approx(expected, rel=1e-5)

    assert main(["train", *common, "--gpus", "2", "--pp", "2", "--resume", "--out", str(tmp_path / "one")]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "a checkpoint of one process" in err and "resume it without --pp" in err


@pytest.mark.parametrize("args,message", [
    (["train", "gpt-tiny", "--gpus", "3", "--pp", "2"], "--pp 2 does not divide --gpus 3"),
    (["train", "gpt-tiny", "--pp", "2"], "--pp 2 runs each stage on its own rank: --gpus 2 or more"),
    (["train", "gpt-tiny", "--gpus", "2", "--pp", "2", "--global-batch", "8", "--micro-batch", "8"],
     "2 pipeline stages need at least 2 micro-batches"),
    (["train", "gpt-tiny", "--gpus", "2", "--pp", "2", "--global-batch", "1"], "cannot make the 2 micro-batches"),
    (["train", "gpt-tiny", "--gpus", "4", "--pp", "2", "--data-parallel", "ddp"], "ddp data parallel beside it"),
    (["estimate", "gpt-tiny", "--pp", "2", "--grad-accum", "1"], "2 pipeline stages need at least 2 micro-batches"),
    (["summary", "gpt-tiny", "--pp", "2"], "--pp 2: summary's table is of one process's whole model"),
])
def test_what_a_pipeline_run_cannot_do_is_refused_in_one_line_before_any_rank_starts(args, message, capfd):
    from memfit.cli import main

    assert main(args) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_a_pipelines_oom_recovery_keeps_micro_batches_of_one_shape():
    """A pipeline's schedule runs micro-batches of one shape: the ladder skips a halved micro-batch that does not
    split a rank's rows evenly (18 rows: not 4), where one process takes an uneven last chunk. The OOM a stage's
    forward raises reaches the run wrapped by torch's pipelining in a RuntimeError: it is still found."""
    from memfit.runtime.run import _out_of_memory, recovery_ladder

    one = recovery_ladder(Config(micro_batch=9, grad_accum=2), 18)
    stages = recovery_ladder(Config(micro_batch=9, grad_accum=2, pp=2), 18)
    assert [c.micro_batch for c in one if c.activation_checkpoint == "none"] == [4, 2, 1]
    assert [(c.micro_batch, c.grad_accum) for c in stages if c.activation_checkpoint == "none"] == [(2, 9), (1, 18)]
    # torch's interleaved schedules run max(1, n // pp) rounds that must divide n: 9 micro-batches in 4 do not
    looped = recovery_ladder(Config(micro_batch=9, grad_accum=2, pp=2, pp_schedule="interleaved-1f1b"), 18)
    assert [(c.micro_batch, c.grad_accum) for c in looped if c.activation_checkpoint == "none"] == [(1, 18)]
    oom = torch.OutOfMemoryError("out of memory")
    try:
        try:
            raise oom
        except torch.OutOfMemoryError as e:
            raise RuntimeError("[Stage 1] failed to run forward") from e
    except RuntimeError as wrapped:
        assert _out_of_memory(wrapped) is oom
    assert _out_of_memory(RuntimeError("something else")) is None
