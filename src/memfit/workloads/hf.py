"""Hugging Face transformers models as memfit workloads, built from a config (never from weights).

transformers is an optional extra, so it is imported only inside the functions here: `import memfit`
must work without it.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import torch

from memfit.losses import chunked_cross_entropy, loss_chunks
from memfit.torch_internals import DATA_DEPENDENT_ERRORS
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
    # Mixture-of-experts: 8 experts, top-2 (DeepSeek-V3: 2 groups of 4, one chosen; one dense layer first)
    "mixtral": dict(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=1000, max_position_embeddings=2048, num_local_experts=8,
                    num_experts_per_tok=2),
    "qwen2_moe": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                      shared_expert_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000, max_position_embeddings=2048, num_experts=8,
                      num_experts_per_tok=2),
    "qwen3_moe": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1000,
                      max_position_embeddings=2048, num_experts=8, num_experts_per_tok=2),
    "deepseek_v3": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, vocab_size=1000,
                        max_position_embeddings=2048, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                        topk_group=1, n_shared_experts=1, q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16,
                        qk_nope_head_dim=16, v_head_dim=32),
}
TASKS = ("causal", "masked", "seq2seq", "image", "contrastive", "classification", "image-text")
# Causal LMs whose loss assumes an image's tokens before the text (GIT drops that many logits): their
# batches carry images too.
IMAGE_PREFIXED = frozenset({"git"})
# Classifiers whose config names no input size: the ImageNet size they are trained at.
DEFAULT_IMAGE_SIZE = 224


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
    if HUB_ID.fullmatch(spec) and not spec.endswith(".json"):
        return load_config(_cached_hub_config(spec))
    if spec.endswith(".json") or "/" in spec or "\\" in spec:
        raise WorkloadError(f"hf: no such config file: {spec}")
    if spec in transformers.CONFIG_MAPPING:
        # A known architecture without built-in small sizes: its library defaults (often full size).
        return transformers.AutoConfig.for_model(spec)
    raise WorkloadError(f"hf: {spec!r} is neither a config.json path nor a model type; small built-in types: "
                        f"{', '.join(SMALL_CONFIGS)}")


# `org/name` as the Hub spells a model id (a relative path that exists on disk is read as a path first).
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def _cached_hub_config(repo_id: str) -> Path:
    """config.json of a Hub model from the local Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub), the
    revision `main` points at, else the cache's only snapshot. memfit never downloads: an estimate must not
    depend on the network, and this machine may have none."""
    from huggingface_hub import constants, try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(found, str):
        return Path(found)
    snapshots = sorted((Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "snapshots")
                       .glob("*/config.json"))
    if len(snapshots) == 1:
        return snapshots[0]
    raise WorkloadError(
        f"hf: {repo_id} is not a local path and its config.json is not in the Hugging Face cache "
        f"({constants.HF_HUB_CACHE}); memfit does not download (this machine may be offline): on a machine "
        f"online run `hf download {repo_id} config.json` (or set HF_HUB_CACHE to a cache holding it), or pass "
        f"the file itself: hf:path/to/config.json")


@contextlib.contextmanager
def masks_as_in_a_real_run():
    """transformers leaves out an attention mask where SDPA's causal flag, or no mask at all, does the same,
    after reading the padding mask, the position ids or the cache's offset; it does not read a fake tensor
    (`is_tracing`), and under memfit's trace it built masks the real run skips: a T x T mask for packed rows
    (+4.7% peak on a small Llama), BART's decoder causal mask, kept for backward by each layer's SDPA (+0.9%
    at seq 64, growing with seq). memfit's fake trace keeps the values of the batch, and of what is computed
    from it and from factories (`arange`), beside the fake tensors: here those checks read them as the real
    run does. A fake tensor whose values are not known still counts as tracing (the mask is built), and
    the batches this adapter makes never pack rows, so that check is answered for them."""
    masking = sys.modules.get("transformers.masking_utils")
    packed, tracing = (getattr(masking, name, None) for name in ("find_packed_sequence_indices", "is_tracing"))
    if packed is None or tracing is None:
        yield
        return

    def unpacked(position_ids):
        return None if type(position_ids).__name__ == "FakeTensor" else packed(position_ids)

    def values_unknown(tensor=None):
        if tensor is None or type(tensor).__name__ != "FakeTensor" or tracing():
            return tracing(tensor)
        try:
            bool(tensor.any())  # answered from the values the trace keeps beside it, or raises
            return False
        except DATA_DEPENDENT_ERRORS:
            return True

    masking.find_packed_sequence_indices, masking.is_tracing = unpacked, values_unknown
    try:
        yield
    finally:
        masking.find_packed_sequence_indices, masking.is_tracing = packed, tracing


def _task_tables() -> dict[str, dict]:
    """transformers' auto tables (model_type -> class name or names), one per head memfit trains."""
    from transformers.models.auto import modeling_auto as ma

    return {"causal": ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "masked": ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
            "seq2seq": ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
            "image": ma.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
            "contrastive": ma.MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES,
            "classification": ma.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
            "image-text": ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES}


def _class_names(entry) -> tuple[str, ...]:
    return entry if isinstance(entry, tuple) else (entry,)


def pick_task(config) -> str:
    """Which head trains this architecture. A config from the Hub names the class it was published as
    (`architectures`), and that class's head wins. Otherwise: seq2seq for encoder-decoders, masked LM for
    encoders (BERT-likes sit in both the masked and the causal tables), causal LM for decoders, image
    classification for vision models, contrastive image-text training for CLIP-likes outside that table.
    Sequence classification (fine-tuning an encoder on labels, a reward model) only where the config names
    such a class: nearly every text model type has that head too."""
    tables = _task_tables()
    for arch in getattr(config, "architectures", None) or ():
        for task, table in tables.items():
            if any(arch in _class_names(entry) for entry in table.values()):
                return task
    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False) and model_type in tables["seq2seq"]:
        return "seq2seq"
    if model_type in tables["masked"] and not getattr(config, "is_decoder", False):
        return "masked"
    for task in ("causal", "seq2seq", "image", "contrastive", "image-text"):
        if model_type in tables[task]:
            return task
    raise WorkloadError(f"hf: no training head for model_type {model_type!r} (memfit builds causal, masked and "
                        "seq2seq LMs, sequence and image classifiers and CLIP-style image-text models)")


# Architectures with a learned table of absolute positions, which caps the sequence length. Rotary,
# relative (T5) and ALiBi models take any length: there only memory grows.
LEARNED_POSITIONS = frozenset({"gpt2", "gpt_neo", "opt", "gpt_bigcode", "biogpt", "bert", "albert", "distilbert",
                               "electra", "ernie", "megatron-bert", "bart", "mbart", "roberta", "xlm-roberta",
                               "camembert", "data2vec-text", "perceiver"})
ROBERTA_LIKE = frozenset({"roberta", "xlm-roberta", "camembert", "data2vec-text"})


def _max_positions(text) -> int | None:
    """The longest sequence the text config's position table allows, or None where there is no such limit."""
    model_type = getattr(text, "model_type", None)
    if model_type not in LEARNED_POSITIONS:
        return None
    limit = getattr(text, "n_positions", None) or getattr(text, "max_position_embeddings", None)
    if limit and model_type in ROBERTA_LIKE:
        limit -= (getattr(text, "pad_token_id", None) or 0) + 1  # positions count from padding_idx + 1
    return limit


def from_config(config: Any, seq: int | None = None, name: str | None = None, task: str | None = None,
                target_seq: int | None = None, image_size: int | None = None) -> Workload:
    """A training workload for a transformers architecture. `config` is a PretrainedConfig, a path to a
    local config.json, a Hub id whose config.json is in the local cache, or a model type (`llama`, `gpt2`,
    `bert`, `t5` get small shapes). `task` forces the head: causal / masked / seq2seq / image /
    contrastive / classification (one label per sequence; a score where the config has one label) /
    image-text (a vision-language model: one image per row, its tokens in place, the text after them).
    `seq` is the token length (default 128; for contrastive models the text model's positions, 77 for
    CLIP; image-text rows include the image's tokens), `target_seq` the decoder length for seq2seq
    (default seq), `image_size` the side of the images (default the config's, else 224)."""
    _transformers()  # one clear line first where transformers is not installed
    cfg = load_config(config)
    task = task or pick_task(cfg)
    if task not in TASKS:
        raise WorkloadError(f"hf: task must be one of {', '.join(TASKS)}, got {task!r}")
    if cfg.model_type not in _task_tables()[task]:
        raise WorkloadError(f"hf: transformers has no {task} head for model_type {cfg.model_type!r}")
    try:
        text = cfg.get_text_config()
    except ValueError as e:  # several text models (MusicGen: a text encoder and an audio-code decoder)
        raise WorkloadError(f"hf: {cfg.model_type} has no single text model for memfit's token batches: {e}") from None
    seq, target_seq, image_size = _lengths(cfg, text, task, seq, target_seq, image_size)
    vocab = getattr(text, "vocab_size", None)
    if not vocab and task != "image":
        raise WorkloadError(f"hf: the {cfg.model_type} config has no vocab_size")
    _ready_to_train(cfg, task)
    eos = _eos_id(cfg, vocab)
    with_images = task in ("image", "contrastive") or cfg.model_type in IMAGE_PREFIXED
    takes = inspect.signature(_model_class(cfg, task).forward).parameters if task != "image" else {}
    images = _image_batch(cfg, task, image_size, seq) if with_images else None
    # Perceiver's masked-LM decoder predicts all max_position_embeddings positions, whatever the input length.
    outputs = cfg.max_position_embeddings if task == "masked" and cfg.model_type == "perceiver" else seq

    model = _builder(cfg, task)
    vision = _image_text_batch(cfg, model, image_size, seq, takes) if task == "image-text" else None

    def batch(n: int) -> dict[str, torch.Tensor]:
        if task == "image":
            return images(n)
        # Full rows, no padding, so no attention mask: transformers skips a mask of all ones after reading
        # it, which it cannot do on fake tensors, and would build a T x T mask the real step never makes.
        ids = torch.randint(0, vocab, (n, seq))
        extra = {}
        if "lengths" in takes:  # XLM-likes count each row's non-padding tokens and assert on the count: rows are full
            extra["lengths"] = torch.full((n,), seq, dtype=torch.long)
        if "lang_ids" in takes:  # X-MOD routes each row through its language's adapters: the config's first
            extra["lang_ids"] = torch.zeros(n, dtype=torch.long)
        return {**text_batch(ids), **extra}

    def text_batch(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        n = len(ids)
        if task == "contrastive":
            return {"input_ids": ids, **images(n)}
        if task == "image-text":
            return vision(ids)
        if task == "causal":
            text = {"input_ids": ids, "labels": ids.clone()}  # the model shifts labels itself
            return {**text, **images(n)} if images else text
        if task == "classification":  # a class per row; one label is a score (regression), as a reward model's
            if eos is not None:  # rows end as tokenized text does: BART-likes and T5 classify at the <eos>
                ids = torch.where(ids == eos, (eos + 1) % vocab, ids)
                ids[:, -1] = eos
            labels = torch.randn(n) if cfg.num_labels == 1 else torch.randint(0, cfg.num_labels, (n,))
            return {"input_ids": ids, "labels": labels}
        if task == "masked":
            chosen = torch.rand(n, seq) < 0.15
            chosen[:, 0] = True  # at least one target per row, or the mean loss would be 0/0
            labels = torch.where(chosen, ids, torch.full_like(ids, -100))
            if outputs > seq:  # positions past the input are no one's target
                labels = torch.cat([labels, torch.full((n, outputs - seq), -100)], dim=1)
            return {"input_ids": ids, "labels": labels}
        labels = torch.randint(0, vocab, (n, target_seq))
        if "decoder_input_ids" not in takes:
            return {"input_ids": ids, "labels": labels}
        # The labels shifted right, as seq2seq data collators give them: models that shift labels themselves
        # check the values as they do (ProphetNet asserts that none is negative), which fake tensors cannot.
        start = torch.full((n, 1), cfg.decoder_start_token_id, dtype=labels.dtype)
        return {"input_ids": ids, "labels": labels, "decoder_input_ids": torch.cat([start, labels[:, :-1]], dim=1)}

    def loss(m: torch.nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        if task == "causal" and loss_chunks() > 1:  # the model's own loss would make all the logits
            rest = {k: v for k, v in b.items() if k != "labels"}
            with masks_as_in_a_real_run():
                return chunked_cross_entropy(lambda: m(**rest), m.get_output_embeddings(), b["labels"],
                                             logits=lambda out: out.logits, shift=True)
        if task == "image-text" and "image_grid_thw" in b:  # kept per row: the model takes all images' patch rows
            b = {**b, "pixel_values": b["pixel_values"].flatten(0, 1)}
        with masks_as_in_a_real_run():
            out = m(**b, return_loss=True) if task == "contrastive" else m(**b)
        if getattr(out, "loss", None) is None:
            raise WorkloadError(f"hf: {type(m).__name__} returns no loss to train")
        return out.loss

    def optimizer(params):
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)

    label = name or f"hf:{config if isinstance(config, (str, Path)) else cfg.model_type}"
    return Workload(model=model, batch=batch, loss=loss, optimizer=optimizer, name=label)


def _builder(cfg, task: str):
    """The model factory: `task`'s auto class from `cfg`, with SDPA attention where the model has it."""
    transformers = _transformers()
    auto_cls = {"causal": transformers.AutoModelForCausalLM, "masked": transformers.AutoModelForMaskedLM,
                "seq2seq": transformers.AutoModelForSeq2SeqLM, "image": transformers.AutoModelForImageClassification,
                "contrastive": transformers.AutoModelForZeroShotImageClassification,
                "classification": transformers.AutoModelForSequenceClassification,
                "image-text": transformers.AutoModelForImageTextToText}[task]

    def model() -> torch.nn.Module:
        # The default dtype, not config.json's torch_dtype: memfit decides precision, as with any model.
        dtype = torch.get_default_dtype()
        try:
            m = auto_cls.from_config(copy.deepcopy(cfg), attn_implementation="sdpa", dtype=dtype)
        except (ValueError, ImportError, NotImplementedError):
            m = auto_cls.from_config(copy.deepcopy(cfg), attn_implementation="eager", dtype=dtype)
        return m.train()

    def with_blocks(keep: int) -> torch.nn.Module | None:
        """The model built with its first `keep` layers only, from `cfg` with that many (lists of one entry per
        layer cut to match): the planner's shallow copies, without building the layers it would cut. None
        where the config counts its layers otherwise."""
        count = getattr(cfg, "num_hidden_layers", None)
        if not isinstance(count, int) or cfg.get_text_config() is not cfg or keep >= count:
            return None
        fewer = copy.deepcopy(cfg)
        fewer.num_hidden_layers = keep
        for key, value in vars(fewer).items():
            if isinstance(value, list) and len(value) == count:
                setattr(fewer, key, value[:keep])
        return _builder(fewer, task)()

    model.with_blocks = with_blocks
    return model


def _lengths(cfg, text, task: str, seq, target_seq, image_size) -> tuple[int, int, int | None]:
    """`from_config`'s lengths checked against the model: its default sequence length where none is given, whole
    numbers of at least 1, within its positions (Reformer's axial embeddings: exactly their product)."""
    limit = _max_positions(text)
    if task == "contrastive":
        limit = getattr(text, "max_position_embeddings", None)
    # Reformer's axial position embeddings factor the sequence: training runs only at their product.
    axial = math.prod(cfg.axial_pos_shape) if getattr(cfg, "axial_pos_embds", False) else None
    if seq is None:
        seq = axial or (min(128, limit) if task == "contrastive" and limit else 128)
        if task == "image" and _input_name(cfg, task) == "input_ids":  # ImageGPT: one token per pixel
            seq = getattr(cfg, "n_positions", None) or seq
    try:
        seq = int(seq)
        target_seq = seq if target_seq is None else int(target_seq)
        image_size = None if image_size is None else int(image_size)
    except (TypeError, ValueError):
        raise WorkloadError(f"hf: seq, target_seq and image_size must be whole numbers, got {seq!r}, "
                            f"{target_seq!r}, {image_size!r}") from None
    if seq < 1 or target_seq < 1 or (image_size is not None and image_size < 1):
        raise WorkloadError("hf: seq, target_seq and image_size must be at least 1")
    if axial and seq != axial:
        raise WorkloadError(f"hf: {cfg.model_type} trains only at seq {axial}, the product of its config's "
                            f"axial_pos_shape {tuple(cfg.axial_pos_shape)}")
    if limit is not None and max(seq, target_seq) > limit and task != "image":
        raise WorkloadError(f"hf: seq {max(seq, target_seq)} is longer than this model's {limit} positions")
    return seq, target_seq, image_size


def _ready_to_train(cfg, task: str) -> None:
    """Settings the config needs for a training step of `task`, set in place where it lacks them."""
    if hasattr(cfg, "use_cache"):
        cfg.use_cache = False  # training never reads a KV cache; building one would only hold memory
    encoder_decoder = task == "seq2seq" or getattr(cfg, "is_encoder_decoder", False)  # T5 classifies via its decoder
    if encoder_decoder and getattr(cfg, "decoder_start_token_id", None) is None:
        # Newer transformers keep it in the generation config, but the model shifts labels with it.
        pad = getattr(cfg, "pad_token_id", None)
        cfg.decoder_start_token_id = pad if pad is not None else 0
    if task in ("seq2seq", "classification") and getattr(cfg, "pad_token_id", None) is None:
        # seq2seq: shifting labels right needs one (it replaces -100s, which these labels lack); a decoder
        # classifies a row at its last token before padding and refuses a batch without a padding id
        cfg.pad_token_id = 0
    if not getattr(cfg, "architectures", None):
        # Where one model type has several classes for a head (DeiT, LeViT), transformers picks by this list
        # and fails without one; the table's first class is the one it would build.
        cfg.architectures = [_class_names(_task_tables()[task][cfg.model_type])[0]]


def _eos_id(cfg, vocab) -> int | None:
    """The config's end-of-sequence token where it is one id inside the vocabulary (a classifier reads there)."""
    eos = getattr(cfg, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    return eos if isinstance(eos, int) and 0 <= eos < (vocab or 0) else None


def _model_class(cfg, task: str):
    """The class transformers builds for this head (the table's first where it names several), or None."""
    return getattr(_transformers(), _class_names(_task_tables()[task][cfg.model_type])[0], None)


def _input_name(cfg, task: str) -> str:
    """The model's main input (`pixel_values` for most vision models; ImageGPT reads pixel tokens)."""
    return getattr(_model_class(cfg, task), "main_input_name", "pixel_values")


def _image_batch(cfg, task: str, image_size: int | None, seq: int):
    """A factory of n images at the model's input size (the vision config's for image-text models) and,
    for classifiers, one class label each."""
    vision = getattr(cfg, "vision_config", None) or cfg
    size = image_size or getattr(vision, "image_size", None) or DEFAULT_IMAGE_SIZE
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    channels = getattr(vision, "num_channels", None) or 3
    key = "pixel_values" if task != "image" else _input_name(cfg, task)
    if key == "input_ids" and not getattr(cfg, "vocab_size", None):  # ShieldGemma 2: a prompt around the image
        raise WorkloadError(f"hf: {cfg.model_type} classifies images from a text prompt with image tokens, "
                            "which memfit's image batches do not make")
    labels = cfg.num_labels
    model_class = _model_class(cfg, task)
    # NaFlex models (SigLIP 2) read an image as its sequence of flattened patches, padded to num_patches, with
    # the grid each image was cut into: here every image fills a square grid of them, so no padding and no
    # mask (as text rows are full: a mask of all ones is skipped after reading it, not on fake tensors)
    patches = getattr(vision, "num_patches", None) \
        if model_class is not None and "spatial_shapes" in inspect.signature(model_class.forward).parameters else None
    if patches is not None and math.isqrt(patches) ** 2 != patches:
        raise WorkloadError(f"hf: {cfg.model_type} takes images as {patches} patches, not a square grid of them")

    def images(n: int) -> dict[str, torch.Tensor]:
        if key == "input_ids":
            inputs = {key: torch.randint(0, cfg.vocab_size, (n, seq))}
        elif patches is not None:
            inputs = {key: torch.randn(n, patches, channels * vision.patch_size ** 2),
                      "spatial_shapes": torch.full((n, 2), math.isqrt(patches), dtype=torch.long)}
        else:
            inputs = {key: torch.randn(n, channels, height, width)}
        if task != "image":
            return inputs
        return {**inputs, "labels": torch.randint(0, labels, (n,))}

    return images


def _image_text_batch(cfg, build, image_size: int | None, seq: int, takes):
    """For a vision-language model: `ids -> batch`, one image per row. The image's placeholder tokens sit
    after the row's first token, as many as the vision tower gives features for one image (counted by
    running it on the meta device: projectors pool, crop or merge patches in ways no config field says),
    and are left out of the loss, as chat templates and collators leave them. Input layouts:
    - pixel_values (n, C, H, W) (LLaVA, PaliGemma, Gemma 3, InternVL, ...), with each image's size where
      the vision tower needs it;
    - "anyres" (LLaVA-NeXT, OneVision): (n, tiles, C, H, W), the whole image and its tiles, with its size;
    - Idefics 2/3, SmolVLM: (n, 1, C, H, W) with a mask of real pixels; tokens per image are the model's
      own `image_seq_len` (their towers read pixel values, which the meta device has not); Granite Docling
      the same with a mask of real tiles, (n, 1), as its processor makes;
    - Qwen2-VL's rows of flattened patches with each image's (t, h, w) grid, kept per row in the batch (so
      it splits into micro-batches) and joined in the loss; there an image is t*h*w / merge**2 tokens, by
      the layout's definition (its vision tower reads the grid's values)."""
    vision = getattr(cfg, "vision_config", None) or cfg
    token = getattr(cfg, "image_token_id", None)
    token = getattr(cfg, "image_token_index", None) if token is None else token
    if not isinstance(token, int):
        raise WorkloadError(f"hf: {cfg.model_type} names no image token id, which memfit's image-text batches need")
    channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", None) or 3
    grid = "image_grid_thw" in takes
    if grid:  # Qwen2-VL: patch_size x patch_size x temporal_patch_size patches, merged merge x merge into a token
        patch, merge = vision.patch_size, getattr(vision, "spatial_merge_size", 1)
        temporal = getattr(vision, "temporal_patch_size", 1)
        side = max(merge, round((image_size or DEFAULT_IMAGE_SIZE) / patch / merge) * merge)  # patches per side
        pixels = torch.empty(1, side * side, channels * temporal * patch * patch)
        extra = {"image_grid_thw": torch.tensor([[1, side, side]])}
        count = side * side // (merge * merge)
    elif "pixel_attention_mask" in takes and isinstance(getattr(vision, "image_size", None), int):
        # Idefics 2/3, SmolVLM: (n, images, C, H, W), which pixels are real
        tile = vision.image_size
        if image_size is not None and _sides(image_size) != _sides(tile):
            raise WorkloadError(f"hf: {cfg.model_type} takes images at its vision tower's size ({tile}); its processor "
                                "splits larger ones into several, which memfit's image-text batches do not make")
        height, width = _sides(tile)
        pixels = torch.empty(1, 1, channels, height, width)
        # which pixels are real (Idefics), or which tiles (Granite Docling), as the model's processor makes it
        mask = (1, 1) if _processor_mask_rank(cfg, height, width) == 2 else (1, 1, height, width)
        extra = {"pixel_attention_mask": torch.ones(mask, dtype=torch.bool)}
        count = _declared_image_tokens(build, cfg.model_type)
    elif (tiles := _anyres_tiles(cfg)) is not None:  # LLaVA-NeXT, OneVision: the image and its tiles
        tile = vision.image_size
        height, width = _sides(image_size or tile)
        pixels = torch.empty(1, tiles(height, width), channels, tile, tile)
        extra = {"image_sizes": torch.tensor([[height, width]])}
        count = _image_tokens(build, pixels, extra, cfg.model_type)
    else:
        height, width = _sides(image_size or getattr(vision, "image_size", None) or DEFAULT_IMAGE_SIZE)
        pixels = torch.empty(1, channels, height, width)
        sizes = {"image_sizes": torch.tensor([[height, width]])} if "image_sizes" in takes else {}
        try:  # without sizes first: LLaVA takes them but, given them, splits features as Pixtral's images
            count, extra = _image_tokens(build, pixels, {}, cfg.model_type), {}
        except WorkloadError:
            if not sizes:
                raise
            try:
                count, extra = _image_tokens(build, pixels, sizes, cfg.model_type), sizes
            except WorkloadError:
                merge, patch = getattr(cfg, "spatial_merge_size", None), getattr(vision, "patch_size", None)
                if not (isinstance(merge, int) and isinstance(patch, int)):
                    raise
                # Mistral 3: the tower's patches merged merge x merge, its features split per image by this
                # rule, which reads the sizes' values (the meta device has none)
                side = patch * merge
                count, extra = (height // side) * (width // side), sizes
    start, end = getattr(cfg, "vision_start_token_id", None), getattr(cfg, "vision_end_token_id", None)
    marks = [t for t in (start, end) if isinstance(t, int)]
    if count + len(marks) + 1 > seq:
        raise WorkloadError(f"hf: {cfg.model_type} puts {count} tokens per image; seq {seq} leaves no text after them")
    special = torch.tensor([token, *marks])

    def batch(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        n = len(ids)
        ids = torch.where(torch.isin(ids, special), 0, ids)  # text tokens only, then the image's in place
        first = 1
        if start is not None:
            ids[:, first] = start
            first += 1
        ids[:, first:first + count] = token
        if end is not None:
            ids[:, first + count] = end
        labels = torch.where(ids == token, -100, ids)
        out = {"input_ids": ids, "labels": labels, "pixel_values": torch.randn(n, *pixels.shape[1:])}
        if "mm_token_type_ids" in takes:  # as processors make it: 1 marks an image's tokens (M-RoPE reads it)
            out["mm_token_type_ids"] = (ids == token).int()
        return {**out, **{k: v.expand(n, *v.shape[1:]).clone() for k, v in extra.items()}}

    return batch


def _sides(size) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else tuple(size)


def _anyres_tiles(cfg):
    """For "anyres" models (a config with `image_grid_pinpoints`): `(height, width) -> tiles` an image
    becomes, the whole image at the vision tower's size included, by the model's own
    `image_size_to_num_patches` (resized to the best of the pinpoints, then cut). None for other models."""
    pinpoints = getattr(cfg, "image_grid_pinpoints", None)
    module = sys.modules.get(getattr(_model_class(cfg, "image-text"), "__module__", ""))
    count = getattr(module, "image_size_to_num_patches", None)
    if not pinpoints or count is None:
        return None
    return lambda height, width: int(count((height, width), pinpoints, cfg.vision_config.image_size))


def _processor_mask_rank(cfg, height: int, width: int) -> int | None:
    """The rank of the `pixel_attention_mask` the model's own image processor makes for one image at the
    tower's size: 4 for Idefics' mask of pixels, 2 for Granite Docling's mask of tiles. The models' code
    and docstrings do not say which; their processors do. None where no processor can be made."""
    names = _transformers().models.auto.image_processing_auto.IMAGE_PROCESSOR_MAPPING_NAMES.get(cfg.model_type)
    name = names.get("pil") if isinstance(names, dict) else None
    processor = getattr(_transformers(), name, None) if name else None
    if processor is None:
        return None
    try:
        import numpy

        image = numpy.zeros((height, width, 3), dtype=numpy.uint8)
        return processor()(images=[image], return_tensors="pt")["pixel_attention_mask"].dim()
    except Exception:  # noqa: BLE001 - no processor to ask: Idefics' layout, as before
        return None


def _declared_image_tokens(build, model_type: str) -> int:
    """Tokens per image where the model states them (`image_seq_len`: Idefics 2's resampler latents,
    Idefics 3's and SmolVLM's patches pixel-shuffled by scale_factor): their vision towers skip images that
    are all zeros and mask padded pixels, values the meta device has not, so they cannot be counted there."""
    model = _meta_model(build, model_type)
    for m in model.modules():
        count = getattr(m, "image_seq_len", None)
        if isinstance(count, int):
            return count
    raise WorkloadError(f"hf: {model_type} states no image_seq_len, which memfit's image-text batches need to "
                        "place an image's tokens")


def _meta_model(build, model_type: str) -> torch.nn.Module:
    with torch.device("meta"):
        try:
            return build()
        except Exception as e:  # noqa: BLE001 - the config's own fault, said in one line
            raise WorkloadError(f"hf: the {model_type} config does not build: {type(e).__name__}: {e}") from None


def _image_tokens(build, pixels: torch.Tensor, extra: dict, model_type: str) -> int:
    """How many features the model's vision side makes of one image: its `get_image_features` run on the
    meta device (no memory, no values)."""
    model = _meta_model(build, model_type)
    try:
        with torch.device("meta"):
            features = model.get_image_features(pixel_values=pixels.to("meta"), **extra)
    except Exception as e:  # noqa: BLE001 - said in one line: the layout is not one memfit makes
        raise WorkloadError(f"hf: could not count {model_type}'s tokens per image from its vision tower on the meta "
                            f"device ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); its inputs "
                            "may need a layout memfit's image-text batches do not make") from None
    features = getattr(features, "pooler_output", features)
    if isinstance(features, torch.Tensor):
        features = [features] if features.dim() == 2 else list(features)
    return sum(f.shape[0] if f.dim() == 2 else f.shape[0] * f.shape[1] for f in features)
