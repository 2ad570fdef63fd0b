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


# --------------------------------------------------------------------------- pipeline schedules' step time
# A step of n micro-batches over p pipeline ranks, in slots of one micro-batch's forward and backward on a rank.

def test_1f1b_and_gpipe_take_n_plus_p_minus_1_slots():
    """Narayanan et al. 2021 §2.2.1: a bubble of p - 1 slots, (p - 1) / n of the ideal n, under either."""
    from memfit.planner.costmodel import pipeline_receives, pipeline_slots

    assert pipeline_slots("1f1b", 4, 8) == pipeline_slots("gpipe", 4, 8) == 11  # 8 + 3
    assert pipeline_receives("1f1b", 4, 8) == 11


def test_interleaved_1f1b_divides_the_bubble_by_v_and_multiplies_the_sends_by_v():
    """Narayanan et al. 2021 §2.2.2: v stages a rank fill and drain in chunks of 1/v of a slot: (p - 1) / v
    slots of bubble, and a rank receives v times a micro-batch."""
    from memfit.planner.costmodel import pipeline_receives, pipeline_slots

    assert pipeline_slots("interleaved-1f1b", 4, 8, virtual=2) == 9.5   # 8 + 3 / 2
    assert pipeline_slots("interleaved-1f1b", 8, 16, virtual=4) == 17.75  # 16 + 7 / 4
    assert pipeline_receives("interleaved-1f1b", 4, 8, virtual=2) == 19  # 2 x 8 + 3


def test_zero_bubble_leaves_the_forwards_share_of_the_interleaved_bubble():
    """Qi et al. 2023: ZB-H1's bubble is (p - 1)(F + I - W), a third of 1F1B's when F = I = W; torch's ZB1P
    interleaves it over v stages a rank: 8 + 3 x (1/3) / 2 slots."""
    from memfit.planner.costmodel import pipeline_receives, pipeline_slots

    assert pipeline_slots("zero-bubble", 4, 8, virtual=2) == pytest.approx(8.5)
    assert pipeline_slots("zero-bubble", 4, 8, virtual=2, forward_share=0.25) == pytest.approx(8.375)
    assert pipeline_receives("zero-bubble", 4, 8, virtual=2) == 19


def _replay(schedule, ranks: int, virtual: int, n: int, forward: float, backward_input: float,
            weight: float) -> float:
    """The makespan of torch's own order for each rank (its `_calculate_single_rank_operations`, the
    schedule's object made without stages or a process group), each action run as soon as its input has
    arrived: a forward after the previous stage's forward, a backward after the next stage's (or, on the last
    stage, its own forward), a weight pass after its input pass. A full backward takes I + W."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    sched = object.__new__(schedule)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = ranks, virtual, n
    sched.number_of_rounds = max(1, n // ranks)
    sched.microbatches_per_round = n // sched.number_of_rounds
    orders = {r: [a for a in sched._calculate_single_rank_operations(r) if a is not None] for r in range(ranks)}
    kind = {C.FORWARD: "F", C.FULL_BACKWARD: "B", C.BACKWARD_INPUT: "B", C.BACKWARD_WEIGHT: "W"}
    took = {C.FORWARD: forward, C.FULL_BACKWARD: backward_input + weight, C.BACKWARD_INPUT: backward_input,
            C.BACKWARD_WEIGHT: weight}
    stages, done, clock, at = ranks * virtual, {}, [0.0] * ranks, [0] * ranks
    while any(at[r] < len(orders[r]) for r in range(ranks)):
        moved = False
        for r in range(ranks):
            while at[r] < len(orders[r]):
                a = orders[r][at[r]]
                s, op, m = a.stage_index, a.computation_type, a.microbatch_index
                if kind[op] == "F":
                    need = (s - 1, "F", m) if s > 0 else None
                elif kind[op] == "B":
                    need = (s + 1, "B", m) if s < stages - 1 else (s, "F", m)
                else:
                    need = (s, "B", m)
                if need is not None and need not in done:
                    break
                clock[r] = max(clock[r], done.get(need, 0.0)) + took[op] / virtual
                done[(s, kind[op], m)] = clock[r]
                at[r] += 1
                moved = True
        assert moved, "the order deadlocks"
    return max(clock)


@pytest.mark.parametrize("ranks,virtual,n", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (8, 2, 16)])
def test_torchs_interleaved_orders_take_the_slots_the_closed_forms_say(ranks, virtual, n):
    """torch's ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble replayed with F = I = W = 1 (a slot is 3):
    interleaved 1F1B's bubble is (p - 1) / v slots and zero bubble's a third of it, as `pipeline_slots` says;
    with W > I zero bubble cannot drop below (p - 1) F / v, with W < I it is ZB-H1's (p - 1)(F + I - W) / v."""
    from torch.distributed.pipelining import schedules

    from memfit.planner.costmodel import pipeline_slots

    interleaved = _replay(schedules.ScheduleInterleaved1F1B, ranks, virtual, n, 1, 1, 1)
    assert interleaved == pytest.approx(3 * pipeline_slots("interleaved-1f1b", ranks, n, virtual))
    zero = _replay(schedules.ScheduleInterleavedZeroBubble, ranks, virtual, n, 1, 1, 1)
    assert zero == pytest.approx(3 * pipeline_slots("zero-bubble", ranks, n, virtual, forward_share=1 / 3))
    uneven = _replay(schedules.ScheduleInterleavedZeroBubble, ranks, virtual, n, 1, 1.5, 0.5)
    assert uneven - 3 * n == pytest.approx((ranks - 1) * (1 + 1.5 - 0.5) / virtual)
