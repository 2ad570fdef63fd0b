"""transformers on fake tensors: image classifiers, CLIP, hub ids from the local cache, and what a model's
constructor computes from tensors (drop-path schedules, truncated-normal init) while it is built fake."""
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit import Config
from memfit.errors import WorkloadError
from truth import allocator_step_peak, real_step_peak

transformers = pytest.importorskip("transformers")
from memfit.workloads import builtin, hf  # noqa: E402

TINY = {
    "vit": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
                patch_size=8, num_labels=10),
    "convnext": dict(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 2, 1], image_size=32, num_labels=10,
                     drop_path_rate=0.1),
    "llama": hf.SMALL_CONFIGS["llama"],
    "t5": hf.SMALL_CONFIGS["t5"],
    "clip": dict(text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  vocab_size=100, max_position_embeddings=16),
                 vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=32, patch_size=8), projection_dim=16),
    "llava": dict(text_config=dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=100),
                  vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8),
                  image_token_id=99),
    "llava_next": dict(text_config=dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, vocab_size=100),
                       vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8),
                       image_grid_pinpoints=[[32, 64], [64, 32], [64, 64]], image_token_id=99),
    "smolvlm": dict(text_config=dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, vocab_size=100),
                    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                       image_size=32, patch_size=8), scale_factor=2, image_token_id=99),
    "granite_docling": dict(text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, vocab_size=100,
                                             pad_token_id=0),
                            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                               num_attention_heads=2, image_size=32, patch_size=8, scale_factor=2,
                                               out_hidden_size=32, deepstack_visual_indexes=[1, 2]),
                            image_token_id=99, pad_token_id=0),
    "mistral3": dict(text_config=dict(model_type="mistral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=100),
                     vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, head_dim=16, image_size=64, patch_size=8),
                     spatial_merge_size=2, image_token_id=99),
    "qwen2_vl": dict(text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=100,
                                      rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[2, 3, 3])),
                     vision_config=dict(depth=1, embed_dim=32, hidden_size=32, out_hidden_size=32, num_heads=2,
                                        patch_size=8, spatial_merge_size=2, temporal_patch_size=2),
                     image_token_id=99, vision_start_token_id=97, vision_end_token_id=98, video_token_id=96),
    "siglip2": dict(text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     vocab_size=100),
                    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       num_patches=16, patch_size=4), num_labels=10),
}


def tiny(model_type: str, **options):
    return hf.from_config(transformers.AutoConfig.for_model(model_type, **TINY[model_type]), **options)


@pytest.mark.parametrize("model_type,task", [("vit", "image"), ("convnext", "image"), ("llama", "causal"),
                                             ("t5", "seq2seq"), ("clip", "contrastive")])
def test_tiny_transformers_trace_on_fake_for_a_gpu(model_type, task):
    options = {"task": "contrastive"} if model_type == "clip" else {"seq": 16}
    wl = tiny(model_type, **options)
    est = memfit.estimate(wl, Config(micro_batch=1, precision="bf16"), device="h100")
    assert est.method == "fake", est.notes
    assert hf.pick_task(transformers.AutoConfig.for_model(model_type)) == ("image" if model_type == "clip" else task)
    assert est.parameters == sum(p.numel() for p in wl.model().parameters())


def test_image_batches_follow_the_config():
    b = tiny("vit").batch(3)
    assert b["pixel_values"].shape == (3, 3, 32, 32) and b["labels"].shape == (3,) and b["labels"].max() < 10
    b = hf.from_config(transformers.AutoConfig.for_model("resnet", num_channels=1), image_size=40).batch(2)
    assert b["pixel_values"].shape == (2, 1, 40, 40)  # ResNet's config names no size: image_size, else 224
    assert hf.from_config(transformers.AutoConfig.for_model("resnet")).batch(1)["pixel_values"].shape[-1] == 224
    clip = tiny("clip", task="contrastive")
    assert clip.batch(2)["input_ids"].shape == (2, 16)  # the text model's positions, under the default 128
    with pytest.raises(WorkloadError, match="positions"):
        tiny("clip", task="contrastive", seq=17)
    with pytest.raises(WorkloadError, match="no image head"):
        hf.from_config("llama", task="image")
    # Perceiver's masked-LM decoder predicts every one of its 2,048 positions, whatever the input length.
    labels = hf.from_config(transformers.AutoConfig.for_model("perceiver"), seq=16).batch(1)["labels"]
    assert labels.shape == (1, 2048) and (labels[:, 16:] == -100).all()
    # GIT's causal-LM loss skips the image's tokens before the text: its batches carry an image.
    assert hf.from_config(transformers.AutoConfig.for_model("git"), seq=8).batch(1)["pixel_values"].shape == (
        1, 3, 224, 224)
    # A Hub config names the class it was published as; that head wins over the model type's default.
    cfg = transformers.AutoConfig.for_model("clip", architectures=["CLIPModel"])
    assert hf.pick_task(cfg) == "contrastive"


def test_a_constructor_that_reads_tensors_builds_on_fake_tensors():
    """Drop-path rates from `linspace(...).tolist()` and `trunc_normal_`'s resampling loop read values,
    which fake tensors lack: both stopped the trace (aten._local_scalar_dense) and sent ViT and ConvNeXt to
    real steps. The rates must be the real ones, not a stand-in."""
    seen = []

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rates = [x.tolist() for x in torch.linspace(0, 0.3, 4).split([1, 3])]
            seen.append(self.rates)
            self.fc = nn.Linear(16, 4)
            nn.init.trunc_normal_(self.fc.weight, std=0.02)

        def forward(self, x):
            return self.fc(x)

    wl = memfit.Workload(model=Net, batch=lambda n: {"x": torch.randn(n, 16), "y": torch.randint(0, 4, (n,))},
                         loss=lambda m, b: F.cross_entropy(m(b["x"]), b["y"]),
                         optimizer=lambda p: torch.optim.AdamW(p), name="net")
    est = memfit.estimate(wl, Config(micro_batch=2), device="h100", isolate=False)
    assert est.method == "fake"
    assert seen[-1] == [[0.0], pytest.approx([0.1, 0.2, 0.3])]
    assert est.model_state_bytes["parameters"] == (16 * 4 + 4) * 4


def test_layerdrop_is_traced_with_no_layer_skipped_and_says_so():
    """`if torch.rand([]) < layerdrop: skip` branches on a random number; the fake trace takes the branch in
    which every layer runs, the step's largest memory: the same peak as the model without LayerDrop."""

    class Net(nn.Module):
        def __init__(self, layerdrop):
            super().__init__()
            self.layerdrop = layerdrop
            self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))

        def forward(self, x):
            for layer in self.layers:
                if self.training and self.layerdrop > 0 and torch.rand([]) < self.layerdrop:
                    continue
                x = torch.tanh(layer(x))
            return x

    def workload(layerdrop):
        return memfit.Workload(model=lambda: Net(layerdrop), batch=lambda n: {"x": torch.randn(n, 32)},
                               loss=lambda m, b: m(b["x"]).square().mean(),
                               optimizer=lambda p: torch.optim.SGD(p, lr=0.1), name="layerdrop")

    dropping = memfit.estimate(workload(0.9), Config(micro_batch=8), isolate=False)
    assert dropping.method == "fake" and any("LayerDrop" in note for note in dropping.notes)
    plain = memfit.estimate(workload(0.0), Config(micro_batch=8), isolate=False)
    assert dropping.peak_bytes == plain.peak_bytes and not any("LayerDrop" in note for note in plain.notes)


def _cache(root, repo_id: str, config: dict, ref: bool = True):
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    if ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0123abcd")


def test_hub_ids_are_read_from_the_local_cache_and_never_downloaded(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    _cache(tmp_path, "acme/tiny-vit", {"model_type": "vit", "architectures": ["ViTForImageClassification"],
                                       **TINY["vit"]})
    _cache(tmp_path, "acme/tiny-llama", {"model_type": "llama", **TINY["llama"]}, ref=False)  # snapshot, no ref
    wl = builtin("hf:acme/tiny-vit")
    assert wl.name == "hf:acme/tiny-vit" and wl.batch(1)["pixel_values"].shape == (1, 3, 32, 32)
    assert type(builtin("hf:acme/tiny-llama", seq=8).model()).__name__ == "LlamaForCausalLM"
    with pytest.raises(WorkloadError) as e:
        builtin("hf:acme/not-here")
    message = str(e.value)
    assert "acme/not-here" in message and str(tmp_path) in message and "offline" in message
    assert "hf:path/to/config.json" in message
    with pytest.raises(WorkloadError, match="no such config file"):
        builtin("hf:acme/config.json")


def test_a_vision_transformer_matches_the_profiler():
    """fp32 on the CPU: every allocation passes the dispatcher except what oneDNN takes inside the patch
    embedding's convolution (reordered input and weight), so the estimate may be short by at most those."""
    wl = tiny("vit")
    cfg = Config(micro_batch=4)
    est = memfit.estimate(wl, cfg)
    truth = real_step_peak(wl, cfg)
    conv = wl.model().vit.embeddings.patch_embeddings.projection
    slack = 4 * 3 * 32 * 32 * 4 + conv.weight.numel() * 4
    assert est.method == "fake" and 0 <= truth - est.peak_bytes <= slack, (est.peak_bytes, truth)


def test_naflex_images_are_patch_sequences_and_siglip2_matches_the_profiler():
    """SigLIP 2 reads each image as its flattened patches with the grid they came from (its positional
    embeddings are resized to each image's grid): every image fills the config's square grid of patches.
    Its classifier computes an attention-pooling head it never reads: the estimate was 16% high (optimizer
    state for the head; the head's graph kept alive by memfit's own saved-tensor hooks), now to the byte."""
    wl = tiny("siglip2")
    b = wl.batch(3)
    assert b["pixel_values"].shape == (3, 16, 3 * 4 * 4) and "pixel_attention_mask" not in b
    assert b["spatial_shapes"].tolist() == [[4, 4]] * 3 and b["labels"].shape == (3,)
    assert memfit.estimate(wl, Config(micro_batch=1, precision="bf16"), device="h100").method == "fake"
    cfg = Config(micro_batch=4)
    est = memfit.estimate(wl, cfg)
    assert est.method == "fake" and est.peak_bytes == pytest.approx(real_step_peak(wl, cfg), rel=0.001)


def test_sequence_classifiers_train_their_head_and_match_the_profiler():
    """Fine-tuning an encoder on labels and training a reward model (a decoder scoring its last token): a Hub
    config naming a sequence-classification class trains that head, not the masked or causal LM one it would
    otherwise get (a vocabulary-sized logits tensor a real run never makes)."""
    bert = transformers.AutoConfig.for_model("bert", **hf.SMALL_CONFIGS["bert"], num_labels=3,
                                             architectures=["BertForSequenceClassification"])
    assert hf.pick_task(bert) == "classification"
    wl = hf.from_config(bert, seq=32)
    b = wl.batch(4)
    assert b["labels"].shape == (4,) and b["labels"].dtype == torch.long and b["labels"].max() < 3
    assert type(wl.model()).__name__ == "BertForSequenceClassification"
    # one label: a score, trained by regression on float targets; a decoder without a padding id gets one
    reward = hf.from_config(transformers.AutoConfig.for_model("llama", **hf.SMALL_CONFIGS["llama"], num_labels=1),
                            seq=32, task="classification")
    assert reward.batch(2)["labels"].dtype == torch.float32 and reward.model().score.out_features == 1
    for w, precision in ((wl, "bf16"), (reward, "fp32")):
        cfg = Config(micro_batch=2, precision=precision)
        est = memfit.estimate(w, cfg)
        assert est.method == "fake" and est.peak_bytes == pytest.approx(real_step_peak(w, cfg), rel=0.001)


def test_vision_language_models_put_each_images_tokens_in_place_and_match_the_profiler():
    """LLaVA (images as (n, C, H, W); the CLIP tower's 16 patches, CLS dropped, 16 tokens: counted by running
    the tower on the meta device) and Qwen2-VL (each image's flattened patches and (t, h, w) grid, 4x4
    patches merged 2x2 into 4 tokens, between vision-start and -end marks). Qwen2-VL's M-RoPE builds its
    offsets with torch.tensor() of 0-dim tensors, which reads values outside the dispatcher: traced on fake
    tensors from the values memfit keeps beside them."""
    llava, qwen = tiny("llava", seq=32), tiny("qwen2_vl", seq=32, image_size=32)
    assert hf.pick_task(transformers.AutoConfig.for_model("llava")) == "image-text"
    b = llava.batch(3)
    assert b["pixel_values"].shape == (3, 3, 32, 32) and ((b["input_ids"] == 99).sum(1) == 16).all()
    assert ((b["labels"] == -100) == (b["input_ids"] == 99)).all()
    b = qwen.batch(2)
    assert b["pixel_values"].shape == (2, 16, 3 * 2 * 8 * 8) and b["image_grid_thw"].tolist() == [[1, 4, 4]] * 2
    assert b["input_ids"][:, 1:7].tolist() == [[97, 99, 99, 99, 99, 98]] * 2
    assert (b["mm_token_type_ids"] == (b["input_ids"] == 99)).all()
    for wl, precision in ((llava, "bf16"), (qwen, "fp32")):
        cfg = Config(micro_batch=2, precision=precision)
        est = memfit.estimate(wl, cfg)
        assert est.method == "fake" and est.peak_bytes == pytest.approx(real_step_peak(wl, cfg), rel=0.001)
    with pytest.raises(WorkloadError, match="16 tokens per image; seq 16 leaves no text"):
        tiny("llava", seq=16)


def test_anyres_images_are_the_whole_image_and_its_tiles_and_match_the_profiler():
    """LLaVA-NeXT: an image is resized to the best of the config's grid pinpoints and cut into tiles of the
    tower's size, after the whole image at that size: (n, tiles, C, H, W) with each image's size. A 32x32
    image takes the 32x64 grid (3 tiles): 16 base tokens + a 4x8 feature grid cropped back to 4x4 with a
    newline token per row (20); a 64x64 image takes 64x64 (5 tiles): 16 + 8 x (8 + 1) = 88."""
    small, large = tiny("llava_next", seq=64), tiny("llava_next", seq=128, image_size=64)
    b = small.batch(2)
    assert b["pixel_values"].shape == (2, 3, 3, 32, 32) and b["image_sizes"].tolist() == [[32, 32]] * 2
    assert ((b["input_ids"] == 99).sum(1) == 36).all() and ((b["labels"] == -100) == (b["input_ids"] == 99)).all()
    b = large.batch(1)
    assert b["pixel_values"].shape == (1, 5, 3, 32, 32) and ((b["input_ids"] == 99).sum(1) == 88).all()
    cfg = Config(micro_batch=2)
    est = memfit.estimate(small, cfg)
    assert est.method == "fake" and est.peak_bytes == pytest.approx(real_step_peak(small, cfg), rel=0.001)


def test_idefics_style_images_are_5d_with_their_pixel_mask_and_match_the_profiler():
    """SmolVLM (Idefics 3's layout): (n, images, C, H, W) and a mask of real pixels; its tower drops images
    of zeros and masks pixels, values the meta device has not, so the tokens per image are the model's own
    image_seq_len: 4x4 patches pixel-shuffled 2x2, 4 tokens, as its tower gives on a real image."""
    wl = tiny("smolvlm", seq=32)
    b = wl.batch(2)
    assert b["pixel_values"].shape == (2, 1, 3, 32, 32) and b["pixel_attention_mask"].shape == (2, 1, 32, 32)
    features = wl.model().get_image_features(pixel_values=b["pixel_values"][:1])
    tokens = sum(t.shape[:-1].numel() for t in getattr(features, "pooler_output", features))  # one per image
    assert tokens == 4 and ((b["input_ids"] == 99).sum(1) == tokens).all()
    cfg = Config(micro_batch=2)
    est = memfit.estimate(wl, cfg)
    assert est.method == "fake" and est.peak_bytes == pytest.approx(real_step_peak(wl, cfg), rel=0.001)
    with pytest.raises(WorkloadError, match="takes images at its vision tower's size"):
        tiny("smolvlm", seq=32, image_size=64)


def test_granite_docling_masks_tiles_not_pixels_and_matches_the_allocator():
    """Granite Docling takes Idefics' 5-D images but masks real tiles, (n, tiles), as its processor makes:
    with Idefics' mask of pixels its tower indexed the wrong batch. Truth here is the CPU allocator's own
    running total: the profiler's timeline loses ~2 KB of this step's tensors (1,643,478 bytes against the
    allocator's 1,645,558 and the estimate's 1,645,510 at this size)."""
    wl = tiny("granite_docling", seq=32)
    b = wl.batch(2)
    assert b["pixel_values"].shape == (2, 1, 3, 32, 32) and b["pixel_attention_mask"].shape == (2, 1)
    features = wl.model().get_image_features(pixel_values=b["pixel_values"][:1],
                                             pixel_attention_mask=b["pixel_attention_mask"][:1])
    tokens = sum(t.shape[0] for t in features.pooler_output)
    assert tokens == 4 and ((b["input_ids"] == 99).sum(1) == tokens).all()
    cfg = Config(micro_batch=2)
    est = memfit.estimate(wl, cfg)
    assert est.method == "fake" and est.peak_bytes == pytest.approx(allocator_step_peak(wl, cfg), rel=0.001)


def test_mistral3_images_are_counted_by_its_merge_rule_and_match_the_profiler():
    """Mistral 3 splits its tower's features per image by (H / (patch x merge)) x (W / (patch x merge)), a rule
    that reads the sizes' values (the meta device has none): a 48-pixel image in 8-pixel patches merged 2x2 is
    3 x 3 = 9 tokens, as many as its tower gives for the real image."""
    wl = tiny("mistral3", seq=32, image_size=48)
    b = wl.batch(2)
    assert b["pixel_values"].shape == (2, 3, 48, 48) and b["image_sizes"].tolist() == [[48, 48]] * 2
    features = wl.model().get_image_features(pixel_values=b["pixel_values"][:1], image_sizes=b["image_sizes"][:1])
    tokens = sum(t.shape[0] for t in features.pooler_output)
    assert tokens == 9 and ((b["input_ids"] == 99).sum(1) == tokens).all()
    cfg = Config(micro_batch=2)
    est = memfit.estimate(wl, cfg)
    assert est.method == "fake" and est.peak_bytes == pytest.approx(real_step_peak(wl, cfg), rel=0.001)


def test_transformers_own_gradient_checkpointing_matches_the_profiler():
    """transformers skips an attention mask of all ones after reading it, which it cannot do on fake tensors;
    with its gradient checkpointing the mask it built instead sat at the peak (+0.9% fp32, +2.6% fp16 on
    this BERT at seq 256). torch.utils.checkpoint's copies of the CPU RNG state (one per checkpointed layer
    until its backward, one more while a layer is recomputed) are made outside the dispatcher: the trace holds
    stand-ins for them, as for memfit's checkpointing (5,056 bytes low before, the peak being in a recompute)."""
    base = builtin("hf:bert", seq=128)

    def model():
        m = base.model()
        m.gradient_checkpointing_enable()
        return m

    wl = dataclasses.replace(base, model=model)
    cfg = Config(micro_batch=4)
    est = memfit.estimate(wl, cfg)
    assert est.peak_bytes == pytest.approx(real_step_peak(wl, cfg), rel=1e-4)
    assert est.peak_bytes == memfit.estimate(base, Config(micro_batch=4, activation_checkpoint="all")).peak_bytes


def test_a_gpu_estimate_says_it_traced_the_reference_path_of_fused_kernel_packages():
    """transformers' Mamba runs mamba_ssm's and causal_conv1d's fused kernels on a GPU where they are
    installed and its reference PyTorch scan elsewhere: a GPU estimate traces the reference path and says
    so, as for RWKV's WKV kernel, which it loads from the hub by name; a CPU estimate (which runs that path)
    and a model without such kernels say nothing."""
    mamba = hf.from_config(transformers.AutoConfig.for_model(
        "mamba", hidden_size=32, num_hidden_layers=1, state_size=4, vocab_size=100, expand=2), seq=8)
    cfg = Config(micro_batch=1, precision="bf16")
    [note] = [n for n in memfit.estimate(mamba, cfg, device="h100").notes if "reference PyTorch path" in n]
    assert "mamba_ssm (" in note and "selective_scan_fn" in note and "causal_conv1d (" in note
    assert not [n for n in memfit.estimate(mamba, Config(micro_batch=1)).notes if "reference PyTorch path" in n]
    assert not [n for n in memfit.estimate(tiny("llama", seq=16), cfg, device="h100").notes
                if "reference PyTorch path" in n]
    # RWKV loads its WKV kernel from the hub by name on a GPU (with the `kernels` package): said too
    rwkv = hf.from_config(transformers.AutoConfig.for_model(
        "rwkv", hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64,
        vocab_size=100, context_length=16), seq=8)
    [note] = [n for n in memfit.estimate(rwkv, cfg, device="h100").notes if "reference PyTorch path" in n]
    assert "kernels-community/rwkv (hub kernel)" in note


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_masks_transformers_skips_in_a_real_run_are_skipped_in_the_trace(precision):
    """transformers builds no causal mask for BART's decoder when nothing is padded (SDPA's causal flag does
    it), after reading the cache's offset; it does not read fake tensors, so the trace built a B x T x T
    mask that each decoder layer's SDPA kept for backward, as a float copy (+0.93% at seq 64, more with seq).
    The estimate is now within one bool B x T x T mask (2 KB) of the profiler; it was one float copy high a
    layer (8 KB in fp32, 4 KB in bf16 here)."""
    bart = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
                encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=500, max_position_embeddings=64)
    wl = hf.from_config(transformers.AutoConfig.for_model("bart", **bart), seq=32)
    cfg = Config(micro_batch=2, precision=precision)
    assert abs(memfit.estimate(wl, cfg).peak_bytes - real_step_peak(wl, cfg)) < 2 * 32 * 32  # a bool mask
