"""Published closed forms for activation memory, checked against memfit's trace (issue 43).

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (Megatron-LM), §4:
a GPT block (LayerNorm, attention with softmax and dropout, a GELU MLP of width 4h, dropout after
attention and MLP) saves, per layer, with 16-bit activations, 1-byte dropout masks and no recomputation,

    s·b·h·(34 + 5·a·s/h) bytes,   and with t-way tensor and sequence parallelism  s·b·h·(34/t + 5·a·s/(h·t)).

The 34 sbh are (§4.1, in units of sbh bytes): attention 11 = its input 2 + Q and K 4 + V 2 + the output
projection's input 2 + its dropout mask 1; MLP 19 = its input 2 + GELU's input 8 + GELU's output 8 + its
dropout mask 1; the two LayerNorms' inputs 4. The 5as²b are the softmax output 2, its dropout mask 1 and
the dropout's output 2 (a·s·s·b each). The paper drops what is O(sb): LayerNorm's mean and 1/std.

Checked to the byte on that block, built here, and on memfit's own GPT (RMSNorm, rotary, SwiGLU, SDPA), whose
terms differ where its ops differ; with tensor parallelism, where DTensor's sequence parallelism keeps more than
Megatron's.
"""
import math

import pytest
import torch
from torch import nn

import memfit
from memfit import Config

SEQ, HEADS, WIDTH, VOCAB, B = 64, 4, 64, 256, 4  # s, a, h, the vocabulary, b


class Attention(nn.Module):
    """Megatron's attention written out: softmax and dropout on the a·s·s scores (no fused kernel)."""

    def __init__(self, width: int, heads: int, p: float, flash: bool):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(width, width) for _ in range(4))
        self.heads, self.head_dim, self.p, self.flash = heads, width // heads, p, flash

    def forward(self, x):
        b, s, _ = x.shape

        def split(t):  # (b, s, heads on this rank * head_dim) -> (b, heads, s, head_dim)
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        if self.flash:  # one kernel: neither the scores nor their dropout mask are kept
            out = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)
            return nn.functional.dropout(self.o_proj(out.transpose(1, 2).reshape(b, s, -1)), self.p, self.training)
        probs = torch.softmax(q @ k.transpose(-2, -1) * (1 / math.sqrt(self.head_dim)), dim=-1)
        out = nn.functional.dropout(probs, self.p, self.training) @ v
        out = self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        return nn.functional.dropout(out, self.p, self.training)


class MLP(nn.Module):
    def __init__(self, width: int, p: float):
        super().__init__()
        self.up_proj, self.down_proj, self.p = nn.Linear(width, 4 * width), nn.Linear(4 * width, width), p

    def forward(self, x):
        out = self.down_proj(nn.functional.gelu(self.up_proj(x)))
        return nn.functional.dropout(out, self.p, self.training)


class Block(nn.Module):
    def __init__(self, width: int, heads: int, p: float, flash: bool):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), Attention(width, heads, p, flash)
        self.ln_2, self.mlp = nn.LayerNorm(width), MLP(width, p)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MegatronGPT(nn.Module):
    """The paper's model, small. `config.base_model_tp_plan` is Megatron's split in transformers' spelling, so
    memfit's tensor parallelism (strategies/tensor_parallel.py) splits it as it splits transformers' models."""

    def __init__(self, layers: int, p: float = 0.1, flash: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block(WIDTH, HEADS, p, flash) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
        plan = {f"layers.*.attn.{n}_proj": "colwise" for n in "qkv"}
        plan |= {"layers.*.attn.o_proj": "rowwise", "layers.*.mlp.up_proj": "colwise",
                 "layers.*.mlp.down_proj": "rowwise"}
        self.config = type("Config", (), {"base_model_tp_plan": plan})()

    @property
    def base_model(self):
        return self

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def megatron_gpt(layers: int, flash: bool = False) -> memfit.Workload:
    return memfit.Workload(
        model=lambda: MegatronGPT(layers, flash=flash), batch=lambda n: torch.randint(0, VOCAB, (n, SEQ + 1)),
        loss=lambda m, ids: nn.functional.cross_entropy(m(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten()))


def per_layer_activations(config: Config, flash: bool = False) -> int:
    """One layer's saved activations as memfit traces them: the activations at the peak of a 3-layer model less
    a 2-layer one's (everything outside the blocks, and the peak's place at the start of backward, cancel)."""
    deep, shallow = (memfit.estimate(megatron_gpt(n, flash), config, device="h100").breakdown["activations"]
                     for n in (3, 2))
    return deep - shallow


def korthikanti(s: int, b: int, h: int, a: int, t: int = 1) -> float:
    """Bytes one layer saves, the paper's equation with tensor and sequence parallelism over t ranks."""
    return s * b * h * (34 / t + 5 * a * s / (h * t))


def layer_norm_stats(s: int, b: int) -> int:
    """What the paper drops: each of a layer's two LayerNorms keeps its mean and 1/std, s·b values each, in
    the dtype this machine's kernel gives them for bf16 input (the trace runs CPU kernels: bf16 here; CUDA's
    are fp32, 8·s·b bytes a layer more, which memfit does not model)."""
    stats = torch.native_layer_norm(torch.zeros(1, 2, dtype=torch.bfloat16), [2], None, None, 1e-5)[1]
    return 2 * 2 * s * b * stats.element_size()


def test_a_gpt_layer_saves_what_korthikanti_counts():
    """16-bit activations (bf16-pure: bf16 weights and no autocast, whose fp32 op list has softmax, which would
    keep a 4-byte output), a GPU target (dropout keeps CUDA's 1-byte mask; the CPU's keeps a 2-byte scaled copy of
    its noise): 34·sbh + 5·as²b, to the byte, plus the LayerNorm statistics the paper drops."""
    got = per_layer_activations(Config(micro_batch=B, precision="bf16-pure"))
    assert got == korthikanti(SEQ, B, WIDTH, HEADS) + layer_norm_stats(SEQ, B)


def test_with_tensor_and_sequence_parallelism_only_the_gathered_inputs_stay_whole():
    """t = 2: every term divides by t, as the paper has it, except two: DTensor's sequence parallelism saves
    the all-gathered input of attention's and the MLP's first Linear (2·sbh each, whole on every rank), where
    Megatron keeps the rank's 1/t and gathers it again in backward. So memfit traces
    sbh·(34/t + 4·(1 − 1/t)) + 5·as²b/t, the statistics of each rank's positions beside them."""
    t = 2
    got = per_layer_activations(Config(micro_batch=B, precision="bf16-pure", tp=t))
    sbh = SEQ * B * WIDTH
    assert got == korthikanti(SEQ, B, WIDTH, HEADS, t) + 4 * sbh * (1 - 1 / t) + layer_norm_stats(SEQ, B) // t


@pytest.mark.parametrize("t", [1, 2])
def test_with_flash_attention_the_score_term_goes_and_the_logsumexp_stays(t):
    """Attention in one kernel (SDPA, traced as CUDA's flash kernel for a GPU target): the 5·as²b of scores,
    their mask and dropout output are never held, as the paper notes; what the kernel keeps besides its
    output (shared with the output projection's input here, no copy) is a fp32 logsumexp per head and
    position, 4·as·b/t bytes, O(sb) like the statistics."""
    got = per_layer_activations(Config(micro_batch=B, precision="bf16-pure", tp=t), flash=True)
    sbh = SEQ * B * WIDTH
    assert got == sbh * (34 / t + 4 * (1 - 1 / t)) + 4 * HEADS * SEQ * B // t + layer_norm_stats(SEQ, B) // t


@pytest.mark.parametrize("t", [1, 2])
def test_memfits_own_gpt_block_follows_the_same_accounting_with_its_terms(t):
    """memfit's GPT (gpt-tiny: Llama's block) differs from the paper's in four places, each its own term per layer:
    RMSNorm computed in fp32 keeps its fp32 input copy, the bf16 normalized value and its fp32 1/rms (4 + 2 sbh and
    4 sb, where LayerNorm keeps a 2 sbh input), twice; SwiGLU keeps gate, silu(gate), up and their product (8·sbf,
    where a GELU MLP of width f keeps 4·sbf); SDPA (flash on a GPU) keeps q, k, v and its output (after rotary,
    whose products with the cos/sin tables keep only the tables: 4·s·d bytes, whole on every rank) and a fp32
    logsumexp; there is no dropout. Attention's and the MLP's inputs (2 sbh each) are held whole under
    sequence parallelism, as above. Per layer: sbh·(20/t + 4) + 8·sbf/t + (8 + 4a)·sb/t + 4·sd."""
    from memfit.workloads import builtin

    cfg = builtin("gpt-tiny").model().cfg
    s, h, f, a, d = cfg.seq, cfg.d_model, cfg.ffn, cfg.heads, cfg.head_dim
    deep, shallow = (memfit.estimate(builtin("gpt-tiny", layers=n), Config(micro_batch=B, precision="bf16-pure", tp=t),
                                     device="h100").breakdown["activations"] for n in (3, 2))
    sb = s * B
    assert deep - shallow == sb * h * (20 / t + 4) + 8 * sb * f / t + (8 + 4 * a) * sb / t + 4 * s * d
