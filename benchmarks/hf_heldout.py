"""Estimate vs the profiler on 115 transformers architectures no test of memfit's uses: each default config
shrunk to a toy (every size field the config has set small: hidden 64, 2 layers, 4 heads, ffn 128, vocab 1000,
...), CPU target, micro-batch 2, seq 64 (image models at their config's image size), fp32 and bf16 autocast. The
truth is benchmarks/truth.py (the profiler's memory timeline of the same real step). A row is an error where
the shrunk config does not build or train (a shrink that breaks the model's own constraints), not memfit's.

    nice -n 10 python benchmarks/hf_heldout.py [--only bart,led] [--precisions fp32,bf16]

`--task classification` / `--task image-text` trains that head instead, on every model type of its table
(sequence classification: seq 64; vision-language: seq 128, one image per row).

Results: benchmarks/results/hf_heldout.json (hf_heldout_classification.json, hf_heldout_image_text.json).
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import memfit  # noqa: E402
from memfit.memory.isolate import available_host_bytes  # noqa: E402
from truth import real_step_peak  # noqa: E402

ARCHITECTURES = (
    "gpt_neox,falcon,phi,gemma,mistral,opt,bloom,gptj,gpt_bigcode,codegen,ctrl,biogpt,xglm,mpt,persimmon,stablelm,"
    "starcoder2,olmo,cohere,qwen3,granite,jetmoe,granitemoe,imagegpt,"  # causal
    "roberta,deberta-v2,electra,albert,distilbert,xlm-roberta,mpnet,convbert,squeezebert,mobilebert,megatron-bert,"
    "nystromformer,rembert,ernie,"  # masked
    "bart,pegasus,mbart,mt5,umt5,switch_transformers,led,bigbird_pegasus,plbart,blenderbot,m2m_100,"  # seq2seq
    "deit,beit,dinov2,convnextv2,regnet,levit,mobilevit,cvt,poolformer,mobilenet_v1,mobilenet_v2,vit_msn,"
    "data2vec-vision,focalnet,pvt,segformer,bit"  # image
).split(",") + (  # added at stop 31, picked from those the shrink builds and trains
    "gemma2,gemma3_text,olmo2,gpt_oss,cohere2,helium,exaone4,falcon_h1,recurrent_gemma,lfm2,minimax,phimoe,"
    "llama4_text,nemotron_h,seed_oss,gpt_neo,openai-gpt,diffllama,doge,vaultgemma,internlm3,"  # causal
    "big_bird,camembert,deberta,flaubert,longformer,luke,mra,roformer,tapas,xlm,xmod,nomic_bert,roc_bert,"
    "layoutlm,"  # masked
    "fsmt,longt5,mvp,pegasus_x,nllb-moe,blenderbot-small,"  # seq2seq
    "hiera,pvt_v2,ijepa,mobilevitv2,textnet,hgnet_v2,swiftformer,dinov2_with_registers"  # image
).split(",")
SMALL = dict(hidden_size=64, d_model=64, n_embd=64, embed_dim=64, dim=64, num_hidden_layers=2, num_layers=2, n_layer=2,
             n_layers=2, encoder_layers=2, decoder_layers=2, num_decoder_layers=2, num_attention_heads=4, n_head=4,
             n_heads=4, num_heads=4, encoder_attention_heads=4, decoder_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, ffn_dim=128, encoder_ffn_dim=128, decoder_ffn_dim=128, d_ff=128, n_inner=128,
             vocab_size=1000, max_position_embeddings=256, n_positions=256, head_dim=16, d_kv=16,
             num_local_experts=4, num_experts=4, moe_intermediate_size=64, embedding_size=64, rotary_dim=8,
             depth=2, out_hidden_size=64, projection_dim=64, mm_tokens_per_image=4)
TIMEOUT = 120


def toy(model_type: str):
    """The default config with every integer size field it has set to SMALL's value, nested configs (a
    vision-language model's text and vision models) too, a nested vision model's images 4 patches a side,
    and token ids moved into the small vocabulary (an embedding refuses a padding index outside it)."""
    import transformers

    cfg = shrink(transformers.AutoConfig.for_model(model_type), nested=False)
    _special_ids_in_vocab(cfg)
    return cfg


def _special_ids_in_vocab(cfg) -> None:
    """Token ids a shrunk config names (image and vision-span tokens of a vision-language model sit at its
    top level) moved into the small vocabulary: each distinct one past it to the top ids, kept apart."""
    import transformers

    configs, moved = [cfg], {}
    for c in configs:
        configs += [v for v in vars(c).values() if isinstance(v, transformers.PretrainedConfig)]
    vocab = SMALL["vocab_size"]
    for c in configs:
        for name, value in list(vars(c).items()):
            if (name.endswith("_token_id") or name.endswith("_token_index")) and isinstance(value, int) \
                    and not isinstance(value, bool) and value >= vocab:
                setattr(c, name, moved.setdefault(value, vocab - 1 - len(moved)))


def shrink(cfg, nested: bool, mrope: bool = False):
    import transformers

    tile = getattr(getattr(cfg, "vision_config", None), "image_size", None)
    mrope = mrope or _reads_mrope(cfg.model_type)  # GLM-4V's text config names no sections; its code has them
    for name, sub in list(vars(cfg).items()):
        if isinstance(sub, transformers.PretrainedConfig):
            shrink(sub, nested=True, mrope=mrope)
    pinpoints = getattr(cfg, "image_grid_pinpoints", None)
    if pinpoints and isinstance(tile, int):  # "anyres" grids (LLaVA-NeXT) in units of the shrunk tile
        small = cfg.vision_config.image_size
        cfg.image_grid_pinpoints = [[h * small // tile, w * small // tile] for h, w in pinpoints]
    patch, size = getattr(cfg, "patch_size", None), getattr(cfg, "image_size", None)
    patch = patch[0] if isinstance(patch, (list, tuple)) and patch else patch
    if nested and isinstance(patch, int) and isinstance(size, (int, list, tuple)):  # an image classifier keeps its size
        cfg.image_size = 4 * patch if isinstance(size, int) else type(size)([4 * patch] * len(size))
    rope = getattr(cfg, "rope_parameters", None)
    # M-RoPE splits the rotary half of the head (SMALL's head_dim, 16) into sections (Qwen2-VL's code defaults
    # to [16, 24, 24] where none is set): [2, 3, 3], or [2, 1, 1] where only half the head rotates
    if isinstance(rope, dict) and (isinstance(rope.get("mrope_section"), list) or "_vl" in cfg.model_type or mrope):
        half = int(SMALL["head_dim"] * rope.get("partial_rotary_factor", 1.0)) // 2
        rope["mrope_section"] = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8][
            :len(rope.get("mrope_section", [0] * 3))]
    for name, value in SMALL.items():
        current = getattr(cfg, name, None)
        if isinstance(current, int) and not isinstance(current, bool):
            setattr(cfg, name, value)
    experts = getattr(cfg, "n_routed_experts", None) or getattr(cfg, "num_experts", None)
    if isinstance(experts, int) and (getattr(cfg, "num_experts_per_tok", None) or 0) > experts:  # top-8 of 4 kept
        cfg.num_experts_per_tok = 2
    return cfg


def _reads_mrope(model_type: str) -> bool:
    """Whether the model's code splits rotary frequencies into M-RoPE sections (a default it keeps there)."""
    import importlib
    import inspect

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    try:
        module = importlib.import_module(f"transformers.models.{model_type_to_module_name(model_type)}")
        modeling = importlib.import_module(f"{module.__name__}.modeling_{module.__name__.rsplit('.', 1)[1]}")
        return "mrope_section" in inspect.getsource(modeling)
    except Exception:  # noqa: BLE001 - no such module: nothing to shrink
        return False


def table(task: str) -> list[str]:
    """Every model type of transformers' table for `task` (classification, image-text, ...)."""
    from memfit.workloads import hf

    return sorted(hf._task_tables()[task])


def one(model_type: str, precision: str, task: str | None = None) -> dict:
    from memfit.workloads import hf

    row = {"arch": model_type, "precision": precision, **({"task": task} if task else {})}
    try:
        cfg = toy(model_type)
        task = task or hf.pick_task(cfg)
        wl = hf.from_config(cfg, name=f"hf:{model_type}", task=task,
                            **({} if task == "image" else {"seq": 128} if task == "image-text" else {"seq": 64}))
        config = memfit.Config(micro_batch=2, precision=precision)
        try:
            est = memfit.estimate(wl, config)
        except memfit.errors.MicroBatchError as e:
            config = config.replace(micro_batch=e.smallest)
            est = memfit.estimate(wl, config)
        if est.peak_bytes > 0.25 * available_host_bytes():  # the shrink missed nested configs (T5Gemma's)
            raise MemoryError(f"not shrunk: the estimate is {est.peak_bytes / 2**30:.1f} GiB, too much to run here")
        truth = real_step_peak(wl, config)
    except Exception as e:  # noqa: BLE001 - the row says what failed
        text = str(e).strip()
        return {**row, "error": f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:200]}
    return {**row, "micro_batch": config.micro_batch, "method": est.method, "estimate": est.peak_bytes,
            "profiler": truth, "error_pct": round(100 * (est.peak_bytes - truth) / truth, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated model types (default: ARCHITECTURES)")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--task", help="train this head (classification, image-text, ...): every model type of "
                                   "transformers' table for it unless --only")
    ap.add_argument("--out", default=str(HERE / "results" / "hf_heldout.json"))
    args = ap.parse_args()

    def too_long(*_):
        raise TimeoutError(f"over {TIMEOUT} s")

    signal.signal(signal.SIGALRM, too_long)
    rows = []
    for precision in args.precisions.split(","):
        for arch in (args.only.split(",") if args.only else table(args.task) if args.task else ARCHITECTURES):
            signal.alarm(TIMEOUT)
            try:
                row = one(arch, precision, args.task)
            except TimeoutError as e:
                row = {"arch": arch, "precision": precision, "error": str(e)}
            finally:
                signal.alarm(0)
            rows.append(row)
            shown = (f"{row['error_pct']:+8.3f}%  {row['estimate']:>12,} vs {row['profiler']:>12,}"
                     if "error_pct" in row else row["error"])
            print(f"{arch:20s} {precision}  {shown}", flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    done = [r for r in rows if "error_pct" in r]
    within = [r for r in done if abs(r["error_pct"]) <= 1]
    print(f"{len(within)} of {len(done)} within 1% ({len(rows) - len(done)} did not build or train as shrunk)")


if __name__ == "__main__":
    main()
