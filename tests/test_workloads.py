"""Every built-in and zoo workload really trains on a CPU, and the big presets have the published shapes."""
from __future__ import annotations

import inspect
import sys

import pytest
import torch

from memfit.torch_internals import FakeTensorMode
from memfit.workload import Workload, WorkloadError
from memfit.workloads import load_workload
from memfit.workloads import BUILTIN_NAMES, builtin

import models

SMALL_BUILTINS = ["gpt-tiny", "resnet-tiny", "mlp-tiny"]
HF_TYPES = ["llama", "gpt2", "bert", "t5"]


def train_step(wl: Workload, n: int = 2) -> None:
    """One real step; fails unless the loss is finite and every parameter moved."""
    torch.manual_seed(0)
    model = wl.model()
    opt = wl.optimizer(model.parameters())
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt.zero_grad()
    loss = wl.loss(model, wl.batch(n))
    assert loss.dim() == 0, f"{wl.name}: loss has shape {tuple(loss.shape)}"
    assert torch.isfinite(loss), f"{wl.name}: loss {loss.item()}"
    loss.backward()
    opt.step()
    stuck = [name for name, p in model.named_parameters() if torch.equal(before[name], p.detach())]
    assert not stuck, f"{wl.name}: parameters unchanged by the step: {stuck}"


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


# ---------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize("name", SMALL_BUILTINS)
def test_builtin_small_trains(name):
    train_step(builtin(name))


@pytest.mark.parametrize("optimizer", sorted(models.OPTIMIZERS))
@pytest.mark.parametrize("name", sorted(models.ALL))
def test_zoo_trains(name, optimizer):
    wl = models.ALL[name](optimizer=optimizer)
    assert isinstance(wl, Workload)
    train_step(wl)


@pytest.mark.parametrize("model_type", HF_TYPES)
def test_hf_trains(model_type):
    pytest.importorskip("transformers")
    wl = builtin(f"hf:{model_type}", seq=16)
    assert wl.name == f"hf:{model_type}"
    train_step(wl)


def test_hf_config_json(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4, vocab_size=100,
                                   torch_dtype="bfloat16")
    cfg.save_pretrained(tmp_path)
    wl = load_workload(f"hf:{tmp_path / 'config.json'}", seq=8)
    model = wl.model()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert next(model.parameters()).dtype == torch.float32  # memfit picks precision, not config.json
    assert wl.batch(3)["input_ids"].shape == (3, 8)
    from memfit.workloads import hf

    assert type(hf.from_config(cfg, seq=8).model()).__name__ == "LlamaForCausalLM"
    assert type(hf.from_config(str(tmp_path), seq=8).model()).__name__ == "LlamaForCausalLM"


def test_hf_heads_and_batches():
    pytest.importorskip("transformers")
    from memfit.workloads import hf

    assert [hf.pick_task(hf.load_config(t)) for t in HF_TYPES] == ["causal", "causal", "masked", "seq2seq"]
    labels = builtin("hf:bert", seq=64).batch(4)["labels"]
    assert (labels != -100).any(dim=1).all()
    with pytest.raises(WorkloadError, match="positions"):
        builtin("hf:gpt2", seq=4096)
    with pytest.raises(WorkloadError, match="positions"):
        builtin("hf:bert", seq=513)
    builtin("hf:llama", seq=8192)  # rotary: no table to run past
    # The option check for hf: names must track from_config's keyword options.
    from memfit import workloads

    accepted = set(inspect.signature(workloads._hf_signature).parameters)
    assert accepted == set(inspect.signature(hf.from_config).parameters) - {"config"}


# ---------------------------------------------------------------------------------------------- shapes


def test_gpt_7b_matches_llama2():
    with torch.device("meta"):
        model = builtin("gpt-7b").model()
    assert param_count(model) == 6_738_415_616
    assert len(model.layers) == 32


def test_gpt_1b_matches_tinyllama():
    with torch.device("meta"):
        model = builtin("gpt-1b").model()
    assert param_count(model) == 1_100_048_384


def test_gpt_small_count():
    v, d, layers, ffn = 32000, 768, 12, 2048
    per_layer = 4 * d * d + 3 * d * ffn + 2 * d  # q, k, v, o; gate, up, down; two RMSNorm weights
    expected = 2 * v * d + layers * per_layer + d  # embedding, untied head, final norm
    with torch.device("meta"):
        model = builtin("gpt").model()
    assert param_count(model) == expected
    assert 120e6 < expected < 140e6


def test_gpt_options():
    wl = builtin("gpt-tiny", seq=16, layers=1, d_model=32)
    model = wl.model()
    assert len(model.layers) == 1 and model.embed.embedding_dim == 32
    assert wl.batch(3)["tokens"].shape == (3, 17)
    assert load_workload("gpt-tiny", seq="8").batch(2)["tokens"].shape == (2, 9)  # CLI strings accepted
    with torch.device("meta"):
        assert builtin("gpt-7b", d_model=2048).model().layers[0].mlp.up_proj.out_features == 5632


def test_resnet50_count():
    with torch.device("meta"):
        model = builtin("resnet").model()
    assert param_count(model) == 25_557_032  # torchvision's resnet50
    assert builtin("resnet", image=64).batch(2)[0].shape == (2, 3, 64, 64)


# ---------------------------------------------------------------------------------------------- contract


@pytest.mark.parametrize("name", [*SMALL_BUILTINS, "hf:llama", "hf:t5"])
def test_builtins_trace_on_fake_tensors(name):
    if name.startswith("hf:"):
        pytest.importorskip("transformers")
    wl = builtin(name, **({"seq": 16} if name.startswith("hf:") else {}))
    with FakeTensorMode():
        model = wl.model()
        wl.loss(model, wl.batch(2)).backward()
        wl.optimizer(model.parameters()).step()


def test_unknown_name_lists_builtins():
    with pytest.raises(WorkloadError) as err:
        builtin("gpt-99b")
    message = str(err.value)
    assert "\n" not in message and "path/to/job.py:function" in message
    assert all(name in message for name in BUILTIN_NAMES)


def test_unknown_option():
    with pytest.raises(WorkloadError, match="sqe"):
        builtin("gpt-tiny", sqe=10)
    with pytest.raises(WorkloadError, match="depth"):
        builtin("resnet", depth=34)


def test_missing_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    with pytest.raises(WorkloadError, match=r"pip install 'memfit\[hf\]'"):
        builtin("hf:llama")


def test_zoo_names():
    assert set(models.ALL) >= {"vit", "unet", "lstm_lm", "gpt_sdpa", "moe", "moe_item", "embedding_bag",
                               "custom_function", "inplace_tied", "rnn_gru"}
    assert models.DATA_DEPENDENT <= set(models.ALL)
    with pytest.raises(ValueError, match="adagrad"):
        models.vit(optimizer="lion")


# ---------------------------------------------------------------------------------------------- job files

JOB_BESIDE = """
import torch
import torch.nn.functional as F
import memfit
from beside_job import WIDTH  # a module in the job's own folder


def workload():
    return memfit.Workload(model=lambda: torch.nn.Linear(WIDTH, 2),
                           batch=lambda n: (torch.randn(n, WIDTH), torch.randint(0, 2, (n,))),
                           loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
"""


def test_a_job_file_imports_the_modules_beside_it_and_only_its_folder_is_added(tmp_path, monkeypatch):
    """The `memfit` script puts neither the working directory nor the job's folder on sys.path; a job that
    imports a helper from its own folder failed without PYTHONPATH=."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # given back as it was after the test
    job = tmp_path / "jobs" / "job.py"
    job.parent.mkdir()
    job.write_text(JOB_BESIDE)
    (job.parent / "beside_job.py").write_text("WIDTH = 6\n")
    before = list(sys.path)
    try:
        assert load_workload(f"{job}:workload").model().in_features == 6
        load_workload(f"{job}:workload")  # a second load adds nothing more
    finally:
        sys.modules.pop("beside_job", None)
    assert sys.path == [str(job.parent.resolve()), *before]


JOB_WITH_KEYWORDS = """
import torch
import torch.nn.functional as F
import memfit


def workload(width=4, lr=1e-3, *, seq=None):
    return memfit.Workload(model=lambda: torch.nn.Linear(width, 2),
                           batch=lambda n: (torch.randn(n, width), torch.randint(0, 2, (n,))),
                           loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                           optimizer=lambda params: torch.optim.AdamW(params, lr=lr),
                           name=f"width={width!r} lr={lr!r} seq={seq!r}")


def fixed():
    return workload()
"""


def test_options_are_keyword_arguments_of_a_workload_function(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(JOB_WITH_KEYWORDS)
    assert load_workload(f"{job}:workload", width=8, lr=3e-4).name == "width=8 lr=0.0003 seq=None"
    assert load_workload(f"{job}:workload", seq=16).name == "width=4 lr=0.001 seq=16"
    with pytest.raises(WorkloadError) as err:
        load_workload(f"{job}:workload", widht=8)
    assert str(err.value) == (f"{job}:workload() got an unexpected keyword argument 'widht'; its keyword "
                              "arguments: width, lr, seq (-o KEY=VALUE and --seq pass them)")
    with pytest.raises(WorkloadError, match=r"fixed\(\) got an unexpected keyword argument 'seq'; it takes no "
                                            r"keyword arguments"):
        load_workload(f"{job}:fixed", seq=16)
