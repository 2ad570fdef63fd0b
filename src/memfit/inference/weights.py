"""The bytes a serving engine loads for a model's weights: parameters counted on the meta device (no memory, no
tracing), in the checkpoint's dtype or a quantized layout, split over tensor-parallel ranks as vLLM splits them.

Quantized layouts (what vLLM's kernels keep, per weight of a Linear layer inside the decoder layers; embeddings,
the LM head, norms and MoE routers stay in the model dtype):
- fp8: 1 byte a weight and one fp32 scale per tensor (FP8 checkpoints, `--quantization fp8`);
- int8: 1 byte a weight and one fp32 scale per output channel (W8A8 int8, compressed-tensors);
- int4: 4-bit weights packed 8 to an int32, and per group of 128 input features an fp16 scale and a packed
  4-bit zero point per output channel (AWQ / GPTQ): 0.5 + 2.5/128 bytes a weight.
"""
from __future__ import annotations

import dataclasses

import torch

from memfit.errors import ConfigError
from memfit.inference.kv import dtype_bytes, head_size, model_dtype

QUANTIZATIONS = ("none", "fp8", "int8", "int4")
INT4_GROUP = 128


@dataclasses.dataclass
class Weights:
    bytes: int            # on one rank
    parameters: int       # the whole model's, tied weights once
    quantized: int        # of which stored in the quantized layout
    notes: list


def meta_model(config):
    """The causal LM a config describes, on the meta device."""
    import transformers

    with torch.device("meta"):
        try:
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        except Exception as e:  # noqa: BLE001 - the config's own fault, in one line
            raise ConfigError(f"{config.model_type}: transformers cannot build a causal LM from this config "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def _quantized_names(model) -> set[str]:
    """Parameters a weight-quantized checkpoint stores quantized: the Linear (and fused MoE expert) weights of
    the decoder layers, not their routers."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings()
    skip = embeddings | ({id(head.weight)} if head is not None else set())
    names = set()
    for module_name, module in model.named_modules():
        leaf = module_name.rsplit(".", 1)[-1]
        if leaf in ("gate", "router") or "layers." not in module_name + ".":
            continue
        for name, p in module.named_parameters(recurse=False):
            if id(p) not in skip and (isinstance(module, torch.nn.Linear) and name == "weight" or p.dim() >= 3):
                names.add(f"{module_name}.{name}")
    return names


def _quantized_bytes(p: torch.Tensor, quantization: str) -> int:
    out_features, in_features = p.shape[-2], p.shape[-1]
    rows = p.numel() // in_features  # output channels, over every expert
    if quantization == "fp8":
        return p.numel() + 4 * (p.numel() // (out_features * in_features))
    if quantization == "int8":
        return p.numel() + 4 * rows
    groups = -(-in_features // INT4_GROUP)
    return p.numel() // 2 + rows * groups * 2 + rows * groups // 2


def _kv_replication(config, tp: int) -> int:
    """How many times a rank's share of k_proj / v_proj is a plain 1/tp share: vLLM gives each rank whole KV
    heads, so with fewer KV heads than ranks each one is held by tp / kv_heads ranks."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return tp // heads if heads < tp else 1


def beside_text(config) -> tuple[int, str]:
    """Parameters a multimodal config's architecture holds beside its text model (Gemma 3's SigLIP vision tower and
    projector), counted on the meta device, with the architecture's name: vLLM loads the whole model the config's
    `architectures` names, the KV cache being the text model's only. (0, "") for a text-only config."""
    import transformers

    if config.get_text_config() is config:
        return 0, ""
    name = (getattr(config, "architectures", None) or [""])[0]
    cls = getattr(transformers, name, None) or transformers.AutoModelForImageTextToText
    with torch.device("meta"):
        try:
            model = cls._from_config(config, dtype=torch.bfloat16) if hasattr(cls, "_from_config") else \
                cls.from_config(config, dtype=torch.bfloat16)
        except Exception as e:  # noqa: BLE001 - the config's own fault, in one line
            raise ConfigError(f"{config.model_type}: transformers cannot build {name or 'the model'} from this config "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    count = sum(p.numel() for n, p in model.named_parameters() if "language_model" not in n and "lm_head" not in n)
    return count, name or type(model).__name__


def weight_bytes(config, quantization: str = "none", tp: int = 1, engine: str = "vllm", whole=None) -> Weights:
    """What loading the model takes on one of `tp` ranks. vLLM also keeps one rotary cos/sin table per model
    ([max_position_embeddings, rotary dim] in the model dtype: 32 MiB for Llama 3.1's 131,072 positions). `whole`,
    a multimodal config whose text model `config` is: its vision tower and projector too, in the model dtype
    (not quantized), their matrices split over the ranks."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"unknown quantization {quantization!r}; memfit knows {', '.join(QUANTIZATIONS)}")
    model = meta_model(config)
    element = dtype_bytes(model_dtype(config))
    quantized = _quantized_names(model) if quantization != "none" else set()
    replicated_kv = _kv_replication(config, tp)
    total = count = qcount = 0
    for name, p in model.named_parameters():  # tied weights are yielded once
        count += p.numel()
        nbytes = _quantized_bytes(p, quantization) if name in quantized else p.numel() * element
        qcount += p.numel() if name in quantized else 0
        if tp > 1 and p.dim() >= 2:  # Linear and embedding weights are split; norms are replicated
            share = nbytes / tp
            if name.endswith(("k_proj.weight", "v_proj.weight")):
                share *= replicated_kv
            nbytes = share
        total += nbytes
    notes = []
    if whole is not None:
        extra, name = beside_text(whole)
        if extra:
            total += extra * element / (tp if tp > 1 else 1)
            count += extra
            notes.append(f"{name}: {extra:,} parameters beside the text model (vision tower and projector), loaded "
                         "with it")
    if engine == "vllm" and (getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None)):
        width = getattr(config, "qk_rope_head_dim", None) or head_size(config)  # MLA rotates a part of each key
        rotary = int(getattr(config, "partial_rotary_factor", 1.0) * width)
        table = getattr(config, "max_position_embeddings", 0) * rotary * element
        total += table
        notes.append(f"vLLM's rotary cos/sin table: {table / 2**20:,.0f} MiB")
    if quantization != "none":
        notes.append(f"{quantization} weights: {qcount:,} of {count:,} parameters (the decoder layers' Linear weights)")
    return Weights(int(total), count, qcount, notes)
