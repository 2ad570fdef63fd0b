"""MoE on fake tensors (memory/routing.py): routing-dependent shapes are traced under balanced routing, the
bound under extreme routings, and each figure equals a real CPU step whose router is forced to route the
same way (memfit's measured path: a live-bytes count of the real step, from the same steady state)."""
from __future__ import annotations

import contextlib

import pytest
import torch
from rich.console import Console
from torch import nn

import memfit
import models
from memfit import Config
from memfit.memory.fake import is_fake, new_fake_mode
from memfit.memory.kernels import CpuWorkspaces
from memfit.memory.measure import measure_step
from memfit.memory.routing import FLOAT_FACTORY_LIMIT_BYTES, MAX_CHOICES, Routing, assumed_choices
from memfit.memory.tracker import LiveBytes
from memfit.report.tables import estimate_view
from memfit.step import TrainStep
from memfit.torch_internals import DATA_DEPENDENT_ERRORS, TorchDispatchMode
from memfit.workload import Workload, tensors_of
from memfit.workloads import builtin

aten = torch.ops.aten


# ------------------------------------------------------------------------------------ forced real routing

def balanced(i: int, j: int, k: int, e: int) -> int:
    return (i * k + j) % e


def collapsed(i: int, j: int, k: int, e: int) -> int:
    return j


def first(i: int, j: int, k: int, e: int) -> int:
    return 0 if j == 0 else 1 + (i * (k - 1) + j - 1) % (e - 1)


def last(i: int, j: int, k: int, e: int) -> int:
    return e - 1 if j == 0 else (i * (k - 1) + j - 1) % (e - 1)


ROUTINGS = {"balanced": balanced, "collapsed": collapsed, "first": first, "last": last}


class Forced(TorchDispatchMode):
    """Overwrites the indices every real top-k over an expert-sized dimension returns (in place, after the
    op) with the choices `rule(token, j, k, experts)`, or with random ones from `generator`."""

    def __init__(self, rule=None, generator=None):
        super().__init__()
        self.rule, self.generator = rule, generator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is aten.topk.default and args[0].shape[-1] <= MAX_CHOICES:
            k, experts, indices = args[1], args[0].shape[-1], out[1]
            rows = indices.numel() // k
            if self.rule is not None:
                choice = [[self.rule(i, j, k, experts) for j in range(k)] for i in range(rows)]
                indices.copy_(torch.tensor(choice).reshape(indices.shape))
            else:
                choice = torch.rand(rows, experts, generator=self.generator).argsort(-1)[:, :k]
                indices.copy_(choice.reshape(indices.shape))
        return out


def measured_peak(workload: Workload, config: Config, forced: Forced) -> int:
    """Peak live bytes of a real CPU step from the estimate's steady state (primed optimizer), batch counted."""
    torch.manual_seed(0)
    step = TrainStep(workload, config, "cpu")
    step.prime()
    batch = workload.batch(config.global_batch)
    tracker = LiveBytes("cpu", detail=False, workspace=CpuWorkspaces())  # as measure_step's own
    tracker.track(tensors_of(batch))
    with forced:
        _, peak = measure_step(step, batch, tracker)
    return peak.bytes


def fake_only(workload: Workload, marker) -> Workload:
    """`workload` whose loss writes `marker` if it ever runs on real tensors."""
    def loss(model, batch):
        if not all(is_fake(t) for t in tensors_of(batch)):
            marker.write_text("a real step ran")
        return workload.loss(model, batch)

    return Workload(model=workload.model, batch=workload.batch, loss=loss, optimizer=workload.optimizer,
                    name=workload.name)


# ------------------------------------------------------------------------------------ the assumptions

@pytest.mark.parametrize("rows,k,experts", [(10, 2, 8), (7, 3, 4), (5, 1, 6), (9, 4, 4)])
def test_assumed_routings_choose_k_distinct_experts_as_documented(rows, k, experts):
    for name, rule in ROUTINGS.items():
        choice = assumed_choices(name, rows, k, experts)
        assert choice.tolist() == [[rule(i, j, k, experts) for j in range(k)] for i in range(rows)], name
        assert all(len(set(row)) == k for row in choice.tolist()), name
    counts = torch.bincount(assumed_choices("balanced", rows, k, experts).flatten(), minlength=experts)
    assert counts.max() - counts.min() <= 1 and counts.sum() == rows * k
    for name, expert in (("first", 0), ("last", experts - 1), ("collapsed", 0)):
        assert (assumed_choices(name, rows, k, experts) == expert).sum() == rows  # one expert takes every token


# ------------------------------------------------------------------------------------ the dispatch mode

def test_values_computed_from_known_values_keep_shadows_small_when_floating():
    """Rotary tables made from `arange` in every layer: their cos/sin are not computed for real beyond
    FLOAT_FACTORY_LIMIT_BYTES (a third of a 7B probe's time was), while integer and boolean results (what
    shapes depend on) keep their values up to SHADOW_LIMIT_BYTES."""
    with new_fake_mode(), Routing() as routing:
        positions = torch.arange(4096, dtype=torch.float32)
        small = torch.outer(positions[:64], torch.ones(64)).cos()  # 16 KiB
        large = torch.outer(positions, torch.ones(128))  # 2 MiB
        assert large.untyped_storage().nbytes() > FLOAT_FACTORY_LIMIT_BYTES
        counts = torch.arange(1024 * 1024) % 7  # 8 MiB of int64
        assert routing.shadow(small) is not None and routing.shadow(large) is None
        assert routing.shadow(large.cos()) is None
        assert routing.shadow(counts) is not None and int((counts == 3).sum()) == (1024 * 1024 - 3 + 6) // 7


def test_routing_mode_answers_what_fake_tensors_refuse_from_the_assumed_choices():
    with new_fake_mode(), Routing() as routing:
        x = torch.randn(12, 16)
        weights, choice = torch.randn(12, 8).softmax(-1).topk(2, dim=-1)
        expected = assumed_choices("balanced", 12, 2, 8)
        hit = (choice == 3).nonzero()  # data-dependent shape
        assert is_fake(hit) and hit.shape == (expected == 3).nonzero().shape
        assert torch.bincount(choice.flatten(), minlength=8).tolist() == [3] * 8
        assert bool((choice[0] == torch.tensor([0, 1])).all()) and int(choice[5, 1]) == 3
        assert f"expert_{choice[1, 0]}" == "expert_2"
        mask = (choice == 0).any(-1)
        assert x[mask].shape == (3, 16)  # a boolean mask as an index
        out = torch.zeros(12, 16)
        out[mask] = x[mask]
        token, slot = torch.where(choice == 7)
        assert out.index_add(0, token, x[token] * weights[token, slot, None]).shape == (12, 16)
        assert routing.routers == {(2, 8)} and {"nonzero", "bincount", "_local_scalar_dense"} <= set(routing.followed)
        top1 = torch.randn(2, 6, 4).argmax(dim=-1)  # a top-1 router (Switch): token i of all 12 takes expert i mod 4
        assert top1.flatten().tolist() == [i % 4 for i in range(12)]
        assert torch.randn(12, 4).max(dim=-1, keepdim=True).indices.flatten().tolist() == [i % 4 for i in range(12)]

        wide = torch.randn(12, MAX_CHOICES + 1).topk(2, dim=-1).indices  # not a router: no values
        with pytest.raises(DATA_DEPENDENT_ERRORS):
            (wide == 3).nonzero()
        changed = choice.clone()
        changed.add_(torch.randint(0, 2, (12, 2)))  # mixed with data in place: the values are lost
        with pytest.raises(DATA_DEPENDENT_ERRORS):
            changed.nonzero()
        view = choice[:, 0]
        choice.mul_(x[:, :2].long())  # through an alias too
        with pytest.raises(DATA_DEPENDENT_ERRORS):
            view.nonzero()


# ------------------------------------------------------------------------------------ built-in MoE

def test_builtin_moe_is_estimated_on_fake_tensors_and_equals_forced_real_steps(tmp_path):
    wl = builtin("moe-tiny", layers=1, seq=32)
    marker = tmp_path / "real-step"
    cfg = Config(micro_batch=2)
    est = memfit.estimate(fake_only(wl, marker), cfg)
    assert est.method == "fake" and not marker.exists()
    r = est.routing
    assert r["assumption"] == "balanced" and r["routers"] == "top-2 of 8"
    assert {"bincount", "_local_scalar_dense"} <= set(r["followed"])
    assert any("balanced routing" in note for note in est.notes)
    console = Console(width=160, record=True)
    console.print(estimate_view(est))
    table = console.export_text()
    assert "balanced (the estimate)" in table and "bound: k experts take every token" in table
    assert est.peak_bytes == measured_peak(wl, cfg, Forced(balanced))
    assert r["bound_peak_bytes"] == measured_peak(wl, cfg, Forced(ROUTINGS[r["bound_routing"]]))
    assert r["bound_peak_bytes"] > est.peak_bytes  # the collapsed router's expert takes the whole micro-batch
    others = [measured_peak(wl, cfg, Forced(ROUTINGS[name])) for name in ("first", "last")]
    others.append(measured_peak(wl, cfg, Forced(generator=torch.Generator().manual_seed(0))))
    assert max(others) <= r["bound_peak_bytes"]


def test_moe_options_and_size():
    with torch.device("meta"):
        model = builtin("moe").model()
    d, ffn, experts, layers, vocab = 512, 1536, 8, 8, 32000
    per_layer = 4 * d * d + experts * 3 * d * ffn + d * experts + 2 * d  # attention, experts, router, norms
    assert sum(p.numel() for p in model.parameters()) == 2 * vocab * d + layers * per_layer + d
    wl = builtin("moe-tiny", experts=4, top_k=1, seq=8)
    assert len(wl.model().layers[0].moe.experts) == 4 and wl.batch(3)["tokens"].shape == (3, 9)
    with pytest.raises(memfit.MemfitError, match="top_k"):
        builtin("moe-tiny", top_k=9)


# ------------------------------------------------------------------------------------ transformers

def test_transformers_loop_experts_follow_the_assumed_routing(tmp_path):
    """experts_implementation="eager": a Python loop over the experts hit (one_hot, nonzero, where)."""
    transformers = pytest.importorskip("transformers")
    from memfit.workloads import hf

    options = {**hf.SMALL_CONFIGS["mixtral"], "num_hidden_layers": 1}
    cfg = transformers.AutoConfig.for_model("mixtral", **options, experts_implementation="eager")
    wl = hf.from_config(cfg, seq=32, name="hf:mixtral")
    cfg = Config(micro_batch=2)
    marker = tmp_path / "real-step"
    est = memfit.estimate(fake_only(wl, marker), cfg)
    assert est.method == "fake" and not marker.exists()
    assert est.routing["assumption"] == "balanced" and "nonzero" in est.routing["followed"]
    assert est.peak_bytes == measured_peak(wl, cfg, Forced(balanced))
    bound = est.routing["bound_peak_bytes"]
    # (this toy's peak is its optimizer step, which routing does not change: the bound may equal the estimate)
    assert bound >= est.peak_bytes and bound == measured_peak(wl, cfg, Forced(ROUTINGS[est.routing["bound_routing"]]))


def test_a_checkpointed_switch_transformer_converting_its_router_in_the_forward_traces_on_fake(tmp_path):
    """Its router calls `self.classifier.to(dtype)` in every forward, which swaps fake parameters: the
    recomputed swap poisoned the forward's gradient accumulator and the estimate fell back to real steps
    (torch_internals.keep_tensors_on_unchanged_conversion)."""
    transformers = pytest.importorskip("transformers")
    from memfit.workloads import hf

    cfg = transformers.AutoConfig.for_model("switch_transformers", d_model=64, d_kv=16, d_ff=128, num_heads=4,
                                            num_layers=2, num_decoder_layers=2, num_sparse_encoder_layers=2,
                                            num_sparse_decoder_layers=2, num_experts=4, vocab_size=1000)
    assert cfg.encoder_sparse_step == cfg.decoder_sparse_step == 1  # every layer routes
    wl = hf.from_config(cfg, seq=16, name="hf:switch_transformers")
    cfg = Config(micro_batch=2, activation_checkpoint="all")
    marker = tmp_path / "real-step"
    est = memfit.estimate(fake_only(wl, marker), cfg)
    assert est.method == "fake" and not marker.exists()
    assert est.peak_bytes == measured_peak(wl, cfg, Forced(balanced))


class ForcedArgmax(TorchDispatchMode):
    """The balanced choice for every real argmax over an expert-sized dimension (a top-1 router's)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is aten.argmax.default and args[0].shape[-1] <= MAX_CHOICES:
            experts = args[0].shape[-1]
            out.copy_(torch.tensor([balanced(i, 0, 1, experts) for i in range(out.numel())]).reshape(out.shape))
        return out


def test_nllb_moe_trains_the_experts_its_code_sends_tokens_to_as_a_real_run_does(tmp_path):
    """transformers' NLLB-MoE one-hots the router's one-hot mask (`one_hot(router_mask)` of a [tokens,
    experts] 0/1 mask), so only expert_0 and expert_1 ever receive tokens. A real run never gives the others
    a gradient, so torch.optim never makes their state: the estimate must equal a real second step (the
    steady state), not one primed with state for every parameter."""
    transformers = pytest.importorskip("transformers")
    from memfit.workloads import hf

    cfg = transformers.AutoConfig.for_model(
        "nllb-moe", num_experts=8, encoder_layers=2, decoder_layers=2, d_model=32, encoder_ffn_dim=64,
        decoder_ffn_dim=64, encoder_attention_heads=2, decoder_attention_heads=2, vocab_size=256,
        encoder_sparse_step=1, decoder_sparse_step=1, encoder_layerdrop=0.0, decoder_layerdrop=0.0)
    wl = hf.from_config(cfg, seq=32, name="hf:nllb-moe")
    config = Config(micro_batch=2)
    marker = tmp_path / "real-step"
    est = memfit.estimate(fake_only(wl, marker), config)
    assert est.method == "fake" and not marker.exists()
    idle = 4 * 6 * 4  # 4 sparse layers x experts 2..7 x (fc1, fc2) x (weight, bias)
    assert any(note.startswith(f"{idle} trainable parameter(s) get no gradient") for note in est.notes)

    torch.manual_seed(0)
    step = TrainStep(wl, config, "cpu")
    batch = wl.batch(config.global_batch)
    with ForcedArgmax():
        step(batch)  # the first step makes the state a real run keeps
        tracker = LiveBytes("cpu", detail=False, workspace=CpuWorkspaces())
        tracker.track(tensors_of(batch))
        _, peak = measure_step(step, batch, tracker)
    stateless = {n.split(".experts.")[1].split(".")[0] for n, p in step.model.named_parameters()
                 if p not in step.optimizer.state}
    assert stateless == {f"expert_{i}" for i in range(2, 8)}
    assert est.peak_bytes == peak.bytes


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_transformers_default_experts_trace_once_whatever_the_routing(model_type):
    """transformers' default grouped_mm experts size every tensor by tokens x k: no assumption is needed
    (one trace), and the peak is what a real step measures under its own (random) routing."""
    pytest.importorskip("transformers")
    wl = builtin(f"hf:{model_type}", seq=8)
    cfg = Config(micro_batch=2)
    est = memfit.estimate(wl, cfg)
    assert est.method == "fake" and est.routing["assumption"] == "invariant"
    assert est.routing["bound_peak_bytes"] == est.peak_bytes
    assert est.peak_bytes == measured_peak(wl, cfg, Forced(generator=torch.Generator().manual_seed(0)))


# ------------------------------------------------------------------------------------ not routers

class TopKPool(nn.Module):
    """Keeps each row's 4 largest of 16 features (a top-k that only gathers, routes nothing)."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(32, 16), nn.Linear(4, 10)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h.gather(-1, h.topk(4, dim=-1).indices))


def test_a_topk_that_routes_nothing_traces_as_before_and_data_dependent_models_still_fall_back():
    pool = Workload(model=TopKPool, batch=lambda n: (torch.randn(n, 32), torch.randint(0, 10, (n,))),
                    loss=models.classify, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), name="topk-pool")
    est = memfit.estimate(pool, Config(micro_batch=4))
    assert est.method == "fake" and est.routing is None
    assert est.peak_bytes == measured_peak(pool, Config(micro_batch=4), contextlib.nullcontext())
    # a count read from data (`.item()` of a score threshold) is no routing: measured as before
    assert memfit.estimate(models.moe_item(seq=4), Config(micro_batch=2)).method == "measured"
