"""The planner's tensor-parallel and pipeline layouts: searched when data parallelism alone does not fit."""
import functools

import pytest

import memfit
from memfit.memory.devices import get_device
from memfit.memory.estimate import probe
from memfit.planner.costmodel import OpTable, pipeline_seconds, phase_seconds, profile_for
from memfit.planner.model_parallel import model_parallel
from memfit.planner.search import _Search
from memfit.workloads import builtin


def _long_sequence():
    """Activations decide: a long sequence, a small vocabulary (no logits to chunk away)."""
    return builtin("gpt-tiny", layers=8, seq=16384, d_model=256, heads=4, kv_heads=4, ffn=1024, vocab=256)


def test_where_data_parallelism_does_not_fit_a_split_layout_is_chosen_and_traced_whole():
    """At 2 H100s and a budget under FSDP2's leanest step (every block checkpointed, micro-batch 1: 2.27 GB on
    this model, NCCL's communicator included), tensor parallelism (which splits every block's checkpointed
    input) fits; the plan is the fastest candidate that fits when traced whole, and its figure is that
    trace's, to the byte. A global batch of 4: the pipeline traces its every micro-batch, and 4 still takes the
    tensor-parallel step (4 micro-steps) through its two-micro-step trace's accumulation."""
    dev = get_device("h100")
    s = _Search(_long_sequence(), 4, dev, frozenset(), budget_bytes=2_300_000_000, host_bytes=None,
                rates=functools.cache(lambda: profile_for(dev)), gpus=2, activation_checkpoint="all", micro_batch=1)
    best, others, verdicts = model_parallel(s, "FSDP's leanest needs 2.39 GiB")
    cfg = best.config
    assert cfg.tp == 2 and cfg.world == 2 and cfg.global_batch == 4 and cfg.grad_accum == 4 and best.confirmed
    assert best.peak_bytes == best.estimate.device_peak_bytes <= s.usable  # the whole trace's, not extended
    assert best.estimate.config == cfg.to_dict()
    assert verdicts[0][1] == "chosen at micro-batch 1"
    assert "does not fit" in dict(verdicts)["2 stages x 1 rank, bf16, checkpointing all"]  # a pipeline was priced
    assert any("data parallelism alone does not fit (FSDP's leanest needs 2.39 GiB)" in n for n in s.notes)
    lean = memfit.estimate(_long_sequence(), memfit.Config(micro_batch=1, grad_accum=2, precision="bf16",
                                                           activation_checkpoint="all", gpus=2, data_parallel="fsdp"),
                           "h100")
    assert lean.device_peak_bytes > s.usable  # the premise: FSDP alone does not fit


def test_a_pipeline_step_is_its_slowest_stage_over_n_plus_p_minus_1_slots():
    """GPipe and 1F1B both take n + p - 1 slots of the slowest stage's forward and backward of one micro-batch,
    each waiting for its send, then the slowest stage's optimizer step."""
    p = probe(builtin("gpt-tiny", layers=4), memfit.Config(micro_batch=2, grad_accum=4, pp=2), "h100", isolate=False)
    rates = profile_for(get_device("h100"))
    tables = [OpTable(ops) for ops in p.stage_ops]
    slot = max(phase_seconds(rates, t, ("forward", "backward")) for t in tables) / 4
    update = max(phase_seconds(rates, t, ("optimizer", "setup")) for t in tables)
    assert pipeline_seconds(rates, p.stage_ops, 4, send_seconds=1e-4) == pytest.approx((4 + 1) * (slot + 1e-4) + update)
    assert p.handoff_bytes == 2 * 64 * 64 * 4  # micro-batch x seq x hidden, fp32


def test_a_global_batch_too_small_for_the_ranks_is_planned_tensor_parallel():
    """One sequence cannot split over 2 data-parallel ranks; split over 2 tensor-parallel ranks it uses both."""
    from memfit.planner.search import plan

    result = plan(_long_sequence(), 1, device="h100", gpus=2, activation_checkpoint="all")
    assert result.config.tp == 2 and result.config.world == 2 and result.config.global_batch == 1
    assert any("data parallelism alone does not fit (global batch 1 does not split into 2 ranks)" in n
               for n in result.notes)


class _Traced:
    """What a fake trace of a pipeline gives the search: each rank's peak and the stages' table."""

    def __init__(self, peaks):
        self.stages = [{"device_peak_bytes": p, "peak_bytes": p} for p in peaks]
        self.notes = []


def _fake_pipelines(monkeypatch, extra_on_rank_0: dict):
    """The split search with its traces replaced: a rank holds 1 GB and 100 MB a block it keeps, rank 0 the
    schedule's `extra_on_rank_0` more; a step is the schedule's slots of 1 s (no sends, no update)."""
    from memfit.planner import model_parallel as mp
    from memfit.planner.costmodel import pipeline_slots

    def run(jobs, workers=None):
        out = []
        for job in jobs:
            copy, cfg, _ = job.args
            blocks = copy[1] if isinstance(copy, tuple) else 8
            per_rank = 10**9 + 10**8 * blocks // cfg.pp
            peaks = [per_rank + (extra_on_rank_0.get(cfg.pp_schedule, 0) if r == 0 else 0) for r in range(cfg.pp)]
            out.append(("ok", {"peaks": peaks, "ops": None, "handoff_bytes": 0, "estimate": _Traced(peaks)}))
        return out

    monkeypatch.setattr(mp, "run_isolated_many", run)
    monkeypatch.setattr(mp, "shallow", lambda workload, keep: ("copy", keep))
    monkeypatch.setattr(mp, "_depth", lambda s: 8)
    monkeypatch.setattr(mp, "_seconds", lambda s, cfg, traced, rates, speeds:
                        pipeline_slots(cfg.pp_schedule, cfg.pp, cfg.grad_accum, cfg.pp_virtual) if cfg.pp > 1 else 99.0)
    monkeypatch.setattr(mp, "pipeline_parts", lambda *a: (1.0, 1 / 3, 0.0))


def _search(gpus: int, budget: int):
    dev = get_device("h100")
    return _Search(builtin("gpt-tiny", layers=8), 4 * gpus // 2, dev, frozenset(), budget_bytes=budget,
                   host_bytes=None, rates=functools.cache(lambda: profile_for(dev)), gpus=gpus,
                   activation_checkpoint="all", micro_batch=1)


def test_the_fastest_schedule_that_fits_is_chosen_and_its_trade_said(monkeypatch):
    """Over 2 ranks (no FSDP beside the pipeline) zero bubble's bubble is the smallest: chosen while it fits;
    with a budget only 1F1B and interleaved 1F1B fit, interleaved 1F1B, its cost on rank 0 said."""
    _fake_pipelines(monkeypatch, {"interleaved-1f1b": 100 * 2**20, "zero-bubble": 300 * 2**20})
    s = _search(2, 3 * 2**30)
    best, others, _ = model_parallel(s, "test")
    assert (best.config.pp, best.config.pp_schedule, best.config.grad_accum) == (2, "zero-bubble", 4)
    assert best.step_seconds == 4 + 1 / 3 / 2  # n + (p - 1) / 3 / v
    s = _search(2, int(1.56e9 / 0.95))  # usable 1.56 GB: 1F1B's 1.4 GB and interleaved's 1.505 GB fit, not 1.71
    best, others, verdicts = model_parallel(s, "test")
    assert (best.config.pp, best.config.pp_schedule, best.config.pp_virtual) == (2, "interleaved-1f1b", 2)
    assert "does not fit" in dict(verdicts)["2 ranks x 2 stages zero-bubble x 1 rank, bf16, checkpointing all"]
    assert ("interleaved 1F1B (2 stages a rank): a bubble of 0.5 slots, 1/2 of 1F1B's 1, 1.11x 1F1B's speed "
            "at the cost of 100 MiB more on rank 0") in s.notes[-1]  # 5 slots against 4.5


def test_zero_bubble_is_not_tried_beside_fsdp_and_interleaved_only_at_micro_batches_torchs_rounds_divide(monkeypatch):
    """torch's weight pass does not find FSDP2's parameters (Config refuses it); the interleaved schedules run
    n micro-batches in max(1, n // p) rounds that must divide n."""
    from memfit.planner.model_parallel import _options

    s = _search(4, 80 * 2**30)  # 2 stages x 2 FSDP ranks, or 4 stages x 1
    s.global_batch, s.micro_batch = 20, None
    seen = [(c.pp, c.gpus, c.pp_schedule, c.grad_accum) for c in _options(s, 16) if c.pp > 1]
    assert not any(schedule == "zero-bubble" and dp > 1 for _, dp, schedule, _ in seen)
    assert (4, 1, "zero-bubble", 4) in seen and (2, 2, "interleaved-1f1b", 2) in seen
    looped = [(pp, n) for pp, _, schedule, n in seen if schedule != "1f1b"]
    assert looped and all(n % max(1, n // pp) == 0 for pp, n in looped)
    # 2 ranks, 5 micro-batches: 2 rounds do not divide 5
    assert (2, 5) not in looped and (2, 5) in [(pp, n) for pp, _, schedule, n in seen if schedule == "1f1b"]


def test_beside_data_parallelism_the_faster_plan_is_kept_and_the_others_time_said(monkeypatch):
    """`split_layouts="also"`: the split layout replaces a data-parallel plan that fits only where the cost
    model says it is faster; either way the plan says the other's step time, and a split search not taken
    leaves the data-parallel plan's notes and verdicts as they were."""
    from memfit.planner import search

    def a_plan(cfg, seconds, notes, families):
        return search.Plan(config=cfg, device="h100", budget_bytes=1, usable_bytes=1, peak_bytes=1,
                           step_seconds=seconds, samples_per_second=1 / seconds, estimate=None, alternatives=[],
                           families=families, profile_source="", notes=notes)

    fsdp = memfit.Config(micro_batch=1, grad_accum=1, gpus=8, data_parallel="fsdp", precision="bf16")
    split = memfit.Config(micro_batch=1, grad_accum=2, gpus=4, data_parallel="fsdp", precision="bf16", pp=2)
    for split_seconds, kept in ((1.0, split), (3.0, fsdp)):
        s = _search(8, 80 * 2**30)
        s.notes.append("the data-parallel plan's note")
        s.verdicts.append(("fsdp, bf16", "chosen at micro-batch 1"))

        def split_plan(s_, why_not, families):
            assert why_not is None
            s_.notes.append("the split search's note")
            s_.verdicts.append(("a split layout", "its verdict"))
            return a_plan(split, split_seconds, s_.notes, s_.verdicts)

        monkeypatch.setattr(search, "_split_plan", split_plan)
        got = search._faster_of(s, a_plan(fsdp, 2.0, s.notes, s.verdicts))
        assert got.config == kept
        if kept is split:
            assert got.notes[-1].startswith("data parallelism alone fits (") and got.notes[-1].endswith("2.00x faster")
            assert ("fsdp, bf16", "fits, 2.00x slower (micro-batch 1)") in got.families
        else:
            assert got.notes[:1] == ["the data-parallel plan's note"]
            assert got.families == [("fsdp, bf16", "chosen at micro-batch 1")]
            assert got.notes[-1].endswith("takes 3 s a step, 1.50x this plan's")
