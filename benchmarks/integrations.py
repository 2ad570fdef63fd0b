"""memfit inside other stacks' loops: the predicted peak of Hugging Face `Trainer.train()` and Lightning
`Trainer.fit()` against the CPU allocator's profiled peak over the whole run (benchmarks/truth_stacks.py),
per configuration, and the arguments `fit_training_args` returns under budgets, run for real.

    nice -n 10 python benchmarks/integrations.py [--quick] [--out benchmarks/results/integrations.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import transformers  # noqa: E402

from memfit.integrations.transformers import estimate_training_args, fit_training_args  # noqa: E402
from truth_stacks import FeatureRows, TokenRows, run_peak, trainer_peak  # noqa: E402

SEQ = 256
MODELS = {  # 4 layers, hidden 256, an 8,000-token vocabulary: 5-7M parameters
    "Llama": (lambda: transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                               num_attention_heads=8, num_key_value_heads=4, vocab_size=8000),
              transformers.AutoModelForCausalLM, False),
    "BERT": (lambda: transformers.BertConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                             num_attention_heads=8, vocab_size=8000, max_position_embeddings=SEQ),
             transformers.AutoModelForMaskedLM, True),
}
# TrainingArguments beyond the common ones: each memory-deciding setting the issue names
CASES = [
    dict(per_device_train_batch_size=8, optim="adamw_torch"),
    dict(per_device_train_batch_size=8),  # adamw_torch_fused, the default
    dict(per_device_train_batch_size=8, bf16=True),
    dict(per_device_train_batch_size=8, bf16=True, activation_checkpointing=True),
    dict(per_device_train_batch_size=4, gradient_accumulation_steps=4, activation_checkpointing=True,
         activation_checkpointing_kwargs={"every_n_layers": 2}),
    dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=0.0),
    dict(per_device_train_batch_size=8, optim="adafactor"),
    dict(per_device_train_batch_size=8, optim="sgd"),
]
FITS = [("Llama", dict(per_device_train_batch_size=32), "256MiB", ()),
        ("Llama", dict(per_device_train_batch_size=32), "160MiB", ("bf16",)),
        ("BERT", dict(per_device_train_batch_size=32, max_grad_norm=0.0), "192MiB", ())]


def _args(folder, **kw):
    base = dict(use_cpu=True, max_steps=3, report_to="none", save_strategy="no", logging_strategy="no",
                disable_tqdm=True)
    return transformers.TrainingArguments(folder, **{**base, **kw})


def trainer_rows(cases, folder) -> list[dict]:
    rows = []
    for name, (config, auto, masked) in MODELS.items():
        cfg = config()

        def make():
            return auto.from_config(cfg)

        for kw in cases:
            args = _args(folder, **kw)
            t = time.perf_counter()
            est = estimate_training_args(make(), args, seq_len=SEQ, device="cpu")
            seconds = time.perf_counter() - t
            truth, _ = trainer_peak(make, args, TokenRows(cfg.vocab_size, SEQ, masked=masked))
            rows.append(dict(model=name, args={k: v for k, v in kw.items()}, predicted=est.peak_bytes, profiled=truth,
                             diff_bytes=est.peak_bytes - truth, phase=est.peak_phase, estimate_seconds=seconds))
            print(rows[-1], flush=True)
    return rows


def fit_rows(fits, folder) -> list[dict]:
    rows = []
    for name, kw, budget, allow in fits:
        config, auto, masked = MODELS[name]
        cfg = config()

        def make():
            return auto.from_config(cfg)

        t = time.perf_counter()
        args, plan = fit_training_args(make(), _args(folder, **kw), seq_len=SEQ, device="cpu", budget=budget,
                                       allow=allow)
        seconds = time.perf_counter() - t
        truth, _ = trainer_peak(make, args, TokenRows(cfg.vocab_size, SEQ, masked=masked))
        rows.append(dict(model=name, asked=kw, budget=budget, allow=list(allow), chosen=plan.config.describe(),
                         usable=plan.usable_bytes, predicted=plan.peak_bytes, profiled=truth,
                         diff_bytes=plan.peak_bytes - truth, plan_seconds=seconds))
        print(rows[-1], flush=True)
    return rows


def lightning_rows() -> list[dict]:
    import lightning.pytorch as L

    sys.path.insert(0, str(HERE.parent / "examples"))
    from memfit.integrations.lightning import MemfitBatchSize

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    from lightning_fit import Net  # the README's example module, batch 512

    class Lazy(Net):  # its rows made when read: the example's TensorDataset (4 MiB) is data, not the step
        def train_dataloader(self):
            return torch.utils.data.DataLoader(FeatureRows(256, 10), batch_size=self.batch_size)

    rows = []
    for precision, clip, budget in [("32-true", 1.0, "17MiB"), ("bf16-mixed", None, "14MiB"), ("32-true", None, "64MiB")]:
        callback = MemfitBatchSize(budget=budget, device="cpu")

        def run():
            model = Lazy()
            trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, precision=precision,
                                gradient_clip_val=clip, callbacks=[callback])
            trainer.fit(model)
            return model, trainer

        truth, (model, trainer) = run_peak(run)
        rows.append(dict(precision=precision, clip=clip, budget=budget, chosen=callback.plan.config.describe(),
                         predicted=callback.plan.peak_bytes, profiled=truth,
                         diff_bytes=callback.plan.peak_bytes - truth))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="two Trainer cases and one fit")
    parser.add_argument("--only", choices=("lightning",), help="only these rows, merged into --out's file")
    parser.add_argument("--out", default=str(HERE / "results" / "integrations.json"))
    opts = parser.parse_args()
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if opts.only:
        result = json.loads(Path(opts.out).read_text())
        result["lightning"] = lightning_rows()
        Path(opts.out).write_text(json.dumps(result, indent=1))
        return
    with tempfile.TemporaryDirectory() as folder:
        result = dict(torch=torch.__version__, transformers=transformers.__version__, seq=SEQ,
                      threads=torch.get_num_threads(), date=time.strftime("%Y-%m-%d"),
                      trainer=trainer_rows(CASES[:2] if opts.quick else CASES, folder),
                      fit=fit_rows(FITS[:1] if opts.quick else FITS, folder), lightning=lightning_rows())
    Path(opts.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
