"""LoRA as a workload option: `--lora` parsing and its errors, adapters counted by hand, the estimate on fake
tensors against the profiler, another PEFT method on fake tensors, and a LoRA run that resumes."""
import sys

import pytest
import torch
from safetensors.torch import load_file

import memfit
from memfit import Config
from memfit.cli import main
from memfit.errors import WorkloadError
from memfit.workloads import builtin, lora
from memfit.workloads.lora import parse_lora
from truth import real_step_peak

pytest.importorskip("peft")
pytest.importorskip("transformers")

# hf:llama's toy size (workloads/hf.py SMALL_CONFIGS): hidden 128, 4 heads of 32, 2 key/value heads, 2 layers
HIDDEN, KV_OUT, LAYERS = 128, 2 * 32, 2


def test_parse_lora_reads_the_command_line_syntax():
    assert parse_lora("r=16,alpha=32,targets=q_proj,v_proj") == {"r": "16", "alpha": "32",
                                                                  "targets": ["q_proj", "v_proj"]}
    assert parse_lora("targets=c_attn, dropout=0.1") == {"targets": ["c_attn"], "dropout": "0.1"}
    for bad, says in [("rank=4", "unknown key 'rank'"), ("r=4,r=8", "r given twice"), ("r=4,q_proj", "key=value"),
                      ("targets=q_proj,,v_proj", "key=value")]:
        with pytest.raises(WorkloadError, match=says):
            parse_lora(bad)


@pytest.mark.parametrize("value, says", [("r=0", "r must be > 0"), ("r=-2", "r must be > 0"),
                                         ("r=2.5", "r must be a whole number"), ("r=4,dropout=1", "dropout must be"),
                                         ("alpha=0", "alpha must be > 0"), ("rank=4", "unknown key 'rank'"),
                                         ("targets=q_proj,nope", "no module called nope in LlamaForCausalLM")])
def test_bad_lora_options_are_one_line_and_exit_2(value, says, capsys):
    assert main(["estimate", "hf:llama", "--seq", "16", "--lora", value]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and err.startswith("memfit: error:")


def test_lora_without_peft_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` then raises ImportError
    with pytest.raises(WorkloadError, match=r"pip install 'memfit\[hf\]'"):
        lora(builtin("hf:llama"), r=4)


def test_adapters_alone_have_gradients_and_optimizer_state_counted_by_hand():
    """q_proj (128 -> 128) and v_proj (128 -> 64) get A (r x in) and B (out x r) in each of the 2 layers."""
    r = 16
    adapters = LAYERS * (r * (HIDDEN + HIDDEN) + r * (HIDDEN + KV_OUT))
    assert adapters == 14_336
    base = builtin("hf:llama", seq=32)
    wl = lora(base, r=r, alpha=32, targets=["q_proj", "v_proj"])
    assert wl.name == "hf:llama+lora:r=16,alpha=32,targets=q_proj,v_proj"
    cfg = Config(micro_batch=2)
    est, plain = memfit.estimate(wl, cfg), memfit.estimate(base, cfg)
    assert est.method == "fake", est.notes
    assert est.parameters == plain.parameters + adapters
    assert est.model_state_bytes["parameters"] == plain.model_state_bytes["parameters"] + 4 * adapters
    assert est.model_state_bytes["gradients"] == 4 * adapters
    # AdamW: exp_avg and exp_avg_sq per adapter weight, and a 4-byte step for each of the 8 adapter tensors
    assert est.model_state_bytes["optimizer_state"] == 2 * 4 * adapters + 4 * LAYERS * 2 * 2
    model = wl.model()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 8 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    opt = wl.optimizer(model.parameters())  # the optimizer is handed the adapters only
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == adapters


def test_default_targets_are_peft_s_for_the_architecture():
    est = memfit.estimate(lora(builtin("hf:gpt2", seq=32), r=4), Config(micro_batch=1))
    assert est.method == "fake"
    # GPT-2: c_attn (a Conv1D, 128 -> 384) in each of 2 layers
    assert est.model_state_bytes["gradients"] == 4 * 2 * 4 * (128 + 3 * 128)


def test_models_without_a_default_must_name_targets():
    with pytest.raises(WorkloadError, match="name them.*Linear layers: .*q_proj"):
        memfit.estimate(lora(builtin("gpt-tiny"), r=4), Config(micro_batch=1))


@pytest.mark.parametrize("name", ["hf:llama", "hf:gpt2"])
def test_lora_estimate_matches_the_profiler(name):
    wl, cfg = lora(builtin(name, seq=64), r=8, dropout=0.1), Config(micro_batch=2)
    est = memfit.estimate(wl, cfg)
    assert est.method == "fake"
    assert est.peak_bytes == pytest.approx(real_step_peak(wl, cfg), rel=0.01)


def test_another_peft_method_wrapping_modules_traces_on_fake_tensors():
    """IA3 replaces the targeted layers with its own modules, as LoRA does: no fallback to real steps."""
    from peft import IA3Config, get_peft_model

    base = builtin("hf:llama", seq=32)
    ia3 = IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"])
    wl = memfit.Workload(model=lambda: get_peft_model(base.model(), ia3), batch=base.batch, loss=base.loss,
                         optimizer=lambda params: torch.optim.AdamW([p for p in params if p.requires_grad]))
    est = memfit.estimate(wl, Config(micro_batch=2))
    assert est.method == "fake", est.notes
    # one scale per output of k_proj and v_proj (64 each), per input of down_proj (256), in 2 layers
    assert est.model_state_bytes["gradients"] == 4 * LAYERS * (KV_OUT + KV_OUT + 256)


def test_a_lora_run_resumes_to_the_uninterrupted_run_s_adapters(tmp_path):
    """4 steps with a checkpoint every 2; the newest checkpoint is then removed as if the run had died after
    step 2, and --resume redoes steps 3 and 4 from the adapters and optimizer state saved at 2."""
    wl = lora(builtin("hf:llama", seq=16), r=2, targets="q_proj,v_proj")
    out = tmp_path / "run"
    run = dict(steps=4, global_batch=2, micro_batch=2, out=out, checkpoint_every=2, progress=False,
               deterministic=True)
    memfit.train(wl, **run)
    done = load_file(str(out / "model.safetensors"))
    at_2 = torch.load(out / "checkpoints" / "step-00000002.pt", weights_only=True)["model"]
    for name in ("step-00000004.pt", "step-00000004.pt.sha256", "model.safetensors", "report.json"):
        (out / ("checkpoints" if name.startswith("step") else "") / name).unlink()
    result = memfit.train(wl, resume=True, **run)
    assert result.steps == 4 and not result.already_complete
    resumed = load_file(str(out / "model.safetensors"))
    assert resumed.keys() == done.keys()
    for key, value in done.items():
        assert torch.equal(resumed[key], value), key
        trained = ".lora_A." in key or ".lora_B." in key
        assert torch.equal(value, at_2[key]) != trained, key  # the base stayed as it was, the adapters moved
