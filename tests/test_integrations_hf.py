"""Hugging Face Trainer and TRL's SFTTrainer: memfit's estimate of the step each runs against the profiler's
peak of a real `.train()` on the CPU, the arguments `fit_training_args` returns, `--emit` read back by
HfArgumentParser, and the refusals."""
from __future__ import annotations

import json
import warnings

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from truth_stacks import TokenRows, trainer_peak  # noqa: E402

from memfit import Config  # noqa: E402
from memfit.cli import main  # noqa: E402
from memfit.errors import ConfigError, PlanError, WorkloadError  # noqa: E402
from memfit.integrations.transformers import (config_of, emit, estimate_training_args,  # noqa: E402
                                              fit_training_args, settings)
from memfit.memory.estimate import Category  # noqa: E402
from memfit.workloads.hf import load_config  # noqa: E402

SEQ = 64
# Trainer's own 0-d tensors that memfit's step does not make (its running loss, num_items_in_batch, the
# detached loss it returns): a few of 4 or 8 bytes. The dataloader's batch fetched ahead (4 KiB here) and
# every activation are far above it, so a term left out fails the test.
SCALARS = 64


def _args(tmp_path, **kw):
    base = dict(use_cpu=True, max_steps=3, report_to="none", save_strategy="no", logging_strategy="no",
                disable_tqdm=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return transformers.TrainingArguments(str(tmp_path), **{**base, **kw})


def _maker(kind: str):
    config = load_config(kind)
    auto = transformers.AutoModelForCausalLM if kind == "llama" else transformers.AutoModelForMaskedLM
    return (lambda: auto.from_config(config)), TokenRows(config.vocab_size, SEQ, masked=kind == "bert")


@pytest.mark.parametrize("kind,kw", [
    ("llama", dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, optim="adamw_torch")),
    ("llama", dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, bf16=True,
                   activation_checkpointing=True, max_grad_norm=0.0)),
    ("bert", dict(per_device_train_batch_size=8, bf16=True, activation_checkpointing=True)),
], ids=["llama-fp32-adamw_torch-accum-clip", "llama-bf16-fused-checkpointing-accum-noclip",
        "bert-bf16-fused-checkpointing-clip"])
def test_estimate_is_the_peak_of_trainer_train(tmp_path, kind, kw):
    make, data = _maker(kind)
    args = _args(tmp_path, **kw)
    truth, trainer = trainer_peak(make, args, data)
    predicted = estimate_training_args(make(), args, seq_len=SEQ, device="cpu")
    assert trainer.state.global_step == 3
    assert abs(predicted.peak_bytes - truth) <= SCALARS, (predicted.peak_bytes, truth)


@pytest.mark.parametrize("kind,budget,kw,allow", [  # Llama's is MemfitCallback's test, below
    ("bert", "20MiB", dict(per_device_train_batch_size=8, gradient_accumulation_steps=2, max_grad_norm=0.0),
     ("bf16",)),
])
def test_fit_training_args_keeps_the_global_batch_and_trainer_peaks_where_predicted(tmp_path, kind, budget, kw,
                                                                                    allow):
    make, data = _maker(kind)
    user = _args(tmp_path, **kw)
    before = user.to_dict()
    args, plan = fit_training_args(make(), user, seq_len=SEQ, device="cpu", budget=budget, allow=allow)
    assert user.to_dict() == before  # a copy is returned
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size == \
        user.per_device_train_batch_size * user.gradient_accumulation_steps * user.world_size
    assert (args.optim, args.max_grad_norm, args.learning_rate) == (user.optim, user.max_grad_norm, user.learning_rate)
    assert args.bf16 in ((user.bf16, True) if allow else (user.bf16,))
    assert plan.peak_bytes <= plan.usable_bytes
    truth, trainer = trainer_peak(make, args, data)
    assert trainer.state.global_step == 3
    assert abs(plan.peak_bytes - truth) <= SCALARS, (plan.config.describe(), plan.peak_bytes, truth)


@pytest.mark.parametrize("config", [
    Config(micro_batch=4, grad_accum=8, precision="bf16", activation_checkpoint="all"),
    Config(micro_batch=16, grad_accum=2, activation_checkpoint=2),
    Config(micro_batch=2, grad_accum=1, precision="fp16"),
])
def test_emitted_flags_parse_back_to_the_same_arguments(tmp_path, config):
    trainer_text = emit(config, "trainer")
    keywords, flags = trainer_text.splitlines()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        [parsed] = transformers.HfArgumentParser(transformers.TrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--use_cpu", *_split(flags)])
        built = eval(keywords, {"TrainingArguments": lambda **kw: _args(tmp_path, **kw)})
    for key, value in settings(config).items():
        assert getattr(parsed, key) == getattr(built, key) == value, key
    trl = pytest.importorskip("trl")
    line = emit(config, "trl")
    assert line.startswith("trl sft ")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        [sft] = transformers.HfArgumentParser(trl.SFTConfig).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--use_cpu", *_split(line.split(" DATA ")[1])])
    for key, value in settings(config).items():  # SFTConfig's own defaults (checkpointing, bf16 on) overridden
        assert getattr(sft, key) == value, key


def _split(flags: str) -> list[str]:
    import shlex

    return shlex.split(flags)


def test_cli_emit_prints_runnable_arguments(capsys):
    assert main(["plan", "hf:llama", "--seq", "32", "--global-batch", "8", "--budget", "20MiB", "--precision", "fp32",
                 "--emit", "trainer", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = Config.from_dict(out["config"])
    assert cfg.global_batch == 8 and out["emit"] == emit(cfg, "trainer")
    assert all(Config.from_dict(a["config"]).activation_checkpoint != "selective" for a in out["alternatives"])


def test_what_is_not_modelled_is_one_clear_line_and_no_plan(tmp_path):
    make, _ = _maker("llama")
    deepspeed = _args(tmp_path)
    deepspeed.deepspeed = {"zero_optimization": {"stage": 2}}  # as built where DeepSpeed is installed (not here)
    for args, words in [(deepspeed, "DeepSpeed"), (_args(tmp_path, torch_compile=True), "torch_compile"),
                        (_args(tmp_path, optim="ademamix_8bit"), "optim='ademamix_8bit'"),
                        (_args(tmp_path, label_smoothing_factor=0.1), "label_smoothing_factor")]:
        with pytest.raises(ConfigError, match=words) as e:
            fit_training_args(make(), args, seq_len=SEQ, device="cpu", budget="1GiB")
        assert "\n" not in str(e.value) and str(e.value).startswith("not modelled by memfit for Trainer")


def test_bad_models_and_budgets_are_refused_in_one_line(tmp_path):
    import torch

    make, _ = _maker("llama")
    args = _args(tmp_path, per_device_train_batch_size=8)
    with pytest.raises(WorkloadError, match="no transformers config"):
        fit_training_args(torch.nn.Linear(4, 4), args, seq_len=SEQ, device="cpu", budget="1GiB")
    with pytest.raises(WorkloadError, match="longer than this model's 512 positions"):
        fit_training_args(_maker("bert")[0](), args, seq_len=1024, device="cpu", budget="1GiB")
    with pytest.raises(PlanError, match="nothing fits in 4 MiB") as e:
        fit_training_args(make(), args, seq_len=SEQ, device="cpu", budget="4MiB")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="cannot allow lora for Trainer"):
        fit_training_args(make(), args, seq_len=SEQ, device="cpu", budget="1GiB", allow=("lora",))


def test_callback_sets_the_arguments_at_init_end_and_the_run_peaks_where_predicted(tmp_path):
    from memfit.integrations.transformers import MemfitCallback

    make, data = _maker("llama")
    args = _args(tmp_path, per_device_train_batch_size=16)
    callback = MemfitCallback(seq_len=SEQ, budget="24MiB", device="cpu")
    truth, trainer = trainer_peak(make, args, data, callbacks=[callback])
    ran = trainer.args
    assert ran.per_device_train_batch_size * ran.gradient_accumulation_steps == 16
    assert (ran.per_device_train_batch_size, ran.gradient_accumulation_steps) == (
        callback.plan.config.micro_batch, callback.plan.config.grad_accum)
    assert trainer.state.global_step == 3
    assert abs(callback.plan.peak_bytes - truth) <= SCALARS, (callback.plan.config.describe(), truth)


def _sft(tmp_path, **kw):
    """An SFTConfig as a user writes one for a CPU run: TRL's defaults kept (bf16, activation checkpointing,
    the fused LM head's "nll" loss), rows of SEQ tokens."""
    trl = pytest.importorskip("trl")
    base = dict(use_cpu=True, max_steps=3, report_to=[], save_strategy="no", logging_strategy="no",
                disable_tqdm=True, max_length=SEQ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return trl.SFTConfig(str(tmp_path), **{**base, **kw})


def _sft_data(vocab: int):
    """Tokenized rows of exactly SEQ tokens (SFTTrainer keeps them: it adds no EOS to tokenized rows, and they
    are within max_length), so every micro-batch is SEQ long as memfit's estimate assumes; and a word-level
    tokenizer made here (no download) that SFTTrainer reads only its pad and EOS tokens from."""
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")
    words = {"<pad>": 0, "<s>": 1, "</s>": 2}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<pad>")),
        pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    import torch

    ids = torch.randint(3, vocab, (64, SEQ), generator=torch.Generator().manual_seed(0))
    return datasets.Dataset.from_dict({"input_ids": ids.tolist()}), tokenizer


def test_estimate_is_the_peak_of_sft_trainer_train(tmp_path):
    """The other side of SFTTrainer's defaults: fp32, no checkpointing, the "dft" loss, accumulation."""
    trl = pytest.importorskip("trl")
    make, _ = _maker("llama")
    data, tokenizer = _sft_data(load_config("llama").vocab_size)
    args = _sft(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, bf16=False,
                activation_checkpointing=False, loss_type="dft")
    truth, trainer = trainer_peak(make, args, data, trainer_class=trl.SFTTrainer, processing_class=tokenizer)
    predicted = estimate_training_args(make(), args, seq_len=SEQ, device="cpu")
    assert trainer.state.global_step == 3
    assert abs(predicted.peak_bytes - truth) <= SCALARS, (predicted.peak_bytes, truth)


def test_fit_sft_config_keeps_the_global_batch_and_sft_trainer_peaks_where_predicted(tmp_path):
    """SFTTrainer's own step (TRL's fused LM head, its loss, its collator's attention mask) planned under a
    CPU budget that needs accumulation and checkpointing, then run by `trl.SFTTrainer(...).train()`."""
    trl = pytest.importorskip("trl")
    make, _ = _maker("llama")
    data, tokenizer = _sft_data(load_config("llama").vocab_size)
    user = _sft(tmp_path, per_device_train_batch_size=16)
    before = user.to_dict()
    args, plan = fit_training_args(make(), user, seq_len=SEQ, device="cpu", budget="36MiB")
    assert user.to_dict() == before and type(args) is trl.SFTConfig
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 16
    assert (args.optim, args.loss_type, args.max_length, args.bf16) == (user.optim, "nll", SEQ, True)
    assert args.gradient_accumulation_steps > 1 and args.gradient_checkpointing  # what 36 MiB needs here
    truth, trainer = trainer_peak(make, args, data, trainer_class=trl.SFTTrainer, processing_class=tokenizer)
    assert trainer.state.global_step == 3 and trainer.args.per_device_train_batch_size == plan.config.micro_batch
    assert abs(plan.peak_bytes - truth) <= SCALARS, (plan.config.describe(), plan.peak_bytes, truth)  # << 1%


def test_what_sft_trainer_runs_unmodelled_is_refused_in_one_line(tmp_path):
    make, _ = _maker("llama")
    for kw, words in [(dict(padding_free=True, max_length=None), "padding_free / packing"),
                      (dict(packing=True), "padding_free / packing"),
                      (dict(activation_offloading=True), "activation_offloading"),
                      (dict(gradient_checkpointing_kwargs={"selective": True}), "selective activation checkpointing")]:
        with pytest.raises(ConfigError, match=words) as e:
            fit_training_args(make(), _sft(tmp_path, **kw), seq_len=SEQ, device="cpu", budget="1GiB")
        assert "\n" not in str(e.value) and str(e.value).startswith("not modelled by memfit for SFTTrainer")
    with pytest.raises(ConfigError, match="mixtral, a Mixture-of-Experts model"):
        fit_training_args(load_config("mixtral"), _sft(tmp_path), seq_len=SEQ, device="cpu", budget="1GiB")
    with pytest.raises(ConfigError, match="seq_len=128 is longer than the SFTConfig's max_length=64"):
        fit_training_args(make(), _sft(tmp_path), seq_len=2 * SEQ, device="cpu", budget="1GiB")


def test_sft_trainer_on_a_gpu_traces_the_fused_heads_gpu_path(tmp_path):
    """For an H100, TRL's fused head scores only the labelled positions (every one of these rows: n = 4 x 63 =
    252) and its Triton kernels fold each logits tile in place, so at the step's peak, inside the head's
    backward on the one vocabulary tile (1,000 < 32,768), TRL's tensors live are, from its source by hand
    (hidden 128, bf16 autocast): the tile buffer min(n, 4,096) x 32,768 in bf16, the fp32 gradient
    accumulators of the head's weight and of the hidden states, the bf16 casts of the weight chunk and the
    hidden chunk; and what the forward saved: the labelled hidden states (fp32), their labels (int64), log Z
    and the entropy (fp32), the label mask. None of the fp32 tile-sized temporaries of the CPU's torch fold."""
    pytest.importorskip("trl")
    make, _ = _maker("llama")
    args = _sft(tmp_path, per_device_train_batch_size=4, activation_checkpointing=False)
    est = estimate_training_args(make(), args, seq_len=SEQ, device="h100")
    n, hidden, vocab = 4 * (SEQ - 1), 128, 1000
    by_hand = sorted([
        (n * 32768 * 2, (n, 32768), "bfloat16", "chunked_logprob.py", "backward"),  # mm_buf
        (vocab * hidden * 4, (vocab, hidden), "float32", "chunked_logprob.py", "backward"),  # grad_weight
        (vocab * hidden * 2, (vocab, hidden), "bfloat16", "chunked_logprob.py", "backward"),  # w_chunk
        (n * hidden * 4, (n, hidden), "float32", "chunked_logprob.py", "backward"),  # grad_hidden
        (n * hidden * 2, (n, hidden), "bfloat16", "chunked_logprob.py", "backward"),  # hidden_chunk
        (n * hidden * 4, (n, hidden), "float32", "utils.py", "_fused_forward"),  # hidden_states[mask]
        (n * 8, (n,), "int64", "utils.py", "_fused_forward"),  # labels[mask]
        (n * 4, (n,), "float32", "chunked_logprob.py", "forward"),  # log_z
        (n * 4, (n,), "float32", "chunked_logprob.py", "forward"),  # entropy
        (4 * (SEQ - 1), (4, SEQ - 1), "bool", "utils.py", "_fused_forward"),  # mask
    ])
    traced = sorted((t["bytes"], tuple(t["shape"]), t["dtype"], t["source"].split(":")[0].rsplit("/", 1)[-1],
                     t["source"].rsplit(" in ", 1)[-1]) for t in est.top_tensors if t["source"].startswith("trl/"))
    assert est.peak_phase == "backward" and traced == by_hand
    assert any("fused LM head traced on its GPU path" in note for note in est.notes)


def _fsdp(tmp_path, fsdp_config=None, **kw):
    """TrainingArguments for Trainer's FSDP2, as a user writes them for a run on several GPUs."""
    return _args(tmp_path, fsdp=True, fsdp_config={"version": 2, **(fsdp_config or {})}, **kw)


def test_fsdp_arguments_are_accelerates_fsdp2_traced_on_rank_0(tmp_path):
    """fsdp with fsdp_config version 2 over gpus=2, for an H100: the Config carries the ranks and memfit's nearest
    layout, and rank 0 holds half of every parameter and gradient in fp32 (every dim 0 of this Llama is even, so
    FSDP2's shards have no padding), the unsharded buffers, and fused AdamW's two moments of its half with a
    4-byte step per parameter."""
    make, _ = _maker("llama")
    model = make()
    full = sum(p.numel() for p in model.parameters()) * 4
    buffers = sum(b.nbytes for b in model.buffers())
    count = len(list(model.parameters()))
    for reshard, layout in ((True, "fsdp"), (False, "fsdp-no-reshard")):
        args = _fsdp(tmp_path, {"reshard_after_forward": reshard}, bf16=True, per_device_train_batch_size=4)
        assert config_of(args, gpus=2) == Config(micro_batch=4, precision="bf16", gpus=2, data_parallel=layout)
        est = estimate_training_args(model, args, seq_len=SEQ, device="h100", gpus=2)
        assert est.model_state_bytes == {Category.PARAMETERS: full // 2 + buffers, Category.GRADIENTS: full // 2,
                                         Category.OPTIMIZER_STATE: full + 4 * count}
        assert est.device_peak_bytes == est.peak_reserved_bytes + est.nccl_bytes + 500 * 2**20  # H100's context
        assert any("rank 0 of 2, Trainer's FSDP2 as Accelerate applies it" in n for n in est.notes)


def test_fsdp_estimate_is_trainers_own_fsdp2_step_on_two_gloo_ranks(tmp_path):
    """Trainer's FSDP2 `train()` on two real CPU ranks (gloo; Accelerate's distributed type set to FSDP, which it
    uses only on accelerators: benchmarks/integrations.py) against memfit's CPU trace of rank 0, with
    transformers' checkpointing and accumulation, the first micro-batch's fp32 gradients kept unsharded under
    Accelerate's no_sync (715 KB more than reducing them at once, as `sync_each_batch` would). A rank
    peaks above the prediction by at most one micro-batch (the copy CPU ranks make to the device 'cpu:0') and
    Trainer's 0-d tensors, never below it. gloo may still hold a finished collective's input (up to 900 KB seen,
    on one rank or the other): the ranks hold equal shards, so the lowest rank peak of up to 3 runs is compared,
    as tests/test_data_parallel.py does."""
    from integrations import fsdp_rank_peaks

    from memfit.integrations.transformers import _with_loader, trainer_workload
    from memfit.memory.devices import get_device

    make, data = _maker("llama")
    kw = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, activation_checkpointing=True,
              fsdp_config={"version": 2})
    args = _args(tmp_path, fsdp=True, **kw)
    predicted = _with_loader(trainer_workload(make(), args, seq_len=SEQ, gpus=2), config_of(args, 2),
                             get_device("cpu")).peak_bytes
    copy = 2 * 2 * SEQ * 8  # the micro-batch's int64 ids and labels
    lowest = min(fsdp_rank_peaks(make, kw, data, str(tmp_path)))
    for _ in range(2):
        if lowest - predicted <= copy + SCALARS:
            break
        lowest = min(lowest, *fsdp_rank_peaks(make, kw, data, str(tmp_path)))
    assert 0 <= lowest - predicted <= copy + SCALARS, (predicted, lowest)


def test_fsdp_that_is_not_modelled_is_one_clear_line(tmp_path):
    make, _ = _maker("llama")
    for args, gpus, words in [
        (_fsdp(tmp_path, {"version": 1}), 2, "use fsdp_config version 2"),
        (_fsdp(tmp_path, {"cpu_offload": True}), 2, "fsdp_config cpu_offload"),
        (_fsdp(tmp_path, {"activation_checkpointing": True}), 2, "fsdp_config activation_checkpointing"),
        (_fsdp(tmp_path, {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 1000}), 2, "auto_wrap_policy"),
        (_fsdp(tmp_path), None, "fsdp in one process: pass gpus="),
        (_args(tmp_path), 2, "2 processes or GPUs without FSDP"),
    ]:
        with pytest.raises(ConfigError, match=words) as e:
            fit_training_args(make(), args, seq_len=SEQ, device="h100", budget="20GiB", gpus=gpus)
        assert "\n" not in str(e.value) and str(e.value).startswith("not modelled by memfit for Trainer"), words
    with pytest.raises(ConfigError, match=r"fsdp on a CPU \(.*\), where Accelerate trains the processes with DDP"):
        estimate_training_args(make(), _fsdp(tmp_path), seq_len=SEQ, device="cpu", gpus=2)


def test_bitsandbytes_8bit_states_are_laid_out_as_under_trainer(tmp_path):
    """adamw_bnb_8bit (and its alias adamw_8bit) under Trainer for an H100, on the toy Llama (hidden 128, 2
    layers, vocabulary 1,000), bitsandbytes' layout written out by hand: the embedding, registered by Trainer
    for 32-bit states, and the five norms (128 elements, under min_8bit_size 4,096) keep two fp32 states each;
    every other matrix (each a multiple of 256 elements) two uint8 states of its size and two fp32 absmax values
    per 256 elements; the two 256-value fp32 quantization maps exist once. The fused update allocates nothing,
    so the optimizer phase adds nothing to the states."""
    make, _ = _maker("llama")
    embedding, norms = 1000 * 128, 5 * 128
    layer = 128 * 128 + 2 * 64 * 128 + 128 * 128 + 3 * 256 * 128  # attention q, k, v, o; MLP gate, up, down
    matrices = 1000 * 128 + 2 * layer  # the output head and both layers
    states = 2 * 4 * (embedding + norms) + 2 * matrices + 2 * 4 * (matrices // 256) + 2 * 256 * 4
    for optim in ("adamw_bnb_8bit", "adamw_8bit"):
        est = estimate_training_args(make(), _args(tmp_path, optim=optim), seq_len=SEQ, device="h100")
        assert est.model_state_bytes[Category.OPTIMIZER_STATE] == states, optim
        assert est.phase_peaks["optimizer"] < est.peak_bytes


def test_bitsandbytes_paged_states_are_unified_memory_outside_the_allocator(tmp_path):
    """The paged optimizers under Trainer for an H100, on the same toy Llama: bitsandbytes makes a state of a
    parameter of 100,000 elements or more with cudaMallocManaged, so here the embedding's and the output head's
    (128,000 elements each) leave PyTorch's allocator; every other state, and every absmax, stays. By hand:
    paged_adamw_8bit pages the embedding's two fp32 states (registered for 32 bits) and the head's two uint8
    ones; paged_adamw_32bit both matrices' two fp32 states (a 32-bit optimizer registers nothing, keeps no
    maps); paged_lion_8bit one state of each, one map. The allocator's peak is the unpaged optimizer's less
    exactly those bytes (each a multiple of 512); they are host memory, and the GPU's figure holds the largest
    parameter's on top of the reserved pool, prefetched for its update."""
    make, _ = _maker("llama")
    embedding, head, norms = 1000 * 128, 1000 * 128, 5 * 128
    layers = 2 * (128 * 128 + 2 * 64 * 128 + 128 * 128 + 3 * 256 * 128)
    small = layers + norms  # all under 100,000 elements: never paged

    def eight_bit(n, states):  # uint8 states and one fp32 absmax per 256 elements, each state
        return states * (n + 4 * (n // 256))

    cases = {  # optim: (the same unpaged, managed bytes, the largest parameter's, states in the allocator)
        "paged_adamw_8bit": ("adamw_bnb_8bit", 2 * 4 * embedding + 2 * head, 2 * 4 * embedding,
                             2 * 4 * norms + eight_bit(layers, 2) + 2 * 4 * (head // 256) + 2 * 256 * 4),
        "paged_adamw_32bit": (None, 2 * 4 * (embedding + head), 2 * 4 * embedding, 2 * 4 * small),
        "paged_lion_8bit": ("lion_8bit", 4 * embedding + head, 4 * embedding,
                            4 * norms + eight_bit(layers, 1) + 4 * (head // 256) + 256 * 4),
    }
    estimates = {optim: estimate_training_args(make(), _args(tmp_path, optim=optim), seq_len=SEQ, device="h100")
                 for optim in [*cases, "adamw_bnb_8bit", "lion_8bit"]}
    for optim, (unpaged, managed, largest, allocated) in cases.items():
        est = estimates[optim]
        assert est.model_state_bytes[Category.OPTIMIZER_STATE] == allocated, optim
        assert est.host_peak_bytes == managed, optim
        assert est.device_peak_bytes - est.peak_reserved_bytes == largest + (
            estimates["adamw_bnb_8bit"].device_peak_bytes - estimates["adamw_bnb_8bit"].peak_reserved_bytes), optim
        if unpaged is not None:
            assert est.peak_allocated_bytes == estimates[unpaged].peak_allocated_bytes - managed, optim
            assert estimates[unpaged].model_state_bytes[Category.OPTIMIZER_STATE] == allocated + managed, optim
        assert "CUDA unified memory" in est.notes[-2] and "not checked on a GPU" in est.notes[-2], optim


def test_fit_with_bitsandbytes_8bit_returns_arguments_whose_estimate_is_the_plans(tmp_path):
    """A plan for paged_adamw_8bit keeps bitsandbytes' layout and its paging in every estimate it makes (not
    memfit's own paged 8-bit states, which its Config's `optimizer_8bit` and `paged_optimizer` would otherwise
    select), so the arguments it returns estimate to its figure exactly, the prefetched state included; a plan
    that switched AdamW to 8 bits (`allow=("8bit-optim",)`) returns that optim."""
    from memfit.integrations.transformers import _arguments

    make, _ = _maker("llama")
    user = _args(tmp_path, optim="paged_adamw_8bit", per_device_train_batch_size=4, gradient_accumulation_steps=2)
    args, plan = fit_training_args(make(), user, seq_len=SEQ, device="h100", budget="600MiB")
    assert plan.config.optimizer_8bit and plan.config.paged_optimizer and args.optim == "paged_adamw_8bit"
    assert config_of(user) == Config(micro_batch=4, grad_accum=2, optimizer_8bit=True, paged_optimizer=True)
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 8
    assert estimate_training_args(make(), args, seq_len=SEQ, device="h100").device_peak_bytes == plan.peak_bytes
    switched = _arguments(Config(micro_batch=4, grad_accum=2, optimizer_8bit=True), _args(tmp_path))
    assert switched["optim"] == "adamw_bnb_8bit" and switched["per_device_train_batch_size"] == 4


def test_what_8bit_optimizers_trainer_runs_unmodelled_is_refused_in_one_line(tmp_path):
    make, _ = _maker("llama")
    cases = [(_args(tmp_path, optim="adamw_bnb_8bit"), "cpu", (), "on a CPU"),
             (_args(tmp_path, optim="paged_lion_32bit"), "cpu", (), "on a CPU"),
             (_fsdp(tmp_path, optim="paged_adamw_8bit"), "h100", (), "fsdp with bitsandbytes' optimizer states"),
             (_args(tmp_path), "cpu", ("8bit-optim",), "cannot allow 8bit-optim for Trainer on a CPU"),
             (_args(tmp_path, optim="sgd"), "h100", ("8bit-optim",), "cannot allow 8bit-optim for Trainer with optim"),
             (_args(tmp_path), "h100", ("paged-optim",), "cannot allow paged-optim for Trainer")]
    for args, device, allow, words in cases:
        with pytest.raises(ConfigError, match=words) as e:
            fit_training_args(make(), args, seq_len=SEQ, device=device, budget="20GiB", allow=allow, gpus=2 if args.fsdp
                              else None)
        assert "\n" not in str(e.value), words
