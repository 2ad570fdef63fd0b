"""Hugging Face Trainer with the batch size, accumulation and checkpointing memfit fits to a budget: the
global batch stays 32 (python examples/hf_trainer.py; a tiny Llama from its config, 3 steps on the CPU)."""
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

from memfit.integrations.transformers import fit_training_args


class Rows(torch.utils.data.Dataset):  # random token rows; the model shifts its labels itself
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        ids = torch.randint(0, 1000, (64,))
        return {"input_ids": ids, "labels": ids.clone()}


transformers.logging.set_verbosity_error()
config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=1000)
model = AutoModelForCausalLM.from_config(config)
wanted = TrainingArguments("runs/hf", per_device_train_batch_size=32, max_steps=3, use_cpu=True, report_to="none",
                           save_strategy="no", disable_tqdm=True)
args, plan = fit_training_args(model, wanted, seq_len=64, device="cpu", budget="40MiB")
print(f"{args.per_device_train_batch_size} x {args.gradient_accumulation_steps}, checkpointing "
      f"{args.gradient_checkpointing}: predicted peak {plan.peak_bytes / 2**20:.1f} MiB")
Trainer(model=model, args=args, train_dataset=Rows()).train()
