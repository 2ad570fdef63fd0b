"""Tensor parallelism (Config.tp), estimated per rank on fake tensors and checked against real gloo ranks
(issue 43). The grid (both models, with and without checkpointing, more runs) is benchmarks/tensor_parallel.py."""
import dataclasses
import fnmatch
import json

import pytest
import torch

import memfit
from memfit import Config
from memfit.cli import main
from memfit.errors import ConfigError
from memfit.memory.estimate import state_bytes
from memfit.strategies.tensor_parallel import GPT_PLAN, tensor_parallel_plan
from memfit.workloads import builtin, hf
from numerics import gpt_gradient_terms, gradient_terms, sum_tolerance

EPS32 = torch.finfo(torch.float32).eps
SGD_LR = 0.1


def small_llama() -> memfit.Workload:
    """transformers' LlamaForCausalLM, tiny: its attention is called with keyword arguments and its model reads
    the sequence length off the embeddings, neither of which memfit's GPT does."""
    import transformers

    config = transformers.AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    return hf.from_config(config, name="hf:llama-tp", seq=64)


def _split_rows(name: str, shape: torch.Size, tp: int) -> torch.Size:
    """A parameter's shape on one rank, read off the plan: colwise Linears, the embedding and the head keep 1/tp
    of their rows, rowwise Linears 1/tp of their columns, norms all of it."""
    module = name.rsplit(".", 1)[0]
    kind = next((k for pattern, k in GPT_PLAN.items() if fnmatch.fnmatchcase(module, pattern)), None)
    if kind == "rowwise":
        return torch.Size([shape[0], shape[1] // tp])
    if kind == "colwise" or module in ("embed", "head"):
        return torch.Size([shape[0] // tp, *shape[1:]])
    return shape


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_ranks_state_is_its_share_of_every_split_matrix(tp):
    """AdamW on one rank: its share of each parameter, that share's gradient and two moments (16 bytes an
    element), and a 4-byte step per parameter; norms whole on every rank."""
    wl = builtin("gpt-tiny")
    expected = sum(16 * _split_rows(n, p.shape, tp).numel() + 4 for n, p in wl.model().named_parameters())
    assert state_bytes(wl, Config(tp=tp)) == expected


def _lowest_rank_peak(workload, config: Config, estimate: int) -> int:
    """The lowest peak of any rank over up to 4 runs of real gloo ranks (a run that agrees ends the search): gloo's
    worker threads release a finished collective's tensors when they get to them, and on this busy 2-core
    machine a rank often still held a whole-sequence activation or two (65-262 KB) at its peak (truth.py)."""
    from truth import lowest_rank_peaks

    return min(lowest_rank_peaks(workload, config, estimate, runs=4)[0])


@pytest.mark.parametrize("checkpoint", ["none", "all"])
def test_gpt_estimate_equals_each_tp_ranks_own_peak(checkpoint):
    """Two real gloo ranks run gpt-tiny split as memfit splits it, each measuring its own peak with the CPU
    allocator's running total; the one estimate (rank 0 of a fake world) equals the lowest within 1%. A vocabulary
    of 8,192 makes the logits (gathered whole on every rank) the bulk of the peak, so that what gloo's thread
    still holds is 0.2-0.4% of it, not the 4-7% it is of gpt-tiny's own 3.6 MB (benchmarks/tensor_parallel.py
    measures gpt-tiny itself, with more runs: to within 8 bytes)."""
    wl, cfg = builtin("gpt-tiny", vocab=8192), Config(micro_batch=8, tp=2, activation_checkpoint=checkpoint)
    est = memfit.estimate(wl, cfg)
    assert any("tensor parallel over 2" in n for n in est.notes)
    assert est.peak_bytes == pytest.approx(_lowest_rank_peak(wl, cfg, est.peak_bytes), rel=0.01)


def _sgd_step(make, config: Config):
    """One SGD step of the workload `make()` on a seeded batch of 8: the loss, each gradient and parameter whole
    (numpy, to come back from a forked rank)."""
    from torch.distributed.tensor import DTensor

    from memfit.step import TrainStep

    wl = dataclasses.replace(make(), optimizer=lambda ps: torch.optim.SGD(ps, lr=SGD_LR))
    torch.manual_seed(0)
    step = TrainStep(wl, config, "cpu")
    torch.manual_seed(1)
    loss = float(step(wl.batch(8)))

    def whole(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().numpy().copy()

    return loss, {n: (whole(p.grad), whole(p)) for n, p in step.model.named_parameters()}


def _terms(make) -> int:
    """The additions behind one gradient entry (tests/numerics.py) of a batch of 8."""
    model = make().model()
    if hasattr(model, "cfg"):
        return gpt_gradient_terms(model.cfg, 8 * model.cfg.seq)
    c = model.config
    return gradient_terms(8 * 64, c.num_hidden_layers, 64, c.hidden_size, c.intermediate_size, c.vocab_size)


@pytest.mark.parametrize("make", [lambda: builtin("gpt-tiny"), small_llama], ids=["gpt-tiny", "llama"])
def test_training_split_over_two_ranks_is_one_process_math(make):
    """The loss, every gradient and every SGD-stepped parameter of each rank equal one process's up to the
    rounding of sums that are ordered differently (tests/numerics.py: the rowwise matmuls add their ranks'
    partial products, the norms' weight gradients their ranks' positions). SGD, not AdamW: AdamW divides a
    gradient by its own size, so a 1e-9 gradient's rounding noise would move a weight by about lr."""
    from truth import on_gloo_ranks

    one_loss, one = _sgd_step(make, Config(micro_batch=8))
    terms = _terms(make)
    for loss, split in on_gloo_ranks(2, lambda rank: _sgd_step(make, Config(micro_batch=8, tp=2))):
        assert loss == pytest.approx(one_loss, rel=sum_tolerance(torch.float32, terms, 1.0))
        for name, (grad, weight) in one.items():
            tol = sum_tolerance(torch.float32, terms, abs(grad).max())
            torch.testing.assert_close(torch.from_numpy(split[name][0]), torch.from_numpy(grad), rtol=0, atol=tol,
                                       msg=lambda m, n=name: f"grad {n}: {m}")
            atol = SGD_LR * tol + EPS32 * abs(weight).max()  # plus one rounding of p - lr*g
            torch.testing.assert_close(torch.from_numpy(split[name][1]), torch.from_numpy(weight), rtol=0, atol=atol,
                                       msg=lambda m, n=name: f"{n}: {m}")


def _two_d(**fields) -> Config:
    """torchtitan's 2-D layout on 4 ranks: 2 data-parallel groups (FSDP2 across) of 2 tensor-parallel ranks."""
    return Config(**{"micro_batch": 8, "gpus": 2, "tp": 2, "data_parallel": "fsdp", **fields})


@pytest.mark.parametrize("layout", ["fsdp", "fsdp-no-reshard"])
def test_fsdp_over_tp_ranks_estimate_equals_the_lowest_real_rank(layout):
    """Four real gloo ranks on a (shard 2, tp 2) mesh, each a TP-split gpt-tiny whose DTensor parameters FSDP2
    shards across the groups; the estimate (rank 0 of a fake world of 4) against the lowest rank over up to 4
    runs, within 1% as for FSDP and TP alone (gloo's thread frees a collective's tensors late, which only adds).
    Every rank holds and does the same: a quarter of each split matrix, whole logits."""
    wl = builtin("gpt-tiny", vocab=8192)
    cfg = _two_d(data_parallel=layout, activation_checkpoint="all" if layout == "fsdp" else "none")
    est = memfit.estimate(wl, cfg)
    assert any("tensor parallel over 2" in n for n in est.notes)
    assert est.peak_bytes == pytest.approx(_lowest_rank_peak(wl, cfg, est.peak_bytes), rel=0.01)


def test_a_ranks_state_on_the_two_d_mesh_is_its_quarter():
    """FSDP2 shards each TP shard's rows again over the 2 groups: AdamW's 16 bytes an element of a quarter of
    every split matrix and half of every norm (rows of 64 split evenly), the step counts whole."""
    wl = builtin("gpt-tiny")
    expected = 0
    for name, p in wl.model().named_parameters():
        shape = _split_rows(name, p.shape, 2)
        expected += 16 * (shape[0] // 2) * shape[1:].numel() + 4
    assert state_bytes(wl, _two_d()) == expected


def _two_d_sgd(config: Config):
    """One SGD step through the Trainer (which gives each data-parallel group its rows) on a global batch of
    16: this rank's loss on its rows, each gradient and parameter whole."""
    from torch.distributed.tensor import DTensor

    from memfit.runtime.trainer import Trainer

    wl = dataclasses.replace(builtin("gpt-tiny"), optimizer=lambda ps: torch.optim.SGD(ps, lr=SGD_LR))
    trainer = Trainer(wl, config, seed=0, global_batch=16)
    loss = trainer.step()

    def whole(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().numpy().copy()

    return loss, {n: (whole(p.grad), whole(p)) for n, p in trainer.engine.model.named_parameters()}


def test_fsdp_over_tp_ranks_trains_as_one_process():
    """Each group's two TP ranks train on the same 8 of the 16 rows, the other group on the other 8: every
    rank's loss, gradient and SGD-stepped weight equals one process's on all 16 up to the reordered sums
    (tests/numerics.py: the batch's sum now also split over the groups, which adds no terms). Groups that
    trained the same rows would give the gradient of 8 rows, not 16."""
    from truth import on_gloo_ranks

    one_loss, one = _two_d_sgd(Config(micro_batch=16))
    terms = gpt_gradient_terms(builtin("gpt-tiny").model().cfg, 16 * 64)
    results = on_gloo_ranks(4, lambda rank: _two_d_sgd(_two_d()))
    for loss, split in results:  # the step's loss is averaged over the ranks
        assert loss == pytest.approx(one_loss, rel=sum_tolerance(torch.float32, terms, 1.0))
        _like_one_process(split, one, terms)


def test_pipeline_stages_of_tp_ranks_train_as_one_process():
    """pp 2 x tp 2 (4 ranks): each stage's TP ranks hold their shards of that stage's blocks, and the stages pass
    each rank's shard of the sequence. One SGD step over 4 micro-batches of 2 gives one process's loss, and
    every gradient and weight, whole, up to the reordered sums (tests/numerics.py: the split adds no terms)."""
    from truth import on_gloo_ranks

    one_loss, one = _sgd_step(lambda: builtin("gpt-tiny"), Config(micro_batch=8))
    terms = gpt_gradient_terms(builtin("gpt-tiny").model().cfg, 8 * 64)
    cfg = Config(micro_batch=2, grad_accum=4, pp=2, tp=2)
    results = on_gloo_ranks(cfg.world, lambda rank: _sgd_step(lambda: builtin("gpt-tiny"), cfg))
    split = {**results[0][1], **results[cfg.tp][1]}  # each stage's first rank: its parameters, whole
    assert set(split) == set(one) and not set(results[0][1]) & set(results[cfg.tp][1])
    for loss, _ in results:  # the step's loss: the last stage's, averaged over the world
        assert loss == pytest.approx(one_loss, rel=sum_tolerance(torch.float32, terms, 1.0))
    _like_one_process(split, one, terms)


def _like_one_process(split: dict, one: dict, terms: int) -> None:
    """Every gradient and weight of a split run, whole, equals one process's up to the reordered fp32 sums of
    `terms` terms (one SGD step: a weight moves by the learning rate times its gradient's error)."""
    for name, (grad, weight) in one.items():
        tol = sum_tolerance(torch.float32, terms, abs(grad).max())
        torch.testing.assert_close(torch.from_numpy(split[name][0]), torch.from_numpy(grad), rtol=0, atol=tol,
                                   msg=lambda m, n=name: f"grad {n}: {m}")
        atol = SGD_LR * tol + EPS32 * abs(weight).max()
        torch.testing.assert_close(torch.from_numpy(split[name][1]), torch.from_numpy(weight), rtol=0, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_the_mesh_is_built_once_in_torchtitans_order():
    """pp outermost, then the data-parallel axis, tp innermost: a rank's data-parallel share is its place on
    the shard axis, and TP's and FSDP2's meshes are one mesh's axes (FSDP2 refuses a TP mesh of another root)."""
    import torch.distributed as dist

    from memfit.strategies.data_parallel import data_parallel_rank, device_mesh, mesh_axis
    from memfit.torch_internals import fake_process_group

    cfg, cpu = _two_d(), torch.device("cpu")
    with fake_process_group(cfg.world, rank=3):
        mesh = device_mesh(cfg, cpu)
        assert mesh.mesh_dim_names == ("shard", "tp") and mesh.mesh.tolist() == [[0, 1], [2, 3]]
        assert device_mesh(cfg, cpu) is mesh
        assert mesh_axis(cfg, cpu, "tp").mesh.tolist() == [2, 3]
        assert mesh_axis(cfg, cpu, "shard").mesh.tolist() == [1, 3]
        assert data_parallel_rank(cfg) == mesh.get_local_rank("shard") == 1 and dist.get_rank() == 3
    with pytest.raises(ConfigError, match="ddp data parallel beside it"):
        Config(gpus=2, tp=2, data_parallel="ddp")
    three = Config(gpus=2, tp=2, pp=2, grad_accum=2, data_parallel="fsdp")  # (pp, shard, tp) of 8 ranks
    with fake_process_group(three.world, rank=5):
        mesh = device_mesh(three, cpu)
        assert mesh.mesh_dim_names == ("pp", "shard", "tp") and mesh.mesh.tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
        assert [mesh_axis(three, cpu, a).mesh.tolist() for a in ("pp", "shard", "tp")] == [[1, 5], [5, 7], [4, 5]]
        assert data_parallel_rank(three) == 0


class _GlobalHeads(torch.nn.Module):
    """An attention whose forward reshapes with the config's global head count."""

    def forward(self, hidden_states, **kwargs):
        b, t, _ = hidden_states.shape
        return self.q_proj(hidden_states).view(b, t, self.config.num_attention_heads, -1)


def _llama_model(**config):
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, **config))


def _with_global_heads():
    model = _llama_model()
    for layer in model.model.layers:
        layer.self_attn.__class__ = type("GlobalHeadsAttention", (_GlobalHeads, type(layer.self_attn)), {})
    return model


@pytest.mark.parametrize("make,tp,message", [
    (lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), 2, "no known plan for Sequential"),
    (_with_global_heads, 2, "reshapes with the global config.num_attention_heads"),
    (lambda: _llama_model(tie_word_embeddings=True), 2, "shares the embedding's weight"),
    (lambda: builtin("gpt-tiny").model(), 3, "do not split over 3 ranks"),
    (lambda: _llama_model(), 4, "k_proj's 2 heads of 16 do not split over 4 ranks"),
])
def test_a_model_that_cannot_be_split_is_refused_in_one_line_and_left_as_it_was(make, tp, message):
    model = make()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ConfigError, match=message) as refused:
        tensor_parallel_plan(model, tp)
    assert "\n" not in str(refused.value)
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


def test_the_plan_makes_attention_see_its_ranks_heads_and_gathers_inputs_as_they_are_passed():
    """transformers' Llama passes the hidden states to its attention by keyword and to its MLP by position;
    memfit's GPT both by position. Each gets the matching PrepareModuleInput, and head counts become local."""
    from torch.distributed.tensor.parallel import PrepareModuleInput

    llama = tensor_parallel_plan(_llama_model(), 2)
    attn, mlp = llama["model.layers.0.self_attn"], llama["model.layers.0.mlp"]
    assert isinstance(attn, PrepareModuleInput) and set(attn.input_kwarg_layouts) == {"hidden_states"}
    assert attn.input_layouts is None and len(mlp.input_layouts) == 1
    gpt = builtin("gpt-tiny").model()
    styles = tensor_parallel_plan(gpt, 2)
    assert {type(styles[n]).__name__ for n in ("embed", "head", "norm", "layers.1.attn_norm")} == {
        "RowwiseParallel", "ColwiseParallel", "SequenceParallel"}
    assert (gpt.layers[0].attn.heads, gpt.layers[0].attn.kv_heads) == (2, 2)


def test_cli_trains_split_over_two_ranks(tmp_path, capfd):
    """`memfit train --gpus 2 --tp 2`: two ranks, one data-parallel rank of two tensor-parallel ones, each
    recording its own peak; a tp that does not divide the ranks, or leaves DDP ranks beside it (not built
    yet), is refused in one line before any rank starts."""
    out = tmp_path / "run"
    assert main(["train", "gpt-tiny", "--gpus", "2", "--tp", "2", "--steps", "1", "--global-batch", "8",
                 "--micro-batch", "8", "--schedule", "constant", "--no-progress", "--out", str(out)]) == 0
    capfd.readouterr()
    report = json.loads((out / "report.json").read_text())
    assert report["world_size"] == 2 and report["config"]["tp"] == 2 and report["config"]["gpus"] == 1
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert len(record["rank_peak_bytes"]) == 2
    assert main(["train", "gpt-tiny", "--gpus", "3", "--tp", "2", "--steps", "1", "--global-batch", "8"]) == 2
    assert "--tp 2 does not divide --gpus 3" in capfd.readouterr().err
    assert main(["train", "gpt-tiny", "--gpus", "4", "--tp", "2", "--data-parallel", "ddp", "--steps", "1",
                 "--global-batch", "8"]) == 2
    assert "ddp data parallel beside it (fsdp and fsdp-no-reshard are) with tensor parallelism is not supported" \
        in capfd.readouterr().err
