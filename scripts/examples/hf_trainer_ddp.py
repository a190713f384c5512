"""A Hugging Face causal LM with the exact factored head, trained by the HF ``Trainer`` on
one or several processes (docs/integrations.md, "Several processes").

The same script runs alone or under a launcher; each process trains the body under DDP
(gloo on CPU, NCCL on GPUs) and the head in its multi-process mode (``--parallel``:
``replicated``, every rank holds the whole head; ``sharded``, each rank holds V's rows of
D / P classes). The model is a tiny random-init ``LlamaForCausalLM`` (nothing
downloaded); the corpus hf_causal_lm.py's noisy cyclic walk over the vocabulary, padded (-100).

    python scripts/examples/hf_trainer_ddp.py --out outputs/examples/hf_ddp
    torchrun --standalone --nproc_per_node 2 scripts/examples/hf_trainer_ddp.py --out outputs/examples/hf_ddp
    accelerate launch --cpu --num_processes 2 scripts/examples/hf_trainer_ddp.py --out ...

``--batch-size`` is per process (the global batch is world x batch size); ``--resume``
continues from the newest checkpoint in ``--out``. Rank 0 writes ``results.json``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from hf_causal_lm import corpus  # this folder is on sys.path when the script runs

from lst_lightning.integrations import factor_lm_head, head_follows_trainer


class Walks(Dataset):
    """hf_causal_lm.py's corpus (a noisy cyclic walk, padded) as the Trainer's dict rows."""

    def __init__(self, vocab: int, n: int, length: int, seed: int = 0):
        self.ids, self.mask = corpus(vocab, n, length, seed).tensors

    def __len__(self):
        return self.ids.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i],
                "labels": self.ids[i].masked_fill(self.mask[i] == 0, -100)}


def main(argv=None, callbacks=()) -> dict:
    """Trains and returns the run's summary; ``callbacks``: more ``TrainerCallback``s (a benchmark's meter)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--parallel", choices=["replicated", "sharded"], default="replicated")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-steps", type=int, default=10, help="0: no checkpoints")
    p.add_argument("--batch-size", type=int, default=4, help="per process")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--head-lr", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--resume", action="store_true", help="from the newest checkpoint in --out")
    a = p.parse_args(argv)

    torch.manual_seed(0)  # the same initial body on every rank
    config = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    model = factor_lm_head(LlamaForCausalLM(config), loss="spherical_softmax", lr=a.head_lr, parallel=a.parallel)
    args = TrainingArguments(output_dir=a.out, per_device_train_batch_size=a.batch_size,
                             gradient_accumulation_steps=a.accumulate, max_steps=a.steps, learning_rate=a.lr,
                             lr_scheduler_type="linear", save_strategy="steps" if a.save_steps else "no",
                             save_steps=a.save_steps or 500,
                             logging_steps=1, report_to=[], use_cpu=not torch.cuda.is_available(),
                             disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Walks(a.vocab, 1024, a.seq_len),
                      callbacks=[head_follows_trainer(), *callbacks])
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    head = model.lm_head
    out = {"world_size": args.world_size, "parallel": a.parallel, "steps": trainer.state.global_step,
           "head_steps": int(head.steps), "rows": [head.row_lo, head.row_hi],
           "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    if args.process_index == 0:
        Path(a.out, "results.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # closed before the interpreter exits, which would abort gloo's group
        torch.distributed.destroy_process_group()
