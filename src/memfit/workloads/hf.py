"""Hugging Face transformers models as memfit workloads, built from a config (never from weights).

transformers is an optional extra, so it is imported only inside the functions here: `import memfit`
must work without it.
"""
from __future__ import annotations

import contextlib
import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch

from memfit.workload import Workload, WorkloadError

MISSING = "transformers is not installed: pip install 'memfit[hf]'"

# Small shapes for the model types named on the command line (`hf:llama`): enough to have every kind of
# layer, small enough to train on a CPU in a test. A real model is described by its config.json.
SMALL_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1000, max_position_embeddings=2048),
    "qwen2": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1000, max_position_embeddings=2048),
    "gpt2": dict(n_embd=128, n_layer=2, n_head=4, vocab_size=1000, n_positions=1024, bos_token_id=0,
                 eos_token_id=0),
    "bert": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 vocab_size=1000, max_position_embeddings=512),
    "t5": dict(d_model=128, d_ff=256, d_kv=32, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=1000,
               pad_token_id=0, eos_token_id=1, decoder_start_token_id=0),
}
TASKS = ("causal", "masked", "seq2seq")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise WorkloadError(MISSING) from None
    return transformers


def load_config(config: Any):
    """A PretrainedConfig from an object, a local config.json (or the folder holding one), or a model_type."""
    transformers = _transformers()
    if isinstance(config, transformers.PretrainedConfig):
        return copy.deepcopy(config)
    if not isinstance(config, (str, Path)):
        raise WorkloadError(f"hf: expected a transformers config, a config.json path or a model type, "
                            f"got {type(config).__name__}")
    spec = str(config)
    path = Path(spec).expanduser()
    if spec in SMALL_CONFIGS and not path.exists():
        return transformers.AutoConfig.for_model(spec, **SMALL_CONFIGS[spec])
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise WorkloadError(f"hf: cannot read {path}: {e}") from e
        model_type = data.get("model_type") if isinstance(data, dict) else None
        if model_type not in transformers.CONFIG_MAPPING:
            raise WorkloadError(f"hf: {path} has model_type {model_type!r}, which this transformers "
                                f"({transformers.__version__}) does not know")
        try:
            return transformers.CONFIG_MAPPING[model_type].from_dict(data)
        except Exception as e:
            raise WorkloadError(f"hf: {path} is not a valid {model_type} config: {type(e).__name__}: {e}") from e
    if spec.endswith(".json") or "/" in spec or "\\" in spec:
        raise WorkloadError(f"hf: no such config file: {spec}")
    if spec in transformers.CONFIG_MAPPING:
        # A known architecture without built-in small sizes: its library defaults (often full size).
        return transformers.AutoConfig.for_model(spec)
    raise WorkloadError(f"hf: {spec!r} is neither a config.json path nor a model type; small built-in types: "
                        f"{', '.join(SMALL_CONFIGS)}")


@contextlib.contextmanager
def _rows_not_packed():
    """transformers checks whether a training batch packs several sequences per row by reading the
    position ids; on fake tensors it cannot read them, assumes packing, and builds a T x T mask that
    sends SDPA down a heavier path than the real run takes (+4.7% peak on a small Llama). The batches
    this adapter makes never pack rows, so answer that check for it."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def unpacked(position_ids):
        return None if type(position_ids).__name__ == "FakeTensor" else original(position_ids)

    masking.find_packed_sequence_indices = unpacked
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def pick_task(config) -> str:
    """Which head trains this architecture: seq2seq for encoder-decoders, masked LM for encoders
    (BERT-likes sit in both the masked and the causal tables), causal LM otherwise."""
    from transformers.models.auto import modeling_auto as ma

    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False) and model_type in ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return "seq2seq"
    if model_type in ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        return "masked"
    if model_type in ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "causal"
    if model_type in ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return "seq2seq"
    raise WorkloadError(f"hf: no language-model head for model_type {model_type!r} "
                        "(memfit builds causal, masked and seq2seq LMs)")


# Architectures with a learned table of absolute positions, which caps the sequence length. Rotary,
# relative (T5) and ALiBi models take any length: there only memory grows.
LEARNED_POSITIONS = frozenset({"gpt2", "gpt_neo", "opt", "gpt_bigcode", "biogpt", "bert", "albert", "distilbert",
                               "electra", "ernie", "megatron-bert", "bart", "mbart", "roberta", "xlm-roberta",
                               "camembert", "data2vec-text"})
ROBERTA_LIKE = frozenset({"roberta", "xlm-roberta", "camembert", "data2vec-text"})


def _max_positions(config) -> int | None:
    """The longest sequence the position table allows, or None where there is no such limit."""
    text = config.get_text_config()
    model_type = getattr(text, "model_type", None)
    if model_type not in LEARNED_POSITIONS:
        return None
    limit = getattr(text, "n_positions", None) or getattr(text, "max_position_embeddings", None)
    if limit and model_type in ROBERTA_LIKE:
        limit -= (getattr(text, "pad_token_id", None) or 0) + 1  # positions count from padding_idx + 1
    return limit


def from_config(config: Any, seq: int = 128, name: str | None = None, task: str | None = None,
                target_seq: int | None = None) -> Workload:
    """A training workload for a transformers architecture. `config` is a PretrainedConfig, a path to a
    local config.json, or a model type (`llama`, `gpt2`, `bert`, `t5` get small shapes). `task` forces
    the head (causal / masked / seq2seq); `target_seq` is the decoder length for seq2seq (default seq)."""
    transformers = _transformers()
    cfg = load_config(config)
    task = task or pick_task(cfg)
    if task not in TASKS:
        raise WorkloadError(f"hf: task must be one of {', '.join(TASKS)}, got {task!r}")
    try:
        seq = int(seq)
        target_seq = seq if target_seq is None else int(target_seq)
    except (TypeError, ValueError):
        raise WorkloadError(f"hf: seq and target_seq must be whole numbers, got {seq!r}, {target_seq!r}") from None
    if seq < 1 or target_seq < 1:
        raise WorkloadError("hf: seq and target_seq must be at least 1")
    limit = _max_positions(cfg)
    if limit is not None and max(seq, target_seq) > limit:
        raise WorkloadError(f"hf: seq {max(seq, target_seq)} is longer than this model's {limit} positions")
    vocab = getattr(cfg.get_text_config(), "vocab_size", None)
    if not vocab:
        raise WorkloadError(f"hf: the {cfg.model_type} config has no vocab_size")
    auto_cls = {"causal": transformers.AutoModelForCausalLM, "masked": transformers.AutoModelForMaskedLM,
                "seq2seq": transformers.AutoModelForSeq2SeqLM}[task]
    if hasattr(cfg, "use_cache"):
        cfg.use_cache = False  # training never reads a KV cache; building one would only hold memory
    if task == "seq2seq" and getattr(cfg, "decoder_start_token_id", None) is None:
        # Newer transformers keep it in the generation config, but the model shifts labels with it.
        pad = getattr(cfg, "pad_token_id", None)
        cfg.decoder_start_token_id = pad if pad is not None else 0

    def model() -> torch.nn.Module:
        # The default dtype, not config.json's torch_dtype: memfit decides precision, as with any model.
        dtype = torch.get_default_dtype()
        try:
            m = auto_cls.from_config(copy.deepcopy(cfg), attn_implementation="sdpa", dtype=dtype)
        except (ValueError, ImportError, NotImplementedError):
            m = auto_cls.from_config(copy.deepcopy(cfg), attn_implementation="eager", dtype=dtype)
        return m.train()

    def batch(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (n, seq))
        if task == "causal":
            # The model shifts labels itself; pretraining packs full rows, so no padding mask.
            return {"input_ids": ids, "labels": ids.clone()}
        # A mask of ones (no padding) also keeps transformers from peeking at token values for pad ids.
        mask = torch.ones(n, seq, dtype=torch.long)
        if task == "masked":
            chosen = torch.rand(n, seq) < 0.15
            chosen[:, 0] = True  # at least one target per row, or the mean loss would be 0/0
            return {"input_ids": ids, "attention_mask": mask,
                    "labels": torch.where(chosen, ids, torch.full_like(ids, -100))}
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, vocab, (n, target_seq))}

    def loss(m: torch.nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        with _rows_not_packed():
            return m(**b).loss

    def optimizer(params):
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)

    label = name or f"hf:{config if isinstance(config, (str, Path)) else cfg.model_type}"
    return Workload(model=model, batch=batch, loss=loss, optimizer=optimizer, name=label)
