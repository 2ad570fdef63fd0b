"""torchtitan's op-level selective checkpointing ("selective-op"): the policy keeps exactly attention and the odd
matmuls of a block, counted against torch's own selective-checkpoint machinery; a run trains to the same bits as
without checkpointing; the estimate equals the profiler's peak."""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import memfit
from memfit import Config
from memfit.runtime.run import recovery_ladder
from memfit.strategies import activation_checkpoint as ck
from memfit.workloads.gpt import Block, config_for, gpt
from truth import real_step_peak

mm = torch.ops.aten.mm.default
attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default

# gpt-tiny's block with 2 key/value heads: its seven matmuls' widths, in the order the block runs them
# (q, k, v, o, gate, up, down), are 64, 32, 32, 64, 256, 256, 64; torchtitan keeps the 1st, 3rd, 5th, 7th.
SHAPE = config_for("gpt-tiny", kv_heads=2)
ROWS = 2 * SHAPE.seq  # micro-batch 2
KEPT_MM = sorted([(ROWS, 64), (ROWS, 32), (ROWS, 256), (ROWS, 64)])


def _block_and_input():
    torch.manual_seed(0)
    return Block(SHAPE), torch.randn(2, SHAPE.seq, SHAPE.d_model, requires_grad=True)


def _by_op(pairs) -> dict:
    """{op: sorted shapes of the first tensor of each kept output}"""
    out = collections.defaultdict(list)
    for func, kept in pairs:
        first = kept[0] if isinstance(kept, (tuple, list)) else kept
        out[func].append(tuple(first.shape))
    return {func: sorted(shapes) for func, shapes in out.items()}


def test_torchs_own_selective_checkpointing_keeps_attention_and_every_second_matmul():
    """The policy run by torch's create_selective_checkpoint_contexts, whose cache holds each kept output under
    its op: what torchtitan's run keeps."""
    block, x = _block_and_input()
    modes = []

    def contexts():
        modes.append(create_selective_checkpoint_contexts(ck._TorchtitanOpPolicy()))
        return modes[-1]

    y = checkpoint(block, x, use_reentrant=False, context_fn=contexts)
    storage = modes[0][0].storage  # the forward's caching mode: op -> {call index: output, or a placeholder}
    kept = _by_op((func, tuple(w.val for w in torch.utils._pytree.tree_leaves(out)))
                  for func, outs in storage.items() for out in outs.values()
                  if hasattr(torch.utils._pytree.tree_leaves(out)[0], "val"))  # a kept output's wrapper
    assert kept == {mm: KEPT_MM, attention: [(2, SHAPE.heads, SHAPE.seq, SHAPE.head_dim)]}
    y.sum().backward()  # torch's recomputation asks the policy again, its count apart: it must find every kept output


def test_memfits_mechanism_keeps_the_same_outputs(monkeypatch):
    """memfit runs the policy through its own pair of modes (calls matched by name, not count): the same
    outputs must be kept, and nothing else."""
    block, x = _block_and_input()
    saved = []

    class Recording(ck._Keep):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = sum(map(len, self.kept.values()))
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if sum(map(len, self.kept.values())) > before:
                saved.append((func, out))
            return out

    monkeypatch.setattr(ck, "_Keep", Recording)
    ck.apply_checkpointing(torch.nn.ModuleList([block]), ["0"], selective="selective-op")
    block(x).sum().backward()
    assert _by_op(saved) == {mm: KEPT_MM, attention: [(2, SHAPE.heads, SHAPE.seq, SHAPE.head_dim)]}


def _trained(config: Config, steps: int = 2):
    trainer = memfit.Trainer(gpt("gpt-tiny", kv_heads=2), config, seed=3)
    losses = [trainer.step() for _ in range(steps)]
    return losses, [p.detach().clone() for p in trainer.model.parameters()]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_is_bit_identical_to_no_checkpointing(precision):
    """A recomputed op runs the same CPU kernel on the same values and a kept output is the one the forward
    made, so no sum is reordered: the dtype's tolerance for this comparison is zero, losses and weights equal
    bit for bit."""
    plain = _trained(Config(micro_batch=2, precision=precision))
    sac = _trained(Config(micro_batch=2, precision=precision, activation_checkpoint="selective-op"))
    assert plain[0] == sac[0]
    assert all(torch.equal(a, b) for a, b in zip(plain[1], sac[1]))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_estimate_equals_the_profilers_peak(precision):
    """Equal to the byte: every tensor the step holds is traced (the RNG-state copy checkpoint() keeps per
    block included), and the CPU's bf16 matmul workspaces are counted (memory/kernels.py)."""
    wl = gpt("gpt-tiny", kv_heads=2)
    config = Config(micro_batch=4, precision=precision, activation_checkpoint="selective-op")
    est = memfit.estimate(wl, config)
    assert est.method == "fake"
    real = real_step_peak(wl, config)
    assert est.peak_bytes == real, (est.peak_bytes, real)
    if precision == "fp32":  # keeps less than memfit's selective (half the matmuls), more than checkpointing all
        peaks = {c: memfit.estimate(wl, config.replace(activation_checkpoint=c)).peak_bytes
                 for c in ("all", "selective")}
        assert peaks["all"] < est.peak_bytes < peaks["selective"]


def test_oom_recovery_from_it_goes_to_checkpointing_all_only():
    """memfit's selective keeps more than torchtitan's policy (every matmul, not every second): not a step down."""
    ladder = recovery_ladder(Config(micro_batch=4, activation_checkpoint="selective-op"), 4)
    assert [(c.micro_batch, c.activation_checkpoint) for c in ladder] == [
        (2, "selective-op"), (1, "selective-op"), (1, "all")]
