"""An estimate counted from three shallow copies gives the whole model's trace's figures to the byte, on a GPU
target (the caching allocator's reserved peak included) and on the CPU, for models of several kinds (dense,
MoE, vision, a Mamba/attention hybrid whose layers repeat every 2, one whose attention block is shared by its
layers, an encoder counted from copies one block deeper, one alternating global and local attention); where it
does not apply (an encoder-decoder, a shallow model) the whole model is traced, and nothing
says extrapolated."""
import io
import re

import pytest
import torch
from rich.console import Console

pytest.importorskip("transformers")
import transformers  # noqa: E402

from memfit.config import Config  # noqa: E402
from memfit.memory import streams  # noqa: E402
from memfit.memory.estimate import estimate, probe  # noqa: E402
from memfit.memory.extrapolate import _at_peak_lists, _keeping_streams, estimate_blocks, layer_plan  # noqa: E402
from memfit.report.tables import estimate_view  # noqa: E402
from memfit.workloads import hf  # noqa: E402

LAYERS = 12  # copies of 1, 2, 3 blocks: 3 on either core, 6 in all (at most 1/2 and 3/4 of the blocks)
SMALL = dict(hidden_size=64, num_attention_heads=4, vocab_size=512, num_hidden_layers=LAYERS)
KINDS = {
    "llama": dict(SMALL, intermediate_size=128, num_key_value_heads=2),                       # dense
    "mixtral": dict(SMALL, intermediate_size=64, num_key_value_heads=2, num_local_experts=4),  # MoE
    "vit": dict(SMALL, intermediate_size=128, image_size=32, patch_size=8),                   # vision
    # a hybrid of the Mamba family: attention every 2nd layer, experts in the others; copies of 2, 4, 6 would
    # hold 6 of its 8 blocks on one core, so the first has no layer: 0, 2, 4 (its backward peaks off the line)
    "jamba": dict(SMALL, num_hidden_layers=8, num_key_value_heads=2, intermediate_size=64,
                  attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0,
                  num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False),
    # Zamba: Mamba layers, from the third on each also running one attention block shared by all (transformers
    # ties its weights); the first copy holds three of its uses (5 blocks), as autograd sums the second use's
    # weight gradient into the first's out of place and each further one in place
    # BERT: the embeddings' output lives until the last block ends, which frees it and the block before's
    # output, a middle block only the latter; copies of 1, 2, 3 do not extend, copies of 2, 3, 4 do
    "bert": dict(SMALL, intermediate_size=128),
    # GPT-Neo: global and local attention alternate (period 2), each layer with a causal-mask buffer, listed
    # after every parameter; one reading of the copies puts a period's buffers beside its parameters, which the
    # third copy bears out but for the setup order: the reading taken is the one it bears out event for event
    "gpt_neo": dict(SMALL, num_hidden_layers=24, attention_types=[[["global", "local"], 12]]),
    "zamba": dict(SMALL, num_hidden_layers=24, num_key_value_heads=4, intermediate_size=128, attn_layer_period=1,
                  attn_layer_offset=0, mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False),
}
TRACED = {"jamba": (4, 8), "zamba": (7, 24), "bert": (4, LAYERS), "gpt_neo": (6, 24)}  # (blocks traced at most, of)
FIRST = {"jamba": 0, "zamba": 5, "gpt_neo": 2}  # the first copy's blocks (of the first copies tried); the others 1
_INDEX = re.compile(r"\.\d+(?=\.|$)")


def _workload(kind: str, **fields):
    return hf.from_config(transformers.AutoConfig.for_model(kind, **fields), name=kind,
                          **({} if kind == "vit" else {"seq": {"jamba": 8, "zamba": 4}.get(kind, 16)}))


def _figures(e) -> tuple:
    return (e.peak_bytes, e.peak_allocated_bytes, e.peak_reserved_bytes, e.device_peak_bytes, e.breakdown,
            e.model_state_bytes, e.phase_peaks, e.peak_phase, e.flops, e.parameters)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_extrapolated_estimate_is_the_full_trace(kind):
    wl = _workload(kind, **KINDS[kind])
    config = Config(micro_batch=1, precision="bf16")
    counted = estimate_blocks(wl, config, "h100", isolate=False)
    full = estimate(wl, config, "h100", isolate=False)
    traced, blocks = TRACED.get(kind, (3, LAYERS))
    assert layer_plan(wl).depths[0] == FIRST.get(kind, 1)
    assert counted.extrapolated_from == (traced, blocks)
    assert counted.notes[0].startswith(f"extrapolated from {traced} of {blocks} blocks")
    assert (kind == "bert") == any(n.startswith("copies one block shallower were tried first") for n in counted.notes)
    assert "but for the order" not in counted.notes[0]
    assert _figures(counted) == _figures(full)
    assert counted.top_tensors == _any_block(full.top_tensors)
    assert full.extrapolated_from is None and counted.to_dict()["extrapolated_from"] == (traced, blocks)


def _any_block(tensors: list[dict]) -> list[dict]:
    """A traced estimate's tensor list as a counted one writes it: '#' for a block's index, no empty tensors."""
    return [dict(t, module=_INDEX.sub(".#", t["module"]), shape=list(t["shape"])) for t in tensors if t["bytes"]]


def test_a_counted_estimate_lists_the_whole_traces_tensors_and_modules_at_the_peak():
    """Where activations make the peak (in backward), the counted estimate's tensors and modules at the peak
    are the whole trace's: its tensor list with '#' for the block index, and its modules (read from the whole
    trace's own allocation stream, as the list of 20 leaves most blocks out) with each block's together."""
    wl = _workload("llama", **KINDS["llama"])
    config = Config(micro_batch=64, precision="bf16")
    counted = estimate_blocks(wl, config, "h100", isolate=False)
    with _keeping_streams():
        whole = probe(wl, config, "h100", isolate=False)
    assert counted.extrapolated_from == (3, LAYERS) and counted.peak_phase == whole.estimate.peak_phase == "backward"
    assert counted.top_tensors == _any_block(whole.estimate.top_tensors)
    tensors, modules = _at_peak_lists(whole.stream)
    assert counted.modules == modules and counted.top_tensors == tensors
    by_block = [m for m, _ in counted.modules if ".#" in m]
    assert len(by_block) > 5 and sum(n for _, n in counted.modules) == \
        counted.breakdown["activations"] + counted.breakdown["temporaries"]  # every module listed: 20 hold them
    assert dict(whole.estimate.modules)["model.layers.0.mlp.up_proj"] * LAYERS == \
        dict(counted.modules)["model.layers.#.mlp.up_proj"]


def test_extrapolated_on_the_cpu():
    wl = _workload("llama", **KINDS["llama"])
    counted = estimate_blocks(wl, Config(micro_batch=2), "cpu", isolate=False)
    assert counted.extrapolated_from == (3, LAYERS)
    assert _figures(counted) == _figures(estimate(wl, Config(micro_batch=2), "cpu", isolate=False))
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(estimate_view(counted))  # what `memfit estimate` prints
    assert f"extrapolated from 3 of {LAYERS} blocks" in console.export_text().splitlines()[1]


def test_where_it_does_not_apply_the_whole_model_is_traced():
    # an encoder-decoder's blocks are two lists (T5: encoder and decoder); a model too shallow for copies
    # of 1, 2, 3 blocks to hold at most three quarters of its blocks
    t5 = _workload("t5", d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=LAYERS, vocab_size=512)
    shallow = _workload("llama", **dict(KINDS["llama"], num_hidden_layers=7))
    assert layer_plan(t5) is None and layer_plan(shallow) is None
    est = estimate_blocks(shallow, Config(micro_batch=1), "cpu", isolate=False)
    assert est.extrapolated_from is None and est.timeline["index"]


def test_stream_with_blocks_inserted_repeats():
    """Two blocks' stream is one block's with its runs inserted; three are the same runs twice."""
    def step(blocks):  # params made, a forward keeping one activation a block, a backward freeing them
        ev = [(f"p{i}", 8) for i in range(blocks)] + [("x", 4)]
        ev += [(f"a{i}", 16) for i in range(blocks)]
        ev += [(f"a{i}", -16) for i in reversed(range(blocks))] + [("x", -4)]
        return streams.tokens(ev, {k: k[0] for k, _ in ev})

    one, two, five = streams.written([step(1), step(2), step(5)])
    runs = streams.insertions(one, two)
    assert streams.repeat(one, runs, 1) == two and streams.repeat(one, runs, 4) == five
    assert streams.peak(five) == 5 * 8 + 4 + 5 * 16
    # the frees at the end, with no allocation between them, in the order their storages were made
    assert streams.events(two) == [(0, 8), (1, 8), (2, 4), (3, 16), (4, 16), (2, -4), (3, -16), (4, -16)]
    # a reading that frees a tensor of a kind none is alive of (BEiT's copies: one way to read them) is no
    # stream: it differs from the copy's, and the next reading is tried
    assert streams.differs([(-4, "x", "n", 0)], two) == "other"


def test_a_second_copy_read_two_ways_takes_the_reading_the_third_bears_out():
    """A run inserted before a token of its own class can be read split around that token or whole; both make
    the second copy, only one the third (Zamba's optimizer frees its temporaries so)."""
    a, f, g, h = (8, "a"), (-4, "f"), (2, "g"), (1, "h")
    first, second, third = [a, f], [a, g, f, h, f], [a, g, f, h, g, f, h, f]
    split = streams.insertions(first, second)  # the longest agreement, ties the shortest run: g, then h f
    assert streams.repeat(first, split, 1) == second and streams.repeat(first, split, 2) != third
    whole = streams.insertions(first, second, lambda runs: streams.repeat(first, runs, 2) == third)
    assert whole == [(1, [g, f, h])]


def test_a_copy_differing_only_in_the_order_of_what_lives_before_the_step_says_so():
    """Tensors alive before the step are laid out by size, ties in the collector's order, which moves with the
    depth (falcon_mamba's norm weights): accepted as "setup order" (the figures are then compared); any other
    difference is not."""
    setup = [(f"w{i}", 8 * (i + 1)) for i in range(3)]
    step = [("a", 16), ("a", -16)]

    def stream(setup):
        return streams.tokens(setup + step, {k: k for k, _ in setup + step}, [(len(setup), "forward")])

    assert streams.differs(stream(setup), stream(setup)) is None
    assert streams.differs(stream(setup[::-1]), stream(setup)) == "setup order"
    assert streams.differs(stream(setup[:2]), stream(setup)) == "other"


def test_checkpointing_every_k_blocks_is_part_of_the_layer_pattern():
    """Blocks 0, k, 2k, ... recompute their forward: copies a multiple of k apart; blocks named one by one
    have no pattern a copy could hold."""
    wl = _workload("llama", **dict(KINDS["llama"], num_hidden_layers=4 * LAYERS))
    assert layer_plan(wl).period == 1
    assert layer_plan(wl, checkpoint=3).period == 3 and layer_plan(wl, checkpoint="all").period == 1
    assert layer_plan(wl, checkpoint=("model.layers.0",)) is None


def test_per_layer_config_lists_are_part_of_the_layer_pattern():
    """Sliding and full attention layers have the same parameters; a config's `layer_types` tells them apart."""
    fields = dict(SMALL, intermediate_size=128, num_key_value_heads=2, num_hidden_layers=2 * LAYERS)
    alternating = _workload("qwen2", **fields, use_sliding_window=True, sliding_window=8,
                            layer_types=["full_attention", "sliding_attention"] * LAYERS)
    assert layer_plan(alternating).period == 2 and layer_plan(_workload("qwen2", **fields)).period == 1
    # T5Gemma 2 keeps its lists in sub-configs (`decoder.layer_types`, `encoder.text_config.layer_types`: five
    # sliding layers, then a full one); copies of 1, 2, 3 sliding layers missed its full layers' rotary
    # embedding, saved only where one runs (4 MiB more reserved at its whole depth). Period 6 holds too many
    # blocks of its 26: traced whole.
    t5gemma2 = hf.from_config(transformers.AutoConfig.for_model("t5gemma2"), name="t5gemma2", seq=16)
    assert layer_plan(t5gemma2) is None


class _Stack(torch.nn.Module):
    """Twelve identical blocks; the step divides by the depth less 1 (a layer-scaled schedule), or raises at
    any depth (a model's own dtype error)."""

    def __init__(self, always_raises: bool):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(LAYERS))
        self.always_raises = always_raises

    def forward(self, x):
        if self.always_raises:
            raise RuntimeError("expected m1 and m2 to have the same dtype")
        for i, layer in enumerate(self.layers):
            x = layer(x) * (1 + i / (len(self.layers) - 1))
        return x


@pytest.mark.parametrize("always_raises", [False, True])
def test_copies_one_block_deeper_are_tried_only_where_the_deepest_copy_traced(monkeypatch, always_raises):
    """A copy of one block that the model's code refuses (a division by its depth less 1) leaves the copies of
    2 and 3 traced: they are kept, and only the copy of 4 is traced for copies of 2, 3 and 4. Where the deepest
    copy raised too, deeper copies would: the whole model is traced next, and its error is the estimate's."""
    from memfit import Workload
    from memfit.errors import WorkloadError
    from memfit.memory import extrapolate

    traced = []
    original = extrapolate.traced.probe
    monkeypatch.setattr(extrapolate.traced, "probe",
                        lambda wl, *a, **k: traced.append(len(wl.model().layers)) or original(wl, *a, **k))
    wl = Workload(model=lambda: _Stack(always_raises), batch=lambda n: torch.randn(n, 8),
                  loss=lambda model, batch: model(batch).sum())
    assert layer_plan(wl).depths == (1, 2, 3)
    if always_raises:
        with pytest.raises(WorkloadError, match="same dtype"):
            estimate_blocks(wl, Config(micro_batch=2), isolate=False)
        assert traced[3:] == [LAYERS] and sorted(traced[:3]) == [1, 2, 3]  # (then the whole model)
    else:
        counted = estimate_blocks(wl, Config(micro_batch=2), isolate=False)
        assert sorted(traced) == [1, 2, 3, 4] and counted.extrapolated_from == (4, LAYERS)
        assert counted.notes[-1].startswith("copies one block shallower were tried first: a copy's step raised")
        assert _figures(counted) == _figures(estimate(wl, Config(micro_batch=2), isolate=False))
