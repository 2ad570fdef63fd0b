"""Tensor parallelism: each block's attention and MLP matmuls split over `config.tp` ranks (DTensor).

The plan is torchtitan's Llama plan with sequence parallelism, applied with DTensor's `parallelize_module`
on the tp axis of the run's mesh (data_parallel.device_mesh: the tp ranks alone, or groups of neighbouring
ranks that FSDP2 then shards across, torchtitan's 2-D layout):

- attention q/k/v and MLP gate/up: `ColwiseParallel` (each rank computes its own heads / its own slice of the
  hidden width); attention output and MLP down: `RowwiseParallel`, their partial sums reduce-scattered over
  the sequence (`Shard(1)`);
- the norms (inside the blocks and the final one): `SequenceParallel`, each rank normalising its own
  positions; the inputs of attention and MLP are all-gathered back to whole sequences (`PrepareModuleInput`
  from `Shard(1)` to `Replicate()`);
- the token embedding: `RowwiseParallel` (its rows of the vocabulary), output sequence-sharded;
- the LM head: `ColwiseParallel` from the sequence-sharded final norm to `Replicate()` logits: every rank
  holds the whole logits and computes the workload's own loss on them (not `loss_parallel`, which would
  need the workload's loss written for sharded logits; whole logits cost vocab x tokens a rank).

Between blocks the hidden states stay DTensors (sequence-sharded): a model that reads the sequence length
off its embeddings (transformers' position ids and causal mask) sees the global one.

Which Linear is which comes from transformers' own `base_model_tp_plan` for its models, and from
`GPT_PLAN` below for memfit's GPT; the embedding, head and norms are found on the model. Each rank's
attention must reshape with the local head count: the model's head-count attributes are set to it, and a
forward that reads the global count from its config is refused rather than computing wrong math.
"""
from __future__ import annotations

import ast
import fnmatch
import inspect
import re
import textwrap

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from memfit.config import Config
from memfit.errors import ConfigError
from memfit.strategies.activation_checkpoint import find_blocks

__all__ = ["GPT_PLAN", "apply_tensor_parallel", "tensor_parallel_plan"]

# memfit's GPT (workloads/gpt.py), in transformers' spelling: which Linear splits by output, which by input
GPT_PLAN = {"layers.*.attn.q_proj": "colwise", "layers.*.attn.k_proj": "colwise", "layers.*.attn.v_proj": "colwise",
            "layers.*.attn.o_proj": "rowwise", "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
            "layers.*.mlp.down_proj": "rowwise"}

# attributes an attention module may reshape with; each is set to its per-rank share
HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_heads", "n_kv_heads",
               "heads", "kv_heads")
# a forward reading a global head count or width that memfit cannot make local (a config is shared)
_GLOBAL_READ = re.compile(r"\bconfig\.(num_attention_heads|num_key_value_heads|hidden_size|n_head|n_embd)\b|"
                          r"\bself\.(hidden_size|embed_dim|all_head_size)\b")


def apply_tensor_parallel(model: torch.nn.Module, config: Config, device: torch.device,
                          blocks: list[str] | None = None) -> torch.nn.Module:
    """Split `model` in place over the tp ranks of the default process group (TP comes first, before
    precision, checkpointing and data parallelism, as torchtitan orders them); unchanged for tp 1. `blocks`:
    a pipeline stage's own blocks (the stage may hold one, which `find_blocks` cannot tell from the rest)."""
    if config.tp == 1:
        return model
    from torch.distributed.tensor.parallel import parallelize_module  # imported when used

    styles = tensor_parallel_plan(model, config.tp, blocks)
    parallelize_module(model, _mesh(config, device), styles)
    return model


def _mesh(config: Config, device: torch.device) -> DeviceMesh:
    """The tp axis of the run's mesh (data_parallel.device_mesh, built once and shared with FSDP2): the 1-D
    mesh of the tp ranks alone, or the inner axis of (shard, tp) beside FSDP2."""
    from memfit.strategies.data_parallel import mesh_axis

    if not dist.is_initialized() or dist.get_world_size() != config.world:
        have = dist.get_world_size() if dist.is_initialized() else "no"
        raise ConfigError(f"tensor parallel over {config.tp} ranks needs a process group of {config.world} ranks "
                          f"({have} here): launch with torchrun or `memfit train --gpus {config.world} --tp {config.tp}`")
    return mesh_axis(config, device, "tp")


def tensor_parallel_plan(model: torch.nn.Module, tp: int, blocks: list[str] | None = None) -> dict:
    """{module name: DTensor ParallelStyle} for `model` over `tp` ranks, after every check: a model that
    cannot be split leaves with a ConfigError and untouched. Head-count attributes are made local here.
    `blocks`: a pipeline stage's own blocks; such a stage may lack the embedding (after the first stage) or
    the final norm and head (before the last), which stand-ins hold the place of and the plan leaves out."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    what = type(model).__name__
    matmuls, base = _matmul_plan(model)
    modules = dict(model.named_modules())
    blocks = find_blocks(model) if blocks is None else blocks
    names = {}
    for pattern, kind in matmuls.items():
        found = [n for n in modules if n.startswith(base) and fnmatch.fnmatchcase(n[len(base):], pattern)]
        if not found:
            raise ConfigError(f"tensor parallel: {what} has no module {pattern!r} that its plan names")
        if kind not in ("colwise", "rowwise"):
            raise ConfigError(f"tensor parallel: {what}'s plan splits {pattern!r} as {kind!r}, which memfit does not "
                              "apply yet (colwise and rowwise only)")
        names.update(dict.fromkeys(found, kind))
    for name, kind in names.items():
        linear = modules[name]
        if not isinstance(linear, torch.nn.Linear):
            raise ConfigError(f"tensor parallel: {name} is a {type(linear).__name__}, not a Linear")
        width = linear.out_features if kind == "colwise" else linear.in_features
        if width % tp:
            raise ConfigError(f"tensor parallel: {name}'s {width} {'output' if kind == 'colwise' else 'input'} "
                              f"features do not split over {tp} ranks")
        head_dim = getattr(modules[name.rsplit(".", 1)[0]], "head_dim", None)  # an attention's projection
        if isinstance(head_dim, int) and (width % head_dim or width // head_dim % tp):
            raise ConfigError(f"tensor parallel: {name}'s {width // head_dim} heads of {head_dim} do not split over "
                              f"{tp} ranks")
    embedding, head = _ends(model, modules, tp)
    final_norms = [n for n, m in (modules[base.rstrip(".")] if base else model).named_children() if _is_norm(m)]
    if not final_norms and head is None:  # a pipeline stage before the last: its final norm is elsewhere
        final_norms = [None]
    if len(final_norms) != 1:
        raise ConfigError(f"tensor parallel: found {len(final_norms)} norms after {what}'s blocks, not one")
    inner = {name.rsplit(".", 1)[0] for name in names}  # the attention and MLP modules
    for parent in inner:
        if not any(parent.startswith(b + ".") for b in blocks):
            raise ConfigError(f"tensor parallel: {parent} is not inside one of {what}'s repeated blocks")
    local = {parent: _local_heads(modules[parent], parent, tp) for parent in inner}

    seq, whole = Shard(1), Replicate()
    styles = {name: ColwiseParallel() if kind == "colwise" else RowwiseParallel(output_layouts=seq,
                                                                                 use_local_output=False)
              for name, kind in names.items()}
    for parent in inner:
        styles[parent] = _gather_inputs(modules, parent, seq, whole, PrepareModuleInput)
    for block in blocks:
        for child, m in modules[block].named_children():
            if _is_norm(m):
                styles[f"{block}.{child}"] = SequenceParallel()
    if final_norms[0] is not None:
        styles[base + final_norms[0]] = SequenceParallel()
    if embedding is not None:
        styles[embedding] = RowwiseParallel(input_layouts=whole, output_layouts=seq, use_local_output=False)
    if head is not None:
        styles[head] = ColwiseParallel(input_layouts=seq, output_layouts=whole)
    for parent, counts in local.items():  # every check passed: the model may change now
        for attr, n in counts.items():
            setattr(modules[parent], attr, n)
    return styles


def _matmul_plan(model: torch.nn.Module) -> tuple[dict[str, str], str]:
    """(which Linear splits how, the prefix its names are under): transformers' base_model_tp_plan under the
    base model, or memfit's GPT_PLAN."""
    from memfit.workloads.gpt import GPT

    if isinstance(model, GPT):
        return GPT_PLAN, ""
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    base = getattr(model, "base_model", None)
    if not plan or not isinstance(base, torch.nn.Module):
        raise ConfigError(f"tensor parallel: no known plan for {type(model).__name__} (memfit's GPT and transformers "
                          "models whose config has a base_model_tp_plan)")
    prefix = next(n for n, m in model.named_modules() if m is base)
    return dict(plan), f"{prefix}." if prefix else ""


def _ends(model: torch.nn.Module, modules: dict, tp: int) -> tuple[str | None, str | None]:
    """The names of the token embedding and the LM head, which must be separate weights; None for one a
    pipeline stage does not hold (a stand-in in its place)."""
    from memfit.strategies.pipeline_parallel import PIPELINE_STAND_INS
    from memfit.workloads.gpt import GPT

    if isinstance(model, GPT):
        embedding, head = model.embed, model.head
    else:
        embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    staged = isinstance(embedding, PIPELINE_STAND_INS) or isinstance(head, PIPELINE_STAND_INS)
    embedding, head = (None if isinstance(m, PIPELINE_STAND_INS) else m for m in (embedding, head))
    if (not isinstance(embedding, torch.nn.Embedding) and not (staged and embedding is None)) or \
            (not isinstance(head, torch.nn.Linear) and not (staged and head is None)):
        raise ConfigError(f"tensor parallel: {type(model).__name__} has no token embedding and Linear LM head to split")
    if embedding is not None and head is not None and embedding.weight is head.weight:
        raise ConfigError("tensor parallel: the LM head shares the embedding's weight (tied), which the plan splits "
                          "two ways: untie them (tie_word_embeddings=False)")
    for vocab in (embedding.num_embeddings if embedding is not None else 0, head.out_features if head is not None else 0):
        if vocab % tp:
            raise ConfigError(f"tensor parallel: a vocabulary of {vocab} does not split over {tp} ranks")
    by_module = {id(m): n for n, m in modules.items()}
    return (by_module[id(embedding)] if embedding is not None else None,
            by_module[id(head)] if head is not None else None)


def _is_norm(m: torch.nn.Module) -> bool:
    return type(m).__name__.endswith(("RMSNorm", "LayerNorm")) and not any(True for _ in m.children())


def _local_heads(attn: torch.nn.Module, name: str, tp: int) -> dict[str, int]:
    """The per-rank value of each head-count attribute `attn` has; refused where a count does not split or
    the forward reads a global count or width from elsewhere."""
    counts = {a: getattr(attn, a) for a in HEAD_COUNTS if isinstance(getattr(attn, a, None), int)
              and not isinstance(getattr(attn, a), bool)}
    for attr, n in counts.items():
        if n % tp:
            raise ConfigError(f"tensor parallel: {name}.{attr} = {n} does not split over {tp} ranks")
    read = _GLOBAL_READ.search(_source(type(attn).forward))
    if read:
        raise ConfigError(f"tensor parallel: {type(attn).__name__}.forward reshapes with the global "
                          f"{read.group(0)}, which would be wrong on each rank's share of the heads")
    return {attr: n // tp for attr, n in counts.items()}


def _gather_inputs(modules: dict, name: str, seq, whole, prepare):
    """`PrepareModuleInput` that gathers the hidden states `name` is called with, passed by position or by
    keyword as its parent's forward passes them (read off that forward's source)."""
    parent_name, _, child = name.rpartition(".")
    first = next(iter(inspect.signature(modules[name].forward).parameters))
    for node in ast.walk(ast.parse(_source(type(modules[parent_name]).forward))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == child \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
            if any(k.arg == first for k in node.keywords):
                return prepare(input_kwarg_layouts={first: seq}, desired_input_kwarg_layouts={first: whole},
                               use_local_output=True)
            n = len(node.args)
            if n and not any(isinstance(a, ast.Starred) for a in node.args):
                return prepare(input_layouts=(seq,) + (None,) * (n - 1),
                               desired_input_layouts=(whole,) + (None,) * (n - 1), use_local_output=True)
    raise ConfigError(f"tensor parallel: cannot tell how {type(modules[parent_name]).__name__} passes the hidden "
                      f"states to {name}")


def _source(fn) -> str:
    fn = inspect.unwrap(fn)
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return ""
