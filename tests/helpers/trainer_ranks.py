"""The Hugging Face Trainer on two gloo processes (CPU), as torchrun starts it: a tiny
float64 Llama patched by ``factor_lm_head``, trained by the Trainer with
``head_follows_trainer()``; and the same training in one process, the reference.
Used by tests/integrations/test_trainer_processes.py."""
import contextlib
import os
from pathlib import Path

import torch
from torch.utils.data import Dataset

VOCAB, HIDDEN, T = 96, 16, 10
WORLD = 2


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).double()


class Texts(Dataset):
    """Rows of T ids, right-padded to lengths T - (s % 5): the ranks hold different numbers of tokens."""

    def __init__(self, n: int = 64):
        self.rows = []
        for s in range(n):
            g = torch.Generator().manual_seed(1000 + s)
            ids = torch.randint(0, VOCAB // 3, (T,), generator=g)  # a small range: tokens repeat
            mask = (torch.arange(T) < T - s % 5).long()
            self.rows.append(dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def as_a_fresh_launch():
    """No process group until the Trainer makes one, as in a process torchrun has just started:
    the head is built alone and joins the group when training begins (after a checkpoint loads)."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState

    if dist.is_initialized():
        dist.destroy_process_group()
    AcceleratorState._reset_state(reset_partial_state=True)


def train(out, parallel="replicated", batch_size=2, accumulate=1, steps=3, save_steps=None, resume=None,
          tokens_over_world=True, bad_rank=None, count_reads=False, lr=0.5):
    """One Trainer run; returns the model's state (a sharded V gathered whole on rank 0), the
    logged losses and the head's state hash; ``count_reads``: the package's host reads during
    ``train()`` too (``reads``, ``read_sites``), and their count and sites at the end of the first
    optimizer step (``reads_first``, ``sites_first``: the head joins the process group and the
    ranks agree on their rows' capacity in it) and their count at the end of each step
    (``reads_by_step``; the flags' last read comes after, at the end of training)."""
    from host_reads import HostReads
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from lst_lightning.integrations import export_dense_head, factor_lm_head, head_follows_trainer

    if "WORLD_SIZE" in os.environ:
        as_a_fresh_launch()
    model = factor_lm_head(tiny_llama(), loss="zloss", lr=lr, dtype=torch.float64, parallel=parallel)
    if bad_rank is not None and int(os.environ.get("RANK", "0")) == bad_rank:
        def bad_label(module, args, kwargs):
            kwargs["labels"] = kwargs["labels"].clone()
            kwargs["labels"][0, 3] = VOCAB + 7  # no such class
            return args, kwargs
        model.register_forward_pre_hook(bad_label, with_kwargs=True)
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=batch_size,
                             gradient_accumulation_steps=accumulate, max_steps=steps, learning_rate=1e-2,
                             lr_scheduler_type="linear", report_to=[], use_cpu=True,
                             ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
                             save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
                             logging_steps=1, disable_tqdm=True, seed=0, per_device_eval_batch_size=batch_size,
                             average_tokens_across_devices=tokens_over_world)
    head = model.lm_head
    at_start = []  # the head's steps at the first training forward (3 after resuming from checkpoint-3)
    model.register_forward_pre_hook(lambda module, args: at_start.append(int(head.steps)) if not at_start else None)
    try:
        reads = HostReads() if count_reads else None
        by_step, first = [], {}

        class CountReads(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if reads is not None:
                    by_step.append(reads.count)
                    if state.global_step == 1:
                        first.update(reads_first=reads.count, sites_first=dict(reads.sites))

        trainer = Trainer(model=model, args=args, train_dataset=Texts(),
                          callbacks=[head_follows_trainer(), CountReads()])
        with reads if count_reads else contextlib.nullcontext():
            trainer.train(resume_from_checkpoint=resume)
    except ValueError as e:
        return {"error": str(e), "steps": int(head.steps), "hash": head.state_hash()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    whole = head.gather_v()
    if whole is not None:
        state["lm_head.V"] = whole
    result = {"state": state, "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
              "hash": head.state_hash(), "rows": (head.row_lo, head.row_hi), "steps_at_start": at_start[0]}
    if count_reads:
        result.update(reads=reads.count, read_sites=dict(reads.sites), reads_by_step=by_step, **first)
    trainer.save_model(str(out_dir := Path(str(out)) / "final"))  # rank 0 writes it: a sharded head's V whole
    if head.sharded and trainer.args.process_index == 0:
        from safetensors.torch import load_file

        saved = load_file(str(out_dir / "model.safetensors"))
        result["saved_v"], result["saved_weight"] = saved["lm_head.V"], saved["lm_head.weight"]
    result["eval_loss"] = trainer.evaluate(Texts(12))["eval_loss"]  # the world's rows, the local loss each
    model.eval()  # the logits o = W h of all D classes (a sharded head: every rank's classes gathered)
    first = Texts()[0]
    with torch.no_grad():
        result["logits"] = model(input_ids=first["input_ids"][None],
                                 attention_mask=first["attention_mask"][None]).logits
    result["exported"] = export_dense_head(model).lm_head.weight.detach().clone()
    return result


def runs(out):
    """Every two-process case, in one process group; their results by name."""
    res = {}
    for parallel in ("replicated", "sharded"):
        res[f"{parallel}_batch"] = train(out / f"{parallel}_batch", parallel)
        res[f"{parallel}_accumulated"] = train(out / f"{parallel}_acc", parallel, accumulate=2, steps=6,
                                               save_steps=3)
        res[f"{parallel}_resumed"] = train(out / f"{parallel}_resumed", parallel, accumulate=2, steps=6,
                                           save_steps=3, resume=str(out / f"{parallel}_acc" / "checkpoint-3"))
        res[f"{parallel}_reads"] = train(out / f"{parallel}_reads", parallel, accumulate=2, steps=6, count_reads=True)
    res["tokens_per_process"] = train(out / "per_process", accumulate=2, steps=6, tokens_over_world=False)
    res["bad_label"] = train(out / "bad", bad_rank=1)
    res["no_parallel_mode"] = train(out / "none", "none")
    res["out"] = out  # where the checkpoints are, for one process to resume from
    return res


#: optimizer steps of the runs whose host reads are counted at the default read interval
LONG_STEPS = 64


def long_runs(out):
    """The host reads of LONG_STEPS optimizer steps of 2 micro-batches, replicated and sharded."""
    return {parallel: train(out / f"{parallel}_long", parallel, accumulate=2, steps=LONG_STEPS, count_reads=True)
            for parallel in ("replicated", "sharded")}


def worker(rank, port, out, cases=runs):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), RANK=str(rank),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    res = cases(out)
    torch.save(res, out / f"rank{rank}.pt")


def long_worker(rank, port, out):
    worker(rank, port, out, long_runs)
