"""memfit inside other stacks' loops: the predicted peak of Hugging Face `Trainer.train()` and Lightning
`Trainer.fit()` against the CPU allocator's profiled peak over the whole run (benchmarks/truth_stacks.py),
per configuration, the arguments `fit_training_args` returns under budgets, run for real, and Trainer's FSDP2
on two gloo ranks against memfit's trace of rank 0.

    nice -n 10 python benchmarks/integrations.py [--quick] [--only lightning|fsdp]
        [--out benchmarks/results/integrations.json]
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


def fsdp_rank_peaks(make_model, kw: dict, dataset, folder: str, world: int = 2) -> list[int]:
    """Trainer's own FSDP2 `train()` with the arguments `kw` (and `fsdp=True`) on `world` real CPU ranks (forked,
    gloo): each rank's lowest peak over its steady steps (the second on, marked by a callback's
    `record_function`). Two running totals bound a rank's own memory from above, and the lower of them at each
    allocation is taken: the CPU allocator's, which also counts the buffers gloo's thread allocates inside its
    collectives (NCCL works in the collectives' outputs, so a GPU rank has none), and the bytes the training
    thread allocated and has not freed, which keeps a tensor gloo's thread freed (unseen by the profiler, which
    records this thread) until its block is allocated again.
    Accelerate shards with FSDP only on accelerators and trains CPU processes with DDP, so the distributed type
    is set to FSDP once Trainer has built its Accelerator (the plugin made from the arguments, its mixed
    precision set as AcceleratorState sets it); everything after, `accelerator.prepare` and the step, is
    Trainer's and Accelerate's own code. On CPU ranks Trainer copies each micro-batch to the device 'cpu:0' (the
    same memory, another device index), which a GPU run does not."""
    import copy
    import gc
    import os

    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    from memfit.torch_internals import profiler_allocations
    from truth import on_gloo_ranks

    def rank_main(rank: int) -> int:
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
        args = _args(f"{folder}/rank{rank}", fsdp=True, **copy.deepcopy(kw))

        class OnCpuRanks(transformers.Trainer):
            def create_accelerator_and_postprocess(self):
                super().create_accelerator_and_postprocess()
                state = self.accelerator.state
                plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
                if state.mixed_precision != "no":
                    plugin.set_mixed_precision(state.mixed_precision)
                state.distributed_type, state.fsdp_plugin, self.is_fsdp_enabled = DistributedType.FSDP, plugin, True
                PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # else reset before train()
                if not self.accelerator.is_fsdp2:
                    raise RuntimeError("Accelerate's distributed type is not FSDP2")

        class Steps(transformers.TrainerCallback):
            def on_step_begin(self, *_, **__):
                self.mark = record_function("memfit.truth.step")
                self.mark.__enter__()

            def on_step_end(self, *_, **__):
                self.mark.__exit__(None, None, None)

        gc.collect()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            torch.manual_seed(0)
            trainer = OnCpuRanks(model=make_model(), args=args, train_dataset=dataset, callbacks=[Steps()])
            trainer.train()
        if type(trainer.model).__name__ != f"FSDP{type(make_model()).__name__}":
            raise RuntimeError(f"Trainer did not shard the model with FSDP2: {type(trainer.model).__name__}")
        windows, events = profiler_allocations(prof, "memfit.truth.step")
        base = events[0][2] - events[0][1]
        running, held, live = [], {}, 0  # what this thread allocated under the profile and has not freed
        for t, size, total, _, ptr in events:
            if size > 0:
                live += size - held.get(ptr, 0)  # a block allocated again was freed, on another thread
                held[ptr] = size
            elif ptr in held:
                live -= held.pop(ptr)
            running.append((t, min(total - base, live)))
        peaks = [max(n for t, n in running if start <= t <= end) for start, end in windows]
        return min(peaks[1:])

    return on_gloo_ranks(world, rank_main)


SYNC_EACH_BATCH = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}  # reduce after every micro-batch
FSDP_CASES = [dict(per_device_train_batch_size=4),
              dict(per_device_train_batch_size=4, bf16=True),
              dict(per_device_train_batch_size=4, bf16=True,
                   fsdp_config={"version": 2, "reshard_after_forward": False}),
              dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, bf16=True,
                   activation_checkpointing=True),
              dict(per_device_train_batch_size=2, gradient_accumulation_steps=2),
              dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, accelerator_config=SYNC_EACH_BATCH)]
RACE_RUNS = 6  # gloo's worker thread may still hold a finished collective's buffers: the lowest of a few runs


def fsdp_rows(cases, folder) -> list[dict]:
    """Trainer's FSDP2 on 2 gloo ranks against memfit's trace of rank 0 (Accelerate's own sharding on a fake
    world), the Llama above; each rank's peak is its lowest over RACE_RUNS runs, and the difference is taken
    to the lower rank (the ranks hold equal shards)."""
    from memfit.integrations.transformers import _with_loader, config_of, trainer_workload
    from memfit.memory.devices import get_device

    config, auto, _ = MODELS["Llama"]
    cfg = config()

    def make():
        return auto.from_config(cfg)

    rows = []
    for kw in cases:
        kw = {"fsdp_config": {"version": 2}, **kw}
        asked = json.loads(json.dumps(kw))  # TrainingArguments rewrites fsdp_config in place
        args = _args(folder, fsdp=True, **kw)
        t = time.perf_counter()
        # Trainer runs DDP on a CPU (estimate_training_args refuses it): the CPU trace of the FSDP2 step itself
        est = _with_loader(trainer_workload(make(), args, seq_len=SEQ, gpus=2), config_of(args, 2), get_device("cpu"))
        seconds = time.perf_counter() - t
        data = TokenRows(cfg.vocab_size, SEQ)
        peaks = fsdp_rank_peaks(make, kw, data, folder)
        for _ in range(RACE_RUNS - 1):
            peaks = [min(a, b) for a, b in zip(peaks, fsdp_rank_peaks(make, kw, data, folder))]
        rows.append(dict(model="Llama", args=asked, layout=config_of(args, 2).data_parallel, predicted=est.peak_bytes,
                         rank_peaks=peaks, diff_bytes=est.peak_bytes - min(peaks), phase=est.peak_phase,
                         copy_bytes=2 * kw["per_device_train_batch_size"] * SEQ * 8, estimate_seconds=seconds))
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
    parser.add_argument("--only", choices=("lightning", "fsdp"), help="only these rows, merged into --out's file")
    parser.add_argument("--out", default=str(HERE / "results" / "integrations.json"))
    opts = parser.parse_args()
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if opts.only:
        result = json.loads(Path(opts.out).read_text())
        with tempfile.TemporaryDirectory() as folder:
            result[opts.only] = lightning_rows() if opts.only == "lightning" else fsdp_rows(FSDP_CASES, folder)
        Path(opts.out).write_text(json.dumps(result, indent=1))
        return
    with tempfile.TemporaryDirectory() as folder:
        result = dict(torch=torch.__version__, transformers=transformers.__version__, seq=SEQ,
                      threads=torch.get_num_threads(), date=time.strftime("%Y-%m-%d"),
                      trainer=trainer_rows(CASES[:2] if opts.quick else CASES, folder),
                      fit=fit_rows(FITS[:1] if opts.quick else FITS, folder), lightning=lightning_rows(),
                      fsdp=fsdp_rows(FSDP_CASES[:1] if opts.quick else FSDP_CASES, folder))
    Path(opts.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
