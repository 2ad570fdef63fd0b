"""A long accumulation is traced as two micro-steps: from the second on, every micro-step makes the same
allocations and frees, adding its gradients into those kept. The rest are counted (their work, bytes moved,
and on a CPU their inputs, which the whole step holds), and every figure is the one a trace of every
micro-step gives: on a GPU target and the CPU, with checkpointing, offload, dropout's random numbers, experts,
sharding across ranks, and for a deep model counted from three shallow copies (where the whole depth peaks in
another phase than its copies too)."""
import pytest

from memfit.config import Config
from memfit.memory import estimate as estimate_module
from memfit.memory import extrapolate
from memfit.memory.estimate import probe
from memfit.memory.estimate import traced_steps
from memfit.memory.extrapolate import _probes, estimate_blocks, layer_plan
from memfit.memory.tracker import Phase
from memfit.workloads import builtin, hf

transformers = pytest.importorskip("transformers")

FIGURES = ("peak_bytes", "breakdown", "model_state_bytes", "peak_phase", "phase_peaks", "peak_allocated_bytes",
           "peak_reserved_bytes", "device_peak_bytes", "host_peak_bytes", "flops", "recompute_flops", "moved_bytes",
           "parameters", "config")
TRACED = FIGURES + ("module_flops", "modules", "top_tensors")  # (a count from copies lists no tensors or modules)


def _gpt2():  # dropout in every block: its random numbers are ops the step-time model prices
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
    return hf.from_config(cfg, name="hf:gpt2", seq=32)


def _whole(monkeypatch, fn):
    with monkeypatch.context() as m:
        m.setattr(estimate_module, "traced_steps", lambda c: c)  # every micro-step traced
        return fn()


@pytest.mark.parametrize("workload,device,config", [
    ("gpt-tiny", "cpu", Config(micro_batch=2, grad_accum=5)),
    ("gpt-tiny", "h100", Config(micro_batch=2, grad_accum=3, precision="bf16-pure", activation_checkpoint="all",
                                offload_optimizer=True)),
    ("gpt2", "h100", Config(micro_batch=2, grad_accum=4, precision="bf16", offload_activations=True, loss_chunks=2)),
    ("moe-tiny", "h100", Config(micro_batch=2, grad_accum=3, precision="bf16")),
    ("gpt-tiny", "h100", Config(micro_batch=2, grad_accum=3, precision="bf16", gpus=2, data_parallel="fsdp")),
])
def test_an_accumulation_counted_from_two_micro_steps_has_every_figure_of_one_traced_whole(
        workload, device, config, monkeypatch):
    """moe-tiny with one block: its routed experts (top-2 of 8) are what the case is for, not its depth."""
    wl = _gpt2() if workload == "gpt2" else builtin(workload, **({"layers": 1} if workload == "moe-tiny" else {}))
    counted = probe(wl, config, device, isolate=False).estimate
    whole = _whole(monkeypatch, lambda: probe(wl, config, device, isolate=False).estimate)
    if workload == "moe-tiny":  # the premise: the step routes tokens to experts
        assert counted.routing and counted.routing["routers"] == "top-2 of 8"
    assert {f: getattr(counted, f) for f in TRACED} == {f: getattr(whole, f) for f in TRACED}
    assert any("traced as 2" in n for n in counted.notes)
    assert not any("traced as 2" in n for n in whole.notes)


@pytest.mark.parametrize("device,config,traced", [
    ("cpu", Config(micro_batch=2, grad_accum=4, activation_checkpoint="all"), 4),
    ("h100", Config(micro_batch=2, grad_accum=4, precision="bf16"), 3),
    ("h100", Config(micro_batch=2, grad_accum=4, activation_checkpoint="all"), 4)])
def test_a_deep_models_accumulation_is_counted_from_copies_and_two_micro_steps(device, config, traced, monkeypatch):
    """In the last case the copies peak in backward, the whole depth in the optimizer step (its foreach
    temporaries outgrow backward's): the peak, its phase and its categories are read from the whole depth's
    written stream, not from the line through the copies."""
    wl = builtin("gpt-tiny", layers=12)
    used = []  # the copies the count is read from (plan, config, probes by depth): read below, not traced again
    with monkeypatch.context() as m:
        m.setattr(extrapolate, "_probes", lambda w, c, d, plan, *a, **k:
                  used.append((plan, c, _probes(w, c, d, plan, *a, **k))) or used[-1][2])
        counted = estimate_blocks(wl, config, device, "auto", isolate=False)
    whole = _whole(monkeypatch, lambda: estimate_blocks(wl, config, device, "all", isolate=False))
    assert counted.extrapolated_from == (traced, 12), counted.notes
    if config.activation_checkpoint == "all" and device == "h100":
        plan = layer_plan(wl, 2, "all")
        [(used_plan, used_config, (by_depth, _))] = used
        assert used_plan.depths == plan.depths and used_config == traced_steps(config)
        copies = [by_depth[d] for d in plan.depths]
        a, b, _ = (p.estimate.peak_bytes for p in copies)
        assert {p.estimate.peak_phase for p in copies} == {Phase.BACKWARD} != {counted.peak_phase}
        assert counted.peak_bytes > a + (b - a) * (12 - 2)
    assert {f: getattr(counted, f) for f in FIGURES} == {f: getattr(whole, f) for f in FIGURES}


def test_a_pipeline_traces_every_micro_batch():
    assert estimate_module.traced_steps(Config(grad_accum=8, pp=2)).grad_accum == 8
    assert estimate_module.traced_steps(Config(grad_accum=8)).grad_accum == 2
