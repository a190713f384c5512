"""A Hugging Face causal LM with the exact factored spherical head in place of its output
layer, trained by a plain Lightning script (docs/training_loop.md, docs/integrations.md).

The model is a ``transformers`` ``LlamaForCausalLM`` made from a tiny config (random init,
nothing downloaded); ``factor_lm_head`` (lst_lightning.integrations) puts
``FactoredSphericalHead`` in place of its ``lm_head`` (a d x V linear layer trained through
V logits per token): the model's own forward then returns the head's loss on its shifted
labels, updating the head in O(d^2) per token. The body is compiled (``torch.compile``),
trained under mixed precision, checkpointed and resumed. The corpus is synthetic:
sequences of a noisy cyclic walk over the vocabulary, of varying length, padded (label
-100: the padded tokens count for nothing).

    uv sync --extra hf    # or the dev group
    python scripts/examples/hf_causal_lm.py --steps 40 --out outputs/examples/hf
    python scripts/examples/hf_causal_lm.py --steps 80 --resume outputs/examples/hf/last.ckpt --out ...

``--compile-backend``: ``inductor`` (the default; on CPU it needs a C compiler),
``aot_eager`` or ``eager`` (cheap, for tests), ``none``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

from lst_lightning.integrations import factor_lm_head

PAD = -100  # transformers' padding label


def corpus(vocab: int, n: int, length: int, seed: int) -> TensorDataset:
    """n sequences of a walk token -> token + 1 + (noise in {0, 1}) mod vocab, of lengths
    length/2..length, right-padded: input ids (pad id 0), attention mask, targets (-1 on padding)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    steps = 1 + (torch.rand(n, length - 1, generator=g) < 0.2).long()
    ids = (start + torch.cat([torch.zeros(n, 1, dtype=torch.long), steps.cumsum(1)], 1)) % vocab
    lengths = torch.randint(length // 2, length + 1, (n,), generator=g)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    return TensorDataset(ids.masked_fill(~mask, 0), mask.long())


class CausalLM(pl.LightningModule):
    """A transformers causal LM whose lm_head is the factored head (``factor_lm_head``)."""

    def __init__(self, vocab: int = 64, hidden: int = 32, layers: int = 2, heads: int = 2, head_lr: float = 0.5,
                 lr: float = 3e-3, compile_backend: str = "inductor", seed: int = 0):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                             max_position_embeddings=256, tie_word_embeddings=False)
        self.lm = factor_lm_head(LlamaForCausalLM(config), loss="spherical_softmax", lr=head_lr,
                                 generator=torch.Generator().manual_seed(seed))
        # Trained from scratch: the loss's own initial W, not Llama's random lm_head (a pretrained
        # model keeps its lm_head.weight, which factor_lm_head made the head's initial W).
        self.head.reset_weight()
        if compile_backend != "none":
            self.lm.model.compile(backend=compile_backend)  # the body, in place: the state_dict keys stay

    @property
    def head(self):
        return self.lm.lm_head

    def training_step(self, batch, batch_idx):
        ids, mask = batch
        # the model's own shift; loss.backward() steps the head and hands dL/dH to the body
        loss = self.lm(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, PAD)).loss
        self.log("train/loss", loss.detach(), on_step=True, prog_bar=True)
        return loss

    def configure_optimizers(self):
        # The head has no parameters: the optimizer (and gradient clipping) sees the body only.
        return torch.optim.AdamW(self.lm.parameters(), lr=self.hparams.lr)

    @torch.no_grad()
    def next_token(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Greedy next tokens at every position, by the head's own ranking (its score of the
        outputs o, the logits of the patched model; o^2 + eps for the spherical softmax)."""
        logits = self.lm(input_ids=ids, attention_mask=mask).logits
        return self.head.loss_fn.score(logits).argmax(-1)


class LossLog(pl.Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all (a resumed run counts on)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop (and checkpoint) after this many steps (an epoch's end: Lightning resumes a "
                        "plain DataLoader exactly only there)")
    p.add_argument("--precision", default="bf16-mixed", help="Lightning precision (bf16-mixed, 32-true, ...)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the body, or none")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step (exact)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epoch-steps", type=int, default=10,
                   help="optimizer steps per epoch (the corpus repeats each epoch; checkpoints at epoch ends)")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--resume", type=Path, default=None, help="a checkpoint to continue from")
    p.add_argument("--out", type=Path, default=Path("outputs/examples/hf_causal_lm"),
                   help="where last.ckpt and summary.json go")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    for name in ("steps", "stop_after"):
        value = getattr(args, name)
        if value is not None and (value < 1 or value % args.epoch_steps):
            raise SystemExit(f"--{name.replace('_', '-')} {value} must be a positive multiple of --epoch-steps "
                             f"{args.epoch_steps}: training stops (and resumes exactly) at an epoch's end")
    pl.seed_everything(args.seed, verbose=False)
    data = corpus(args.vocab, n=args.batch_size * args.epoch_steps * args.accumulate, length=args.seq_len,
                  seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=False)  # fixed order: an exact resume
    model = CausalLM(args.vocab, args.hidden, compile_backend=args.compile_backend, seed=args.seed)
    log = LossLog()
    epochs = (args.steps if args.stop_after is None else args.stop_after) // args.epoch_steps
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision=args.precision, max_epochs=epochs,
                         accumulate_grad_batches=args.accumulate, gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[log])
    if args.accumulate > 1:  # the head steps once per optimizer step, on all its micro-batches
        from lst_lightning.app.callbacks import HeadSteps  # noqa: PLC0415  (only this case needs Lightning's app)

        trainer.callbacks.append(HeadSteps())
    trainer.fit(model, loader, ckpt_path=args.resume)
    args.out.mkdir(parents=True, exist_ok=True)
    trainer.save_checkpoint(args.out / "last.ckpt")
    summary = {"steps": trainer.global_step, "head_steps": int(model.head.steps), "losses": log.losses,
               "precision": args.precision, "compile_backend": args.compile_backend}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    if log.losses:
        print(f"steps {trainer.global_step}: loss {log.losses[0]:.4f} -> {log.losses[-1]:.4f}")
    return summary


if __name__ == "__main__":
    main()
