"""The planner: budgets, fixed choices, fit confirmed by full estimates, the max-micro-batch question,
and the step-time model's basic orderings."""
import dataclasses
import functools
import json

import pytest
import torch

import memfit
from memfit import Config
from memfit.cli import main
from memfit.memory.devices import get_device
from memfit.planner.costmodel import Profile, catalogue_profile, describe, step_seconds
from memfit.memory import estimate as estimate_module
from memfit.memory.estimate import probe
from memfit.memory.isolate import run_isolated, run_isolated_many
from memfit.memory.tracker import OpTrace
from memfit.planner.search import MARGIN, PlanError, max_micro_batch, plan, price, resolve_budget
from memfit.workloads import builtin

import models

# a fixed machine so that rankings in these tests do not depend on the host they run on
FLAT = Profile(device="test", kind="cpu", source="fixed test figures",
               matmul={"f32": [[1e6, 1e-5], [1e12, 10.0]], "lp": [[1e6, 2e-5], [1e12, 20.0]]},
               bandwidth=20e9, op_overhead=5e-6, link_bandwidth=float("inf"))


@pytest.fixture(scope="module")
def gpt():
    """gpt-tiny's own 2 blocks (4 took a third longer to plan: ~9 s over the tests that use it); each test here
    asserts what it needs of the model (the micro-batch it plans, its families' verdicts)."""
    return builtin("gpt-tiny", layers=2)


def test_budgets_are_sizes_shares_or_the_whole_device():
    h100 = get_device("h100")
    assert resolve_budget(None, h100) == h100.memory_bytes
    assert resolve_budget("50%", h100) == h100.memory_bytes // 2
    assert resolve_budget("2GiB", h100) == 2 * 2**30
    assert resolve_budget(123456, h100) == 123456
    with pytest.raises(ValueError):
        resolve_budget("150%", h100)


def test_the_plan_fits_its_budget_by_a_full_estimate(gpt):
    none = memfit.estimate(gpt, Config(micro_batch=16))
    budget = int(0.6 * none.peak_bytes)
    p = plan(gpt, 16, budget=budget, profile=FLAT)
    assert p.config.global_batch == 16
    assert p.usable_bytes == int(budget * (1 - MARGIN))
    confirmed = memfit.estimate(gpt, p.config)
    assert confirmed.peak_bytes <= p.usable_bytes
    priced, seconds = price(gpt, p.config, profile=FLAT)  # the plan's figures are its pricing's, exactly
    assert (p.peak_bytes, p.step_seconds) == (priced.peak_bytes, seconds)
    if p.config.grad_accum <= 2:
        assert p.peak_bytes == confirmed.peak_bytes
    assert p.families and p.families[0][1].startswith("chosen")
    assert all(a.step_seconds >= p.step_seconds * 0.999 for a in p.alternatives if a.confirmed)


def test_fixed_choices_are_honoured(gpt):
    p = plan(gpt, 8, budget="1GiB", precision="bf16", micro_batch=2, profile=FLAT)
    assert (p.config.precision, p.config.micro_batch, p.config.grad_accum) == ("bf16", 2, 4)


def test_an_impossible_budget_says_what_it_would_take(gpt):
    with pytest.raises(PlanError, match="nothing fits .* needs at least .* of budget") as e:
        plan(gpt, 8, budget="100KiB", precision="fp32", activation_checkpoint="all", profile=FLAT)
    assert "world size" not in str(e.value)  # nothing distributed exists


def test_the_largest_micro_batch_fits_and_the_next_does_not(gpt):
    budget = memfit.estimate(gpt, Config(micro_batch=6)).peak_bytes / (1 - MARGIN) + 1
    r = max_micro_batch(gpt, budget=int(budget))
    m = r["micro_batch"]
    usable = r["usable_bytes"]
    assert memfit.estimate(gpt, Config(micro_batch=m)).peak_bytes <= usable
    assert memfit.estimate(gpt, Config(micro_batch=m + 1)).peak_bytes > usable
    assert m == 6


def test_step_time_model_orders_the_obvious_cases(gpt):
    plain = probe(gpt, Config(micro_batch=8)).ops
    ck = probe(gpt, Config(micro_batch=8, activation_checkpoint="all")).ops
    accum = probe(gpt, Config(micro_batch=1, grad_accum=8)).ops
    t_plain, t_ck, t_accum = step_seconds(FLAT, plain), step_seconds(FLAT, ck), step_seconds(FLAT, accum, 8)
    assert t_plain < t_ck  # recomputation costs time
    assert t_plain < t_accum  # eight small micro-steps pay eight times the per-op overhead
    # on a GPU the same ops are faster, and the host link prices offloaded bytes
    h100 = catalogue_profile(get_device("h100"))
    assert step_seconds(h100, plain) < t_plain
    off = memfit.estimate(gpt, Config(micro_batch=8, offload_optimizer=True), device="h100")
    assert off.moved_bytes > 0


def test_gpu_plans_search_offload_and_not_fp32(gpt):
    p = plan(gpt, 8, device="h100", budget="1GiB", activation_checkpoint="none")
    assert p.config.precision == "bf16"
    assert any("fp32 not searched" in n for n in p.notes)
    names = {f for f, _ in p.families}
    assert any("optimizer offload" in n for n in names)
    assert p.profile_source.startswith("catalogue")


def test_cli_plan_json_and_errors(capfd, gpt):
    assert main(["plan", "gpt-tiny", "--global-batch", "8", "--budget", "1GiB", "--precision", "fp32", "--json"]) == 0
    out = json.loads(capfd.readouterr().out)
    assert out["config"]["micro_batch"] * out["config"]["grad_accum"] == 8
    assert out["peak_bytes"] <= out["usable_bytes"]
    assert main(["plan", "gpt-tiny", "--budget", "1GiB"]) == 2
    assert "needs --global-batch" in capfd.readouterr().err
    assert main(["plan", "gpt-tiny", "--global-batch", "8", "--budget", "10KiB", "--precision", "fp32",
                 "--activation-checkpoint", "none"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memfit: error: nothing fits")


def _table(kind: str, nbytes: float, alloc: float = 0, flops: float = 0):
    from memfit.planner.costmodel import OpTable
    return OpTable(OpTrace(flops=[flops], bytes=[nbytes], alloc=[alloc], kind=[kind], phase=["forward"], name=[""]))


def test_step_time_model_prices_dropout_page_faults_and_cache():
    from memfit.planner.costmodel import LARGE_ALLOC, phase_seconds
    cpu = Profile(**{**FLAT.to_dict(), "rng_rate": 1e8, "fault_seconds": 1e-10,
                     "cache_bandwidth": [[1e6, 100e9], [1e8, 20e9]]})
    fwd = ("forward",)

    def busy(profile, *op):
        return phase_seconds(profile, _table(*op), fwd) - profile.op_overhead

    assert busy(FLAT, "f32", 1e8) == pytest.approx(1e8 / 20e9)
    assert busy(cpu, "f32", 1e6) == pytest.approx(1e6 / 100e9)  # from cache
    assert busy(cpu, "f32", 1e8) == pytest.approx(1e8 / 20e9)
    # dropout: 1e7 random numbers cost 0.1 s at 1e8/s, whether they take 4e7 bytes (fp32) or 2e7 (bf16)
    assert busy(cpu, "rng", 4e7, 0, 1e7) == pytest.approx(0.1)
    assert busy(cpu, "rng", 2e7, 0, 1e7) == pytest.approx(0.1)
    assert busy(FLAT, "rng", 4e7, 0, 1e7) == pytest.approx(4e7 / 20e9)  # no measured rate: bytes
    small, large = LARGE_ALLOC // 2, LARGE_ALLOC * 2
    assert busy(cpu, "f32", 1e8, small) == pytest.approx(1e8 / 20e9)  # reused from the heap
    assert busy(cpu, "f32", 1e8, large) == pytest.approx(1e8 / 20e9 + large * 1e-10)  # mapped afresh
    assert busy(cpu, "view", 1e8, large) == 0


def test_traced_ops_record_dropout_and_fresh_allocations():
    import torch

    def model():
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Dropout(0.1), torch.nn.Linear(256, 8))

    wl = memfit.Workload(model=model, batch=lambda n: (torch.randn(n, 64), torch.randint(0, 8, (n,))),
                         loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), name="dropout-mlp")
    ops = probe(wl, Config(micro_batch=32)).ops
    draws = [f for f, k in zip(ops.flops, ops.kind) if k == "rng"]
    assert draws == [32 * 256]  # one mask of 32 x 256 random numbers
    assert len(ops.alloc) == len(ops.kind)
    # the first Linear's output (32 x 256 fp32) is one fresh allocation of exactly its size
    assert 32 * 256 * 4 in ops.alloc
    assert all(a == 0 for a, k in zip(ops.alloc, ops.kind) if k == "view")
    # in-place ops allocate nothing: SGD's update writes into the weights
    assert all(a == 0 for a, n in zip(ops.alloc, ops.name) if n.endswith("_") and n != "copy_")


def test_a_profile_from_an_older_memfit_is_measured_again(tmp_path, monkeypatch):
    from memfit.planner.costmodel import load_profile, save_profile
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path))
    save_profile(FLAT, "cpu")
    assert load_profile("cpu") == FLAT
    old = FLAT.to_dict()
    for new_field in ("version", "cache_bandwidth", "rng_rate", "fault_seconds"):
        old.pop(new_field)
    (tmp_path / "profile-cpu.json").write_text(json.dumps(old))
    assert load_profile("cpu") is None
    (tmp_path / "profile-cpu.json").write_text("{not json")
    assert load_profile("cpu") is None


def test_the_state_floor_equals_a_real_steps_state():
    """state_bytes (fake tensors, optimizer primed without a step) against what a real step leaves behind,
    counted here from the model and optimizer directly."""
    import torch

    from memfit.memory.estimate import state_bytes
    wl = builtin("gpt-tiny", layers=2)
    for cfg in (Config(), Config(precision="bf16-pure")):
        trainer = memfit.Trainer(wl, cfg)
        trainer.step(trainer.batch(0))
        model, opt = trainer.engine.model, trainer.engine.optimizer
        tensors = list(model.parameters()) + list(model.buffers())
        tensors += [p.grad for p in model.parameters() if p.grad is not None]
        tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        real = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
        assert state_bytes(wl, cfg) == real


def test_families_over_budget_by_their_state_alone_are_not_traced(gpt):
    from memfit.memory.estimate import state_bytes
    h100 = get_device("h100")
    floor = state_bytes(gpt, Config(precision="bf16"), h100)
    offloaded = state_bytes(gpt, Config(precision="bf16", offload_optimizer=True), h100)
    assert offloaded < floor
    budget = int((floor - 1) / (1 - MARGIN))  # just under the full state: room for the offloaded one only
    p = plan(gpt, 8, device=h100, budget=budget, activation_checkpoint="all", precision="bf16")
    assert p.config.offload_optimizer
    verdicts = dict(p.families)
    assert verdicts["bf16, activation checkpointing all"].startswith("does not fit: weights, gradients and optimizer state alone")
    # (the chunked-loss variant of that family may be the faster one)
    assert any(v.startswith("chosen") for f, v in verdicts.items() if "optimizer offload" in f)


def test_a_workload_that_raises_is_one_clear_error():
    import torch

    from memfit.workload import WorkloadError

    def model():
        raise RuntimeError("boom")

    wl = memfit.Workload(model=model, batch=lambda n: torch.randn(n, 4), loss=lambda m, b: m(b).sum())
    with pytest.raises(WorkloadError, match="raised: RuntimeError: boom"):
        plan(wl, 8, budget="1GiB", profile=FLAT)


def test_a_model_that_cannot_train_at_micro_batch_1_is_planned_from_2():
    from memfit.errors import MicroBatchError

    wl = builtin("resnet-tiny")
    p = plan(wl, 8, budget="1GiB", precision="fp32", activation_checkpoint="none", profile=FLAT, confirm=1)
    assert p.config.micro_batch >= 2 and p.config.global_batch == 8
    assert any("cannot train at micro-batch 1" in n and "probed at 2 and 4" in n for n in p.notes)
    assert all(a.config.micro_batch >= 2 for a in p.alternatives)
    with pytest.raises(MicroBatchError, match="cannot train at micro-batch 1"):
        plan(wl, 8, budget="1GiB", precision="fp32", activation_checkpoint="none", micro_batch=1, profile=FLAT)


class _Flaky(torch.nn.Module):
    """A block whose recomputation computes something else than its forward did (it counts its calls):
    torch.utils.checkpoint refuses to checkpoint it, selectively or not."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.lin(x)
        return (h @ torch.ones(16, 16) if self.calls % 2 == 0 else h).relu()


def test_a_family_that_raises_is_skipped_with_its_reason():
    wl = memfit.Workload(model=lambda: torch.nn.Sequential(_Flaky(), _Flaky()), batch=lambda n: torch.randn(n, 16),
                         loss=lambda m, b: m(b).square().mean(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                         name="flaky")
    p = plan(wl, 4, budget="1GiB", precision="fp32", profile=FLAT)
    assert p.config.activation_checkpoint == "none"
    verdicts = dict(p.families)
    assert verdicts["fp32, activation checkpointing none"].startswith("chosen")
    for ck in ("all", "selective"):
        assert verdicts[f"fp32, activation checkpointing {ck}"].startswith(
            "skipped: tracing it raised CheckpointError: torch.utils.checkpoint: Recomputed values")


def test_the_largest_micro_batch_is_not_capped():
    """A model this small fits far more than 65,536 samples (the old silent cap) in a modest budget."""
    wl = memfit.Workload(model=lambda: torch.nn.Linear(4, 2), batch=lambda n: torch.randn(n, 4),
                         loss=lambda m, b: m(b).sum(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), name="tiny")
    per_sample = memfit.estimate(wl, Config(micro_batch=2)).peak_bytes - memfit.estimate(wl, Config()).peak_bytes
    budget = int(300_000 * per_sample / (1 - MARGIN))
    r = max_micro_batch(wl, budget=budget)
    m = r["micro_batch"]
    assert m > 1 << 16
    assert memfit.estimate(wl, Config(micro_batch=m)).peak_bytes <= r["usable_bytes"]
    assert memfit.estimate(wl, Config(micro_batch=m + 1)).peak_bytes > r["usable_bytes"]


def test_the_largest_micro_batch_on_a_gpu_without_bf16_plans_in_fp16(capfd):
    """--max-micro-batch without --precision takes the device's default (fp16 on a T4 or V100), not bf16,
    which these GPUs refuse. (The search for the answer takes ~40 s: one device answers in full.)"""
    assert main(["plan", "mlp", "--budget", "50%", "--device", "t4", "--max-micro-batch", "--json"]) == 0
    out = json.loads(capfd.readouterr().out)
    assert out["config"]["precision"] == "fp16" and out["peak_bytes"] <= out["usable_bytes"]
    with pytest.raises(PlanError, match="even micro-batch 1 does not fit .* on v100-32gb with fp16"):
        max_micro_batch(builtin("mlp"), budget="100MiB", device="v100")


@pytest.mark.parametrize("flag,value,says", [("--micro-batch", "0", "must be at least 1"),
                                             ("--global-batch", "0", "must be at least 1"),
                                             ("--verify-steps", "0", "must be at least 1"),
                                             ("--budget", "0", "must be more than 0"),
                                             ("--micro-batch", "3", "does not divide the global batch 8"),
                                             ("--micro-batch", "16", "does not divide the global batch 8")])
def test_bad_numbers_are_refused_before_anything_is_loaded(capfd, flag, value, says):
    """The workload file does not exist: an error about the numbers proves they were checked first."""
    args = {"--global-batch": "8", "--budget": "1GiB", flag: value}
    assert main(["plan", "no/such/job.py:workload", *[x for kv in args.items() for x in kv]]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    for cmd in ("estimate", "summary"):
        assert main([cmd, "no/such/job.py:workload", "--micro-batch", "0"]) == 2
        assert main([cmd, "no/such/job.py:workload", "--grad-accum", "0"]) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 2 and all("must be at least 1" in e for e in err)


# ------------------------------------------------------------------------------------------ step-time model

def _ops(*rows, phase="forward"):
    """An OpTable of (name, kind, flops, bytes) rows."""
    from memfit.planner.costmodel import OpTable
    names, kinds, flops, nbytes = zip(*rows)
    return OpTable(OpTrace(name=list(names), kind=list(kinds), flops=list(flops), bytes=list(nbytes),
                           alloc=[0] * len(rows), phase=[phase] * len(rows)))


# FLAT plus class curves: convolutions 10x slower than matmuls, bf16 attention backward 10x slower than
# its FLOPs at the matmul rate, bf16 elementwise ops half fp32's rate per byte, exp-like ops 10x slower
CURVED = Profile(**{**FLAT.to_dict(), "curves": {
    "conv.f32": [[1e6, 1e-4], [1e9, 0.1]], "conv_bytes.f32": [[1e3, 1e-4], [1e9, 1.0]],
    "attn_bwd.lp": [[1e6, 2e-4], [1e9, 0.2]],
    "elementwise.f32": [[1e3, 5e-8], [1e9, 0.05]], "elementwise.lp": [[1e3, 1e-7], [1e9, 0.1]],
    "special.f32": [[1e3, 5e-7], [1e9, 0.5]]}})


def _busy(profile, *op) -> float:
    from memfit.planner.costmodel import phase_seconds
    return phase_seconds(profile, _ops(op), ("forward",)) - profile.op_overhead


def test_step_time_model_prices_each_class_of_op_by_its_own_curve():
    lp_matmul = 1e9 / 1e12 * 20.0  # FLAT's bf16 matmul curve at 1 GFLOP
    # a convolution by its FLOPs on the convolution curve, or by its bytes if that is slower (narrow
    # convolutions cost per pixel); without curves, on the matmul curve
    assert _busy(CURVED, "convolution", "f32", 1e9, 1e3) == pytest.approx(0.1)
    assert _busy(CURVED, "convolution", "f32", 1e9, 1e9) == pytest.approx(1.0)
    assert _busy(FLAT, "convolution", "f32", 1e9, 1e3) == pytest.approx(0.01)
    assert _busy(CURVED, "convolution_backward", "f32", 1e9, 1e3) == pytest.approx(0.01)  # no curve of its own
    # bf16 attention backward: its own curve, not the matmul's, and not priced as random numbers
    assert _busy(CURVED, "_scaled_dot_product_flash_attention_for_cpu_backward", "lp", 1e9, 1e3) == pytest.approx(0.2)
    assert _busy(CURVED, "mm", "lp", 1e9, 1e3) == pytest.approx(lp_matmul)
    # elementwise by bytes at the dtype's rate: a bf16 multiply of half the bytes costs as much as fp32's
    assert _busy(CURVED, "mul", "f32", 0, 1e9) == pytest.approx(0.05)
    assert _busy(CURVED, "mul", "lp", 0, 0.5e9) == pytest.approx(0.05)
    assert _busy(CURVED, "some_new_op", "f32", 0, 1e9) == pytest.approx(0.05)
    for name in ("silu", "silu_backward", "_log_softmax", "native_layer_norm_backward", "native_batch_norm"):
        assert _busy(CURVED, name, "f32", 0, 1e9) == pytest.approx(0.5), name
    assert _busy(CURVED, "silu", "lp", 0, 1e9) == pytest.approx(0.1)  # no special bf16 curve: elementwise's
    assert _busy(CURVED, "_unsafe_view", "f32", 0, 1e9) == 0  # moves no data, though not marked a view


def test_traced_attention_is_priced_by_flops_and_fake_only_ops_are_not_recorded(gpt):
    ops = probe(gpt, Config(micro_batch=2)).ops
    attention = [(k, f) for n, k, f in zip(ops.name, ops.kind, ops.flops) if "attention" in n]
    assert attention and all(k == "f32" and f > 0 for k, f in attention)  # not "rng" for its dropout argument
    # a fake tensor's `.device` goes through the dispatcher (a real one's does not): not an op of the step
    assert "device" not in ops.name and len(ops) > 100


def _measured(**changes) -> Profile:
    import time

    from memfit.planner.costmodel import machine
    return Profile(**{**FLAT.to_dict(), "machine": machine("cpu"), "measured_at": time.time(), "rng_rate": 1e8,
                      **changes})


def test_a_calibration_taken_under_load_is_suspect_and_measured_again(monkeypatch):
    from memfit.planner import costmodel
    good = _measured()
    assert costmodel._problems(good, {"per-op cost": [5e-6, 6e-6]}, 0.1) == []
    bad = _measured(op_overhead=2.16e-3, matmul={"f32": [[1e6, 1e-4], [1e9, 1e-5]], "lp": FLAT.matmul["lp"]})
    problems = costmodel._problems(bad, {"per-op cost": [2.16e-3, 9e-6]}, 1.4)
    assert len(problems) == 4
    assert "2160 us per op" in problems[0] and "2160.0 us, then 9.0 us" in problems[1]
    assert "matmul.f32: a larger size ran faster" in problems[2] and "1.4 cores" in problems[3]
    # calibrate measures a suspect calibration once more, and keeps the good one
    bad.problems = problems
    runs = iter([bad, good])
    monkeypatch.setattr(costmodel, "_calibrate_once", lambda dev: next(runs))
    assert costmodel.calibrate("cpu") is good
    runs = iter([bad, bad])
    assert costmodel.calibrate("cpu").problems == problems
    assert costmodel.describe(bad).startswith(costmodel.BUSY)


def test_stale_profiles_are_measured_again_with_a_notice(tmp_path, monkeypatch, capsys):
    import dataclasses

    from memfit.planner import costmodel
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path))
    fresh = _measured()
    assert costmodel.stale(fresh) is None
    for key in ("torch", "cpu", "threads"):
        changed = dataclasses.replace(fresh, machine={**fresh.machine, key: "other"})
        assert costmodel.stale(changed).startswith(f"{key} changed from other")
    assert "31 days ago" in costmodel.stale(fresh, now=fresh.measured_at + 31 * 86400)
    suspect = dataclasses.replace(fresh, problems=["busy"])
    assert costmodel.stale(suspect) is None  # kept for an hour: not measured again at every plan
    assert "looked wrong (busy)" in costmodel.stale(suspect, now=fresh.measured_at + 7200)

    calls = []
    monkeypatch.setattr(costmodel, "calibrate", lambda device: calls.append(device) or _measured())
    cpu = get_device("cpu")
    costmodel.profile_for(cpu)
    err = capsys.readouterr().err
    assert calls == ["cpu"] and "calibrating this CPU" in err and str(costmodel.profile_path(costmodel.cpu_key())) in err
    costmodel.profile_for(cpu)  # cached
    assert calls == ["cpu"] and capsys.readouterr().err == ""
    costmodel.save_profile(dataclasses.replace(fresh, machine={**fresh.machine, "torch": "1.0"}), costmodel.cpu_key())
    costmodel.profile_for(cpu)
    assert calls == ["cpu", "cpu"] and "torch changed from 1.0" in capsys.readouterr().err


def busy_machine(monkeypatch, tmp_path) -> list:
    """An empty calibration cache, and a machine whose every calibration is rejected: the measurement itself
    (`_calibrate_once`) gives figures 5x off, with the check that caught them. Returns the measurements made."""
    from memfit.planner import costmodel
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path))
    made = []
    monkeypatch.setattr(costmodel, "_calibrate_once", lambda dev: made.append(dev) or _measured(
        source="calibrated on this machine", op_overhead=5 * FLAT.op_overhead,
        problems=["other processes used 1.4 cores meanwhile"]))
    return made


def test_a_rejected_calibration_is_never_presented_as_calibrated(tmp_path, monkeypatch, capsys):
    """With no earlier calibration of this CPU, the rejected figures are used, and every line that shows a
    step time from them says so: the plan's text and its JSON `profile`."""
    from memfit.planner import costmodel
    made = busy_machine(monkeypatch, tmp_path)
    p = plan(builtin("mlp-tiny"), 8, budget="64MiB", confirm=0)
    assert p.profile_source.startswith("measured on a busy machine ") and "calibrated" not in p.profile_source
    assert "(other processes used 1.4 cores meanwhile): step times may be several times off" in p.profile_source
    assert len(made) == 2 and "calibration rejected, measured on a busy machine" in capsys.readouterr().err
    assert p.to_dict()["profile"] == p.profile_source
    assert costmodel.step_time_caveat(p.profile_source) and not costmodel.step_time_caveat(describe(_measured()))
    # kept an hour in a file of its own, not measured again at the next plan, never the calibration in use
    assert not costmodel.profile_path(costmodel.cpu_key()).exists()
    assert main(["plan", "mlp-tiny", "--global-batch", "8", "--budget", "64MiB"]) == 0
    assert len(made) == 2 and "step times: measured on a busy machine" in " ".join(capsys.readouterr().out.split())
    assert main(["plan", "mlp-tiny", "--global-batch", "8", "--budget", "64MiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["profile"].startswith("measured on a busy machine ")


def test_an_earlier_good_calibration_stands_in_for_a_rejected_one(tmp_path, monkeypatch, capsys):
    """A calibration a month old (stale) is measured again; the new one is rejected, so the old one, of the
    same processor, prices the plan, which says so, and stays in the cache (it used to be overwritten)."""
    import time

    from memfit.planner import costmodel
    made = busy_machine(monkeypatch, tmp_path)
    old = _measured(measured_at=time.time() - 31 * 86400)
    costmodel.save_profile(old, costmodel.cpu_key())
    p = plan(builtin("mlp-tiny"), 8, budget="64MiB", confirm=0)
    assert costmodel.load_profile(costmodel.cpu_key()) == old
    assert p.profile_source.startswith("fixed test figures ") and not costmodel.step_time_caveat(p.profile_source)
    assert len(made) == 2 and "the earlier calibration of this CPU stands in" in capsys.readouterr().err
    assert p.profile_source.endswith("; an earlier calibration (measured 31 days ago), used because a new one was "
                                     "rejected, measured on a busy machine (other processes used 1.4 cores "
                                     "meanwhile); rerun `memfit calibrate` on a quiet machine")
    assert p.step_seconds == plan(builtin("mlp-tiny"), 8, budget="64MiB", confirm=0, profile=old).step_seconds
    # another processor's calibration does not stand in
    costmodel.save_profile(dataclasses.replace(old, machine={**old.machine, "cpu": "another CPU"}), costmodel.cpu_key())
    p = plan(builtin("mlp-tiny"), 8, budget="64MiB", confirm=0)
    assert len(made) == 2 and p.profile_source.startswith("measured on a busy machine ")


def test_cli_calibrate_refuses_a_suspect_calibration(tmp_path, monkeypatch, capfd):
    from memfit.planner import costmodel
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path))
    monkeypatch.setattr(costmodel, "calibrate", lambda device: _measured(problems=["other processes used 1.4 cores"]))
    assert main(["calibrate"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "calibration rejected, nothing saved: other processes used 1.4 cores" in err[0]
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(costmodel, "calibrate", lambda device: _measured())
    assert main(["calibrate"]) == 0
    out = capfd.readouterr().out
    assert "us per op" in out and costmodel.profile_path(costmodel.cpu_key()).is_file()


def test_a_family_prices_any_micro_batch_as_a_full_trace_does():
    """Probes at micro-batches 1 and 2 stand for any micro-batch. Their op lists differ (a reshape is a
    view at 1 and a copy at 2): ops are matched one by one, not totals extrapolated 32-fold."""
    from memfit.memory.estimate import probe, probe_pair
    from memfit.planner.search import _Family
    wl = builtin("sort")
    probes, _ = probe_pair(wl, Config(precision="bf16"), get_device("cpu"))
    assert probes[0].ops.name != probes[1].ops.name
    family = _Family(Config(precision="bf16"), probes)
    full = probe(wl, Config(micro_batch=32, precision="bf16")).ops
    # elementwise ops with a fixed cost (10 us up to 1 MB): a step's time is not linear in the micro-batch
    fixed = Profile(**{**CURVED.to_dict(), "curves": {
        **CURVED.curves, **{f"elementwise.{t}": [[1e3, 1e-5], [1e6, 1.1e-5], [1e9, 0.05]] for t in ("f32", "lp")}}})
    assert family.seconds(fixed, 32, 1) == pytest.approx(step_seconds(fixed, full), rel=0.01)


@pytest.mark.parametrize("device,config", [
    ("cpu", Config(micro_batch=2)),
    ("h100", Config(micro_batch=2, precision="bf16")),
    ("h100", Config(micro_batch=2, precision="bf16-pure", offload_optimizer=True, offload_activations=True))])
def test_an_accumulation_is_priced_as_its_micro_steps_traced_one_by_one(device, config, monkeypatch):
    """Every micro-step after the first adds its gradients into those kept (under optimizer offload, on the
    host), and the optimizer step's upload happens once: a step of 4 micro-steps traced whole is what the
    planner prices from a trace of 2 (the second repeating) and from its probes of one micro-step. Priced
    as the first micro-step repeated, it was 6% (H100) to 22% (CPU) short. What is left: a few ops' dispatch
    (the first micro-step clones a gradient it cannot take over; later ones keep the loss)."""
    from memfit.memory.estimate import probe_pair
    from memfit.planner.search import _Family
    wl, dev = builtin("gpt-tiny"), get_device(device)
    rates = CURVED if device == "cpu" else catalogue_profile(dev)
    two = probe(wl, config.replace(grad_accum=4), dev, isolate=False).ops  # (estimate.traced_steps)
    with monkeypatch.context() as m:
        m.setattr(estimate_module, "traced_steps", lambda c: c)  # every micro-step traced
        whole = step_seconds(rates, probe(wl, config.replace(grad_accum=4), dev, isolate=False).ops, 4)
    assert len(two.micro_steps) == 2
    assert step_seconds(rates, two, 4) == pytest.approx(whole, rel=0.005)
    probes, _ = probe_pair(wl, config.replace(micro_batch=1), dev)
    assert _Family(config.replace(micro_batch=1), probes).seconds(rates, 2, 4) == pytest.approx(whole, rel=0.005)


def test_op_alignment_is_a_longest_common_subsequence():
    """The two probes' op lists are matched by a shortest edit script (Myers): on random lists over a few
    names (many repeats, as op names have) the pairs match, increase, and are as many as the longest common
    subsequence found by dynamic programming."""
    import random

    from memfit.planner.search import _matches

    def lcs(a, b):
        prev = [0] * (len(b) + 1)
        for x in a:
            cur = [0]
            for j, y in enumerate(b):
                cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
            prev = cur
        return prev[-1]

    rng = random.Random(0)
    for _ in range(500):
        a = [rng.choice("abc") for _ in range(rng.randint(0, 14))]
        b = [rng.choice("abc") for _ in range(rng.randint(0, 14))]
        pairs = _matches(a, b)
        assert all(a[i] == b[j] for i, j in pairs)
        assert all(p[0] < q[0] and p[1] < q[1] for p, q in zip(pairs, pairs[1:]))
        assert len(pairs) == lcs(a, b)


def test_a_deep_model_is_predicted_from_two_shallow_copies():
    """12 identical blocks (the planner copies from 24 on; the line is the same): copies of `depths` blocks
    (2 and 4 on one CPU, 4 and 8 across FSDP ranks), their phases extended to 12, predict what the whole
    model's probes predict (CPU: to the byte; an FSDP GPU target: within 1%), and its step time. Blocks that
    differ are not copied."""
    from memfit.memory.estimate import probe_pair
    from memfit.memory.fake import FakeBuild, new_fake_mode
    from memfit.planner.search import _DeepFamily, _Family, depths, shallow, stack_depth

    wl = builtin("gpt-tiny", layers=12)
    with new_fake_mode() as mode, FakeBuild(mode):
        assert stack_depth(wl.model()) == 12 and stack_depth(shallow(wl, 4).model()) == 4
    uneven = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 8)]))
    assert stack_depth(uneven) is None
    cases = [("cpu", Config(activation_checkpoint="all")),
             ("h100", Config(precision="bf16", gpus=4, data_parallel="fsdp"))]
    traced = run_isolated_many([functools.partial(probe_pair, w, base, get_device(device)) for device, base in cases
                                for w in (wl, *(shallow(wl, k) for k in depths(base.gpus)))])  # a core each
    assert all(kind == "ok" for kind, _ in traced), traced
    for i, (device, base) in enumerate(cases):
        cpu = device == "cpu"
        (_, (whole, _)), *copies = traced[3 * i:3 * i + 3]
        whole = _Family(base, whole)
        deep = _DeepFamily(*(_Family(base, value[0]) for _, value in copies), 12)
        for m in (1, 8, 64):
            assert deep.memory(m, 2, cpu) == pytest.approx(whole.memory(m, 2, cpu), rel=0 if cpu else 0.01)
            assert deep.seconds(FLAT, m, 2) == pytest.approx(whole.seconds(FLAT, m, 2), rel=1e-6)


def test_a_deep_models_candidate_is_confirmed_counted_from_copies_with_the_whole_traces_figures():
    """On one GPU a candidate of a model of DEEP blocks or more is confirmed by the estimate counted from three
    shallow copies: the whole trace's bytes (the allocator's reserved peak included) and its step time (to float
    rounding: summed copy by copy), said in its notes."""
    from memfit.planner.search import DEEP, _seconds, full_probe

    wl, dev = builtin("gpt-tiny", layers=DEEP), get_device("h100")
    config = Config(micro_batch=2, grad_accum=4, precision="bf16")
    counted = run_isolated(functools.partial(full_probe, wl, config, dev))
    whole = run_isolated(functools.partial(probe, wl, config, dev, isolate=False))
    assert counted.counted is not None and counted.estimate.extrapolated_from == (3, DEEP)
    for field in ("peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "device_peak_bytes", "breakdown",
                  "phase_peaks", "flops", "parameters"):
        assert getattr(counted.estimate, field) == getattr(whole.estimate, field), field
    assert _seconds(FLAT, counted, config, dev) == pytest.approx(_seconds(FLAT, whole, config, dev), rel=1e-9)
    assert any(n.startswith(f"extrapolated from 3 of {DEEP} blocks") for n in counted.estimate.notes)


def test_gpu_counts_share_their_traces_and_the_fewest_are_confirmed():
    """plan_counts traces a family once, at the first count it may fit at, and predicts it at larger counts
    (sharded parameters and optimizer state scaled, gradient shards kept at the traced count's size); the
    fewest GPUs that fit get full estimates, the rest are labelled predictions, within a few percent of a
    full estimate at their own count."""
    from memfit.planner.search import plan_counts

    wl = builtin("gpt-tiny", d_model=512, layers=2)
    rows = plan_counts(wl, 64, [2, 16], device="h100", precision="bf16", activation_checkpoint="all",
                       data_parallel="fsdp")
    assert [r["plan"].confirmed for r in rows] == [True, False]
    for r in rows[1:]:
        p = r["plan"]
        full = memfit.estimate(wl, p.config, device="h100")
        assert p.peak_bytes == pytest.approx(full.device_peak_bytes, rel=0.03)


def test_bf16_weights_on_the_gpu_with_fp32_master_weights_on_the_host_are_searched():
    """gpt-small with 2 blocks at seq 128: bf16 autocast with optimizer offload keeps fp32 weights on the GPU
    (1.03 GiB with the context); bf16-pure with optimizer offload keeps bf16 ones (0.75 GiB) and fp32 master
    weights and optimizer state on the host. At 1 GiB only the second fits; the plan finds it without being told.
    Where bf16-pure is searched, autocast with optimizer offload is not traced beside its bf16-pure twin: the
    twin holds less and runs faster. The dominance, checked on the pair traced: at every micro-batch and
    accumulation, less memory and less time."""
    from memfit.memory.estimate import probe_pair
    from memfit.planner.search import _Family
    wl, dev = builtin("gpt-small", seq=128, layers=2), get_device("h100")  # 2 blocks: a sixth of the tracing of 12
    p = plan(wl, 2, device=dev, budget="1GiB", micro_batch=1, activation_checkpoint="all",
             offload_activations=False)
    assert (p.config.precision, p.config.offload_optimizer) == ("bf16-pure", True)
    verdicts = dict(p.families)
    assert verdicts["bf16, activation checkpointing all, optimizer offload"].startswith("not traced: its bf16-pure")
    assert any("bf16-pure searched" in n and "with optimizer offload, fp32 master weights" in n for n in p.notes)
    assert p.estimate.device_peak_bytes <= resolve_budget("1GiB", dev)
    autocast = Config(precision="bf16", activation_checkpoint="all", offload_optimizer=True)
    pair = [autocast, autocast.replace(precision="bf16-pure")]
    (k1, v1), (k2, v2) = run_isolated_many([functools.partial(probe_pair, wl, c, dev) for c in pair])
    assert k1 == k2 == "ok"
    auto, pure = _Family(pair[0], *v1), _Family(pair[1], *v2)
    rates = catalogue_profile(dev)
    assert auto.memory(1, 2, False) > p.usable_bytes  # the premise: autocast with offload does not fit
    for m, accum in ((1, 8), (2, 4), (8, 1)):
        assert pure.memory(m, accum, False) < auto.memory(m, accum, False)
        assert pure.seconds(rates, m, accum) < auto.seconds(rates, m, accum)
        assert pure.host() <= auto.host()


def test_a_family_that_differs_only_in_its_optimizer_is_traced_only_where_it_may_beat_the_plan(monkeypatch, tmp_path):
    """8-bit optimizer states and optimizer offload change only the optimizer step: such a family's forward
    and backward are its plain sibling's (offload adds host work and the bytes it moves). It is traced after
    the plain families' plan is confirmed, and only where the sibling's forward and backward plus its own
    optimizer step (traced alone) could beat that plan, where the smaller state may fit. The plan is the one
    the search tracing every family finds, and each family left out is as slow as its verdict says, or
    slower."""
    import re
    from memfit.planner import search
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path))  # the second plan reads the first one's traces
    monkeypatch.setenv("MEMFIT_TRACE_CACHE", "1")
    wl = builtin("gpt-small", layers=2, seq=128)  # weights, not activations, decide what fits
    options = dict(device="h100", budget="1.2GiB", allow=["8bit-optim"], offload_activations=False)
    p = plan(wl, 8, **options)
    left = {f: float(re.search(r"at least ([0-9.e+-]+) s", v).group(1)) for f, v in p.families
            if v.startswith("not traced: at least")}
    traced = [f for f, v in p.families if "8-bit" in f and not v.startswith("not traced")]
    assert left and traced
    monkeypatch.setattr(search, "_siblings", lambda s, bases: {})
    every = plan(wl, 8, **options)
    assert (every.config, every.peak_bytes, every.step_seconds) == (p.config, p.peak_bytes, p.step_seconds)
    for family, verdict in every.families:
        if family in left:
            ratio = re.match(r"fits, ([0-9.]+)x slower", verdict)
            assert ratio is None or float(ratio.group(1)) * every.step_seconds >= left[family] * 0.995, verdict


def test_a_model_without_low_precision_kernels_is_planned_in_fp32():
    """On a GPU the planner searches bf16 only; where every bf16 family raises, it searches fp32 and says
    why, instead of failing. A model that raises in fp32 too gets the bf16 failure."""
    wl = models.fourier()
    p = plan(wl, 8, device="h100", activation_checkpoint="none", offload_activations=False, offload_optimizer=False)
    assert p.config.precision == "fp32" and p.confirmed
    assert "fp32 searched: every family in low precision raised" in p.notes[0] and "BFloat16" in p.notes[0]
    with pytest.raises(memfit.errors.WorkloadError, match="BFloat16"):  # fixed by the user: no fallback
        plan(wl, 8, device="h100", precision="bf16", activation_checkpoint="none")

    def broken(model, b):
        raise ValueError("the loss is broken")

    with pytest.raises(memfit.errors.WorkloadError, match="the loss is broken"):
        plan(dataclasses.replace(wl, loss=broken), 8, device="h100", activation_checkpoint="none")


def test_a_candidate_its_full_estimate_refutes_is_never_offered(gpt, monkeypatch):
    """The probes predicted micro-batch 16 to fit; its full estimate (planted here) says it does not: it is
    neither chosen nor listed among the faster alternatives a user might pick."""
    import memfit.planner.search as search

    budget = 4 * memfit.estimate(gpt, Config(micro_batch=16)).peak_bytes
    usable = int(budget * (1 - MARGIN))
    real = search.full_probe

    def refuting(workload, config, dev):
        p = real(workload, config, dev)
        if config.micro_batch == 16:
            p.estimate.peak_bytes = usable + 1
        return p

    monkeypatch.setattr(search, "full_probe", refuting)
    p = plan(gpt, 16, budget=budget, precision="fp32", profile=FLAT)
    assert p.config.micro_batch != 16 and p.peak_bytes <= usable
    assert all(a.peak_bytes <= usable for a in p.alternatives)
    assert not any(a.config.micro_batch == 16 and a.confirmed for a in p.alternatives)
    assert any("micro-batch 16" in f and "full estimate needs" in v for f, v in p.families)
    assert all(a["peak_bytes"] <= usable for a in p.to_dict()["alternatives"])


def test_a_long_plan_says_what_it_traces_and_a_short_one_says_nothing(gpt):
    """progress_to: past its delay every stage reports its traces as they end; before it, nothing."""
    from memfit.planner.search import progress_to

    fixed = dict(budget="1GiB", profile=FLAT, precision="fp32", activation_checkpoint="none")
    lines = []
    with progress_to(lines.append, after=0):
        plan(gpt, 16, **fixed)
    assert lines[0].startswith("weights, gradients and optimizer state of ") and lines[0].endswith("0 of 2 traced")
    probing = [line for line in lines if line.startswith("probing ")]
    total = int(probing[0].split(" families")[0].split()[-1])
    assert probing[-1].endswith(f"{total} of {total} traced")
    assert any(line.startswith("confirming the ") for line in lines)
    quiet = []
    with progress_to(quiet.append, after=3600):
        plan(gpt, 16, **fixed)
    assert quiet == []


@pytest.mark.parametrize("name", ["hf:llama", "hf:mixtral", "hf:gpt2", "hf:llama+lora"])
def test_a_transformers_copy_built_with_fewer_layers_traces_as_the_cut_model(name):
    """transformers' factories (and LoRA on them) build a shallow copy from a config with fewer layers (the
    layers cut are never built): the copy has that many blocks, and its probes are the whole model cut to
    them, byte for byte and op for op."""
    from memfit.memory.estimate import probe_pair
    from memfit.memory.fake import FakeBuild, new_fake_mode
    from memfit.planner.search import shallow, stack_depth
    from memfit.workloads.hf import from_config, load_config

    from memfit.workloads.lora import lora

    cfg = load_config(name[3:].removesuffix("+lora"))
    cfg.num_hidden_layers = 5
    wl = from_config(cfg, seq=64)
    if name.endswith("+lora"):
        wl = lora(wl, r=4, targets="all-linear")
    with new_fake_mode() as mode, FakeBuild(mode):
        assert stack_depth(wl.model.with_blocks(2)) == 2
    cut = dataclasses.replace(wl, model=lambda: wl.model())  # a factory without with_blocks: built whole, then cut
    config, dev = Config(micro_batch=1, precision="bf16"), get_device("h100")
    (built, _), (whole, _) = probe_pair(shallow(wl, 2), config, dev), probe_pair(shallow(cut, 2), config, dev)
    for a, b in zip(built, whole):
        assert a.ops == b.ops
        for field in ("peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "phase_peaks", "flops",
                      "breakdown", "parameters"):
            assert getattr(a.estimate, field) == getattr(b.estimate, field), field
