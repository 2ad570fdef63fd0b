"""Estimate vs the profiler on model families outside the tables hf_heldout.py sweeps, as a user would write
them (transformers' classes built from small configs, diffusers' when installed, a sparse-gradient
recommender): time series (Student-T heads, BatchNorm over transposed tensors, top-k autocorrelation),
speech (Whisper, HuBERT with CTC, AST, Wav2Vec2 classification and x-vectors), video (VideoMAE, TimeSformer),
segmentation, masked autoencoding and masked image modelling, token classification, multiple choice, BERT's
pre-training heads, extractive QA, image captioning (BLIP, a ViT + GPT-2 encoder-decoder), diffusion UNets and
a VAE, embeddings with sparse gradients. CPU target,
micro-batch 2 (the recommender 8), fp32 and bf16 autocast; LayerDrop off (a real step skips layers at random,
the estimate assumes none is skipped and says so). The truths: the CPU allocator's running total and the
profiler's memory timeline of the same real step (benchmarks/truth.py).

    nice -n 10 python benchmarks/heldout_families.py [--only whisper,unet] [--configs fp32,fp16,all]

`--configs` (default fp32,bf16) also takes fp16 (CPU autocast with loss scaling) and all / selective
(fp32, activation checkpointing of every repeated block / selective).

Results: benchmarks/results/heldout_families.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import memfit  # noqa: E402
from truth import allocator_step_peak, real_step_peak  # noqa: E402


def _forecast(n: int, context: int = 27, horizon: int = 12) -> dict:
    return {"past_values": torch.randn(n, context), "past_time_features": torch.randn(n, context, 2),
            "past_observed_mask": torch.ones(n, context), "future_values": torch.randn(n, horizon),
            "future_time_features": torch.randn(n, horizon, 2)}


def _video(n: int) -> dict:
    return {"pixel_values": torch.randn(n, 4, 3, 32, 32), "labels": torch.randint(0, 5, (n,))}


def _vision_encoder_decoder():
    import transformers as T

    encoder = T.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                          image_size=32, patch_size=8)
    decoder = T.GPT2Config(vocab_size=500, n_embd=64, n_layer=2, n_head=4, add_cross_attention=True, is_decoder=True)
    config = T.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id = 1, 0
    return T.VisionEncoderDecoderModel(config)


def _transformers_families() -> dict:
    import transformers as T

    small = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                 encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_layerdrop=0.0, decoder_layerdrop=0.0)
    forecast = dict(prediction_length=12, context_length=24, input_size=1, lags_sequence=[1, 2, 3], num_time_features=2)
    vit = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    bert = dict(vocab_size=500, **vit)
    speech = dict(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2,
                  layerdrop=0.0)
    return {
        "patchtst": (lambda: T.PatchTSTForPrediction(T.PatchTSTConfig(
            num_input_channels=7, context_length=128, patch_length=16, patch_stride=8, prediction_length=24,
            d_model=64, num_attention_heads=4, num_hidden_layers=2, ffn_dim=128)),
            lambda n: {"past_values": torch.randn(n, 128, 7), "future_values": torch.randn(n, 24, 7)}),
        "patchtsmixer": (lambda: T.PatchTSMixerForPrediction(T.PatchTSMixerConfig(
            context_length=64, patch_length=8, patch_stride=8, num_input_channels=3, prediction_length=16,
            d_model=32, num_layers=2)),
            lambda n: {"past_values": torch.randn(n, 64, 3), "future_values": torch.randn(n, 16, 3)}),
        "time_series_transformer": (lambda: T.TimeSeriesTransformerForPrediction(
            T.TimeSeriesTransformerConfig(**forecast, **small)), _forecast),
        "informer": (lambda: T.InformerForPrediction(T.InformerConfig(**forecast, **small)), _forecast),
        "autoformer": (lambda: T.AutoformerForPrediction(T.AutoformerConfig(**forecast, **small)), _forecast),
        "whisper": (lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(
            vocab_size=500, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80,
            max_source_positions=100, max_target_positions=64, pad_token_id=0, decoder_start_token_id=1,
            bos_token_id=1, eos_token_id=2)),
            lambda n: {"input_features": torch.randn(n, 80, 200), "labels": torch.randint(3, 500, (n, 20))}),
        "hubert_ctc": (lambda: T.HubertForCTC(T.HubertConfig(**speech, mask_time_prob=0.0)),
                       lambda n: {"input_values": torch.randn(n, 4000), "labels": torch.randint(1, 32, (n, 30))}),
        "wav2vec2_classification": (
            lambda: T.Wav2Vec2ForSequenceClassification(T.Wav2Vec2Config(**speech, num_labels=3)),
            lambda n: {"input_values": torch.randn(n, 4000), "labels": torch.randint(0, 3, (n,))}),
        "ast": (lambda: T.ASTForAudioClassification(T.ASTConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, max_length=128,
            num_mel_bins=64, num_labels=5)),
            lambda n: {"input_values": torch.randn(n, 128, 64), "labels": torch.randint(0, 5, (n,))}),
        "segformer": (lambda: T.SegformerForSemanticSegmentation(T.SegformerConfig(
            num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
            decoder_hidden_size=32, num_labels=4, patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2])),
            lambda n: {"pixel_values": torch.randn(n, 3, 64, 64), "labels": torch.randint(0, 4, (n, 64, 64))}),
        "vit_mae": (lambda: T.ViTMAEForPreTraining(T.ViTMAEConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32,
            patch_size=4, decoder_hidden_size=32, decoder_num_hidden_layers=1, decoder_num_attention_heads=4,
            decoder_intermediate_size=64)),
            lambda n: {"pixel_values": torch.randn(n, 3, 32, 32)}),
        "bert_multiple_choice": (lambda: T.BertForMultipleChoice(T.BertConfig(**bert)),
                                 lambda n: {"input_ids": torch.randint(0, 500, (n, 4, 32)),
                                            "labels": torch.randint(0, 4, (n,))}),
        "bert_pretraining": (lambda: T.BertForPreTraining(T.BertConfig(**bert)),
                             lambda n: {"input_ids": torch.randint(0, 500, (n, 32)),
                                        "labels": torch.randint(0, 500, (n, 32)),
                                        "next_sentence_label": torch.randint(0, 2, (n,))}),
        "videomae": (lambda: T.VideoMAEForVideoClassification(T.VideoMAEConfig(
            image_size=32, patch_size=8, num_frames=4, tubelet_size=2, num_labels=5, **vit)), _video),
        "timesformer": (lambda: T.TimesformerForVideoClassification(T.TimesformerConfig(
            image_size=32, patch_size=8, num_frames=4, num_labels=5, **vit)), _video),
        "wav2vec2_xvector": (lambda: T.Wav2Vec2ForXVector(T.Wav2Vec2Config(
            **speech, num_labels=3, mask_time_prob=0.0, tdnn_dim=(32, 32, 64), tdnn_kernel=(5, 3, 1),
            tdnn_dilation=(1, 2, 1), xvector_output_dim=32)),
            lambda n: {"input_values": torch.randn(n, 4000), "labels": torch.randint(0, 3, (n,))}),
        "vision_encoder_decoder": (_vision_encoder_decoder,
                                   lambda n: {"pixel_values": torch.randn(n, 3, 32, 32),
                                              "labels": torch.randint(2, 500, (n, 16))}),
        "vit_masked_image_modeling": (lambda: T.ViTForMaskedImageModeling(T.ViTConfig(
            image_size=32, patch_size=4, encoder_stride=4, **vit)),
            lambda n: {"pixel_values": torch.randn(n, 3, 32, 32), "bool_masked_pos": torch.rand(n, 64) > 0.5}),
        "blip_captioning": (lambda: T.BlipForConditionalGeneration(T.BlipConfig(
            text_config=dict(vocab_size=500, **vit), vision_config=dict(image_size=32, patch_size=8, **vit),
            projection_dim=32)),
            lambda n: {"pixel_values": torch.randn(n, 3, 32, 32), "input_ids": torch.randint(3, 500, (n, 16)),
                       "labels": torch.randint(3, 500, (n, 16))}),
        "bert_token_classification": (lambda: T.BertForTokenClassification(T.BertConfig(
            vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            num_labels=5)),
            lambda n: {"input_ids": torch.randint(0, 500, (n, 32)), "labels": torch.randint(0, 5, (n, 32))}),
        "roberta_question_answering": (lambda: T.RobertaForQuestionAnswering(T.RobertaConfig(
            vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)),
            lambda n: {"input_ids": torch.randint(3, 500, (n, 32)), "start_positions": torch.randint(0, 32, (n,)),
                       "end_positions": torch.randint(0, 32, (n,))}),
    }


def _diffusers_families() -> dict:
    try:
        import diffusers as D
    except ImportError:  # not one of memfit's dependencies: `pip install diffusers` to include these rows
        return {}
    return {
        "diffusers_unet2d": (lambda: D.UNet2DModel(
            sample_size=32, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(32, 64),
            down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            norm_num_groups=8),
            lambda n: {"sample": torch.randn(n, 3, 32, 32), "timestep": torch.randint(0, 1000, (n,)),
                       "target": torch.randn(n, 3, 32, 32)}),
        "diffusers_unet2d_condition": (lambda: D.UNet2DConditionModel(
            sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32, norm_num_groups=8, attention_head_dim=8),
            lambda n: {"sample": torch.randn(n, 4, 16, 16), "timestep": torch.randint(0, 1000, (n,)),
                       "encoder_hidden_states": torch.randn(n, 7, 32), "target": torch.randn(n, 4, 16, 16)}),
        "diffusers_vae": (lambda: D.AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), latent_channels=4,
            norm_num_groups=8, sample_size=32),
            lambda n: {"sample": torch.randn(n, 3, 32, 32), "target": torch.randn(n, 3, 32, 32)}),
    }


def _hf_loss(model, batch):
    return model(**batch).loss


def _diffusion_loss(model, batch):
    inputs = {k: v for k, v in batch.items() if k != "target"}
    return F.mse_loss(model(**inputs).sample, batch["target"])


class SparseRecommender(nn.Module):
    """Embedding-bag features with sparse gradients (a DLRM-style table) and a dense head."""

    def __init__(self, rows: int = 100_000, dim: int = 64):
        super().__init__()
        self.table = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
        self.head = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids):
        return self.head(self.table(ids)).squeeze(-1)


class BatchFirstAttention(nn.Module):
    """torch.nn.MultiheadAttention over a batch-first input, its weights returned (the explicit path)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True, dropout=0.1)
        self.head = nn.Linear(64, 100)

    def forward(self, ids):
        x = self.embed(ids)
        return self.head(self.attn(x, x, x, need_weights=True)[0])


def workloads() -> dict:
    out = {}
    for name, (model, batch) in {**_transformers_families(), **_diffusers_families()}.items():
        loss = _diffusion_loss if name.startswith("diffusers") else _hf_loss
        out[name] = (memfit.Workload(model=model, batch=batch, loss=loss, name=name), 2)
    out["torch_multihead_attention"] = (memfit.Workload(
        model=BatchFirstAttention, name="torch_multihead_attention",
        batch=lambda n: (torch.randint(0, 100, (n, 32)), torch.randint(0, 100, (n, 32))),
        loss=lambda m, b: F.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten())), 4)
    for name, optimizer in (("sparse_recommender_sgd", lambda p: torch.optim.SGD(p, lr=0.1)),
                            ("sparse_recommender_adagrad", lambda p: torch.optim.Adagrad(p))):
        out[name] = (memfit.Workload(model=SparseRecommender, optimizer=optimizer, name=name,
                                     batch=lambda n: (torch.randint(0, 100_000, (n, 20)), torch.rand(n)),
                                     loss=lambda m, b: F.mse_loss(m(b[0]), b[1])), 8)
    return out


CONFIGS = {"fp32": {}, "bf16": {"precision": "bf16"}, "fp16": {"precision": "fp16"},
           "all": {"activation_checkpoint": "all"}, "selective": {"activation_checkpoint": "selective"}}


def one(name: str, workload: memfit.Workload, micro_batch: int, kind: str) -> dict:
    row: dict = {"model": name, "config": kind}
    config = memfit.Config(micro_batch=micro_batch, **CONFIGS[kind])
    t0 = time.perf_counter()
    try:
        est = memfit.estimate(workload, config)
    except memfit.MemfitError as e:
        return {**row, "error": f"{type(e).__name__}: {e}"[:300]}
    row.update(method=est.method, seconds=round(time.perf_counter() - t0, 2), estimate=est.peak_bytes,
               allocator=allocator_step_peak(workload, config), timeline=real_step_peak(workload, config),
               notes=est.notes)
    row["error_pct"] = round(100 * (row["estimate"] / row["allocator"] - 1), 4)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated names (default: all)")
    ap.add_argument("--configs", default="fp32,bf16", help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--out", default=str(HERE / "results" / "heldout_families.json"))
    args = ap.parse_args()
    table = workloads()
    rows = []
    for kind in args.configs.split(","):
        for name in args.only.split(",") if args.only else table:
            wl, micro_batch = table[name]
            row = one(name, wl, micro_batch, kind)
            rows.append(row)
            shown = (f"{row['method']:9s} {row['error_pct']:+8.3f}%  {row['estimate']:>11,} vs {row['allocator']:>11,} "
                     f"(timeline {row['timeline']:,})" if "error_pct" in row else row["error"])
            print(f"{name:28s} {kind:9s}  {shown}", flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    done = [r for r in rows if "error_pct" in r]
    fake = [r for r in done if r["method"] == "fake"]
    within = [r for r in done if abs(r["error_pct"]) <= 1]
    print(f"{len(within)} of {len(done)} within 1% of the allocator; {len(fake)} traced on fake tensors")


if __name__ == "__main__":
    main()
