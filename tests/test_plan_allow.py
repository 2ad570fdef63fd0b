"""What the planner may use beyond the math-keeping techniques (issue 14): LoRA only when allowed, the host
memory offloading needs checked against --host-memory, and the CLI's spelling of both."""
import pytest

from memfit.cli import main
from memfit.errors import PlanError
from memfit.memory.estimate import state_split
from memfit.planner.search import LORA, plan
from memfit.units import fmt_bytes
from memfit.workloads import load_workload


def test_lora_is_planned_only_when_allowed_and_says_how_to_train_it():
    """hf:llama, global batch 8 on 8 MiB of this CPU: the full fine-tune needs 8.9 MiB; with LoRA the base's
    gradients and optimizer state are gone."""
    wl, fixed = load_workload("hf:llama"), dict(budget="8MiB", device="cpu", precision="fp32",
                                                activation_checkpoint="none")
    with pytest.raises(PlanError, match="nothing fits in 8 MiB"):
        plan(wl, 8, **fixed)
    p = plan(wl, 8, allow=["lora"], **fixed)
    assert p.estimate.workload == f"hf:llama+lora:r={LORA['r']},alpha={LORA['alpha']},targets=all-linear"
    # AdamW's state for the adapters alone: a full fine-tune's is twice its parameters' bytes
    assert p.estimate.model_state_bytes["optimizer_state"] < 0.25 * p.estimate.model_state_bytes["parameters"]
    assert "--lora r=16,alpha=32,targets=all-linear" in p.notes[0] and "full fine-tune does not fit" in p.notes[1]


def test_offloading_is_held_to_the_host_memory_given():
    wl = load_workload("gpt-small", seq=128, layers=2)  # 63 M parameters: 1.0 GB of state on the host
    fixed = dict(device="h100", precision="bf16", activation_checkpoint="all", offload_activations=False,
                 offload_optimizer=True)
    with pytest.raises(PlanError, match="ruled out by --host-memory 100 MiB") as refused:
        plan(wl, 8, host_memory="100MiB", **fixed)
    assert "not traced" in str(refused.value)  # the state kept on the host is over already: no step traced
    p = plan(wl, 8, host_memory="64GiB", **fixed)
    assert any(n.startswith(f"this plan keeps {fmt_bytes(p.estimate.host_peak_bytes)} of master weights") and
               "--allow 8bit-optim" in n and "--allow paged-optim" in n for n in p.notes)
    # the fp32 master weights, their gradients and AdamW's two moments: 16 bytes a parameter, the host's floor
    with __import__("torch").device("meta"):
        params = sum(q.numel() for q in wl.model().parameters())
    floor = state_split(wl, p.config, "h100")[1]
    assert 16 * params <= floor <= p.estimate.host_peak_bytes <= 64 * 2**30


def test_cli_refuses_an_unknown_technique_and_lora_in_train(capsys):
    assert main(["plan", "gpt-tiny", "--global-batch", "8", "--allow", "lora,4bit"]) == 2
    assert "cannot allow 4bit" in capsys.readouterr().err
    assert main(["train", "gpt-tiny", "--steps", "1", "--allow", "lora"]) == 2
    assert "--lora r=16,alpha=32,targets=all-linear" in capsys.readouterr().err


def test_train_runs_a_saved_plan_as_it_is(tmp_path, capsys):
    """`memfit plan --json > plan.json` then `memfit train --config plan.json`: the plan's configuration, with
    the techniques only a configuration can ask for (the optimizer step in backward, a chunked loss, 8-bit
    states), is what runs; a bad file is one line."""
    import json

    from memfit import Config
    config = Config(micro_batch=8, loss_chunks=2, optimizer_in_backward=True, optimizer_8bit=True)
    (tmp_path / "plan.json").write_text(json.dumps({"config": config.to_dict(), "device": "cpu"}))
    assert main(["train", "gpt-tiny", "--steps", "2", "--global-batch", "8", "--config", str(tmp_path / "plan.json"),
                 "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert Config.from_dict(report["config"]) == config
    assert main(["train", "gpt-tiny", "--steps", "2", "--config", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_when_the_host_limit_rules_out_offloading_the_plan_says_so_and_paged_states_fit(monkeypatch):
    """gpt-small (2 layers) in bf16-pure on a 0.95 GiB slice of an H100 with 200 MiB of host memory: offloading
    needs 966 MiB of host, the plain step is over; the refusal names the host limit and the technique that may
    fit, and with it allowed the plan pages its 8-bit states (123 MiB on the host). memfit's 8-bit update runs
    in chunks of 1 Mi elements here (16 Mi by default), so its fp32 temporaries stay small beside this model."""
    from memfit.strategies import optimizer_8bit

    monkeypatch.setattr(optimizer_8bit, "CHUNK", 1 << 20)
    wl = load_workload("gpt-small", seq=128, layers=2)
    limits = dict(device="h100", budget="0.95GiB", host_memory="200MiB", precision="bf16-pure",
                  activation_checkpoint="none")
    with pytest.raises(PlanError) as refused:
        plan(wl, 2, **limits)
    said = str(refused.value)
    assert "ruled out by --host-memory 200 MiB" in said and "--allow paged-optim may fit" in said
    p = plan(wl, 2, allow=["paged-optim"], **limits)
    assert p.config.paged_optimizer and p.config.optimizer_8bit and p.confirmed
    assert p.peak_bytes <= p.usable_bytes and p.estimate.host_peak_bytes <= 200 * 2**20
    assert any("paged 8-bit optimizer states allowed" in n for n in p.notes)


def test_a_family_over_its_floor_by_its_gradients_alone_is_traced_with_the_step_in_backward():
    """4 layers of width 256 in fp32 on 60 MiB of this CPU: weights, gradients and AdamW state need 66 MiB, so
    every family is over its floor; without a gradient buffer the step peaks at 54 MiB, and that is the plan."""
    wl = load_workload("gpt-tiny", layers=4, d_model=256, ffn=1024, seq=8)
    p = plan(wl, 2, device="cpu", budget="60MiB", precision="fp32", activation_checkpoint="none")
    assert p.config.optimizer_in_backward and p.config.grad_accum == 1 and p.confirmed
    assert p.peak_bytes <= p.usable_bytes
    assert any("traced that way" in v for _, v in p.families)


def test_a_state_floor_less_its_gradients_is_the_floor_with_the_step_in_backward():
    """The planner prices a family with the optimizer step in backward from the family's own floor, less its
    gradients (state_parts), instead of priming it again: the same bytes."""
    from memfit import Config
    from memfit.memory.estimate import state_parts

    wl = load_workload("gpt-small", seq=128)
    for config in (Config(precision="bf16-pure"), Config(precision="bf16", optimizer_8bit=True, paged_optimizer=True)):
        on_device, on_host, grads = state_parts(wl, config, "h100")
        assert grads > 0
        assert state_split(wl, config.replace(optimizer_in_backward=True), "h100") == (on_device - grads, on_host)


@pytest.mark.parametrize("device", ["h100", "cpu"])
def test_a_state_floors_optimizer_step_is_the_probes_optimizer_phase_op_for_op(device):
    """The planner bounds a family that differs from a traced one only in its optimizer (8-bit states,
    optimizer offload) with that family's optimizer step, traced alone beside its state floor (state_parts):
    the ops a probe of the family records in its optimizer phase, the same FLOPs, bytes and kinds, and the
    same gradient adds a later micro-step makes."""
    from memfit import Config
    from memfit.memory.devices import get_device
    from memfit.memory.estimate import probe, state_parts

    wl = load_workload("gpt-tiny")
    for config in (Config(micro_batch=2, precision="bf16-pure", optimizer_8bit=True),
                   Config(micro_batch=2, precision="bf16-pure", offload_optimizer=True),
                   Config(micro_batch=2, precision="fp32", optimizer_8bit=True, offload_optimizer=True),
                   Config(micro_batch=2, precision="bf16", optimizer_8bit=True, paged_optimizer=True)):
        if device == "cpu" and (config.offload_optimizer or config.paged_optimizer):
            continue  # (offloading and paging are from a GPU)
        *_, alone = state_parts(wl, config, device, optimizer_ops=True)
        ops = probe(wl, config, get_device(device)).ops
        rows = [i for i, phase in enumerate(ops.phase) if phase == "optimizer"]
        assert rows and len(alone) == len(rows), config.describe()
        for field in ("flops", "bytes", "alloc", "kind", "name"):
            assert getattr(alone, field) == [getattr(ops, field)[i] for i in rows], (config.describe(), field)
        assert alone.accumulate == ops.accumulate and ops.accumulate, config.describe()
