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
    trace's, to the byte."""
    dev = get_device("h100")
    s = _Search(_long_sequence(), 8, dev, frozenset(), budget_bytes=2_300_000_000, host_bytes=None,
                rates=functools.cache(lambda: profile_for(dev)), gpus=2, activation_checkpoint="all", micro_batch=1)
    best, others, verdicts = model_parallel(s, "FSDP's leanest needs 2.39 GiB")
    cfg = best.config
    assert cfg.tp == 2 and cfg.world == 2 and cfg.global_batch == 8 and best.confirmed
    assert best.peak_bytes == best.estimate.device_peak_bytes <= s.usable  # the whole trace's, not extended
    assert best.estimate.config == cfg.to_dict()
    assert verdicts[0][1] == "chosen at micro-batch 1"
    assert any("data parallelism alone does not fit (FSDP's leanest needs 2.39 GiB)" in n for n in s.notes)
    lean = memfit.estimate(_long_sequence(), memfit.Config(micro_batch=1, grad_accum=4, precision="bf16",
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
