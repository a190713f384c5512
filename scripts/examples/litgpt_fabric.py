"""litgpt's GPT with the exact factored head, trained by litgpt's own pretraining loop shape
(Fabric; docs/integrations.md, "litgpt").

The model is a litgpt ``GPT`` from one of litgpt's named configs (``pythia-14m`` by default:
its padded vocabulary of 50 304, random init, nothing downloaded), its layers cut to
``--layers``. ``factor_gpt_head`` puts the factored head in place of ``lm_head``; the loop is
litgpt's ``pretrain.fit`` with three lines changed: ``loss = model(input_ids,
targets=targets)`` instead of the logits and ``chunked_cross_entropy``; the head attached to
the optimizer (one exact step per optimizer step over the accumulated micro-batches); its lr
following litgpt's cosine schedule. Afterwards ``export_dense_head`` gives an ordinary GPT,
saved as litgpt's ``lit_model.pth`` + ``model_config.yaml`` (what ``litgpt generate`` loads),
and the greedy continuation of a prompt is printed. The corpus is synthetic: a noisy walk
over the vocabulary (the next token is the previous + 1, or + 2 with probability 0.2).

    uv sync --extra litgpt    # or the dev group
    python scripts/examples/litgpt_fabric.py --steps 30 --out outputs/examples/litgpt
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from litgpt import GPT, Config
from litgpt.generate.base import generate
from litgpt.pretrain import get_lr
from litgpt.utils import save_config

from lst_lightning.integrations import export_dense_head, factor_gpt_head, factored_head, scheduled_lr


def walk(vocab: int, n: int, length: int, seed: int) -> torch.Tensor:
    """(n, length + 1) token ids: a start, then +1 or (probability 0.2) +2, mod vocab."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    steps = 1 + (torch.rand(n, length, generator=g) < 0.2).long()
    return (start + torch.cat([torch.zeros(n, 1, dtype=torch.long), steps.cumsum(1)], 1)) % vocab


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="pythia-14m", help="a litgpt config name (Config.from_name)")
    p.add_argument("--layers", type=int, default=2, help="n_layer (the named config's, cut for a CPU)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3, help="the body's AdamW lr (litgpt's schedule)")
    p.add_argument("--head-lr", type=float, default=1.0, help="the factored head's lr at the schedule's peak")
    p.add_argument("--loss", default="zloss")
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--out", type=Path, default=Path("outputs/examples/litgpt"))
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    fabric = L.Fabric(accelerator="auto", devices=1, precision=args.precision)
    fabric.seed_everything(args.seed)
    config = Config.from_name(args.config, n_layer=args.layers)
    with fabric.init_module():
        model = GPT(config)
    factor_gpt_head(model, loss=args.loss, lr=args.head_lr)
    head = factored_head(model)
    head.reset_weight()  # from scratch: the loss's own initial W (a pretrained GPT keeps its lm_head)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model, optimizer = fabric.setup(model, optimizer)
    head.attach(optimizer)  # one exact head step per optimizer step, on all the micro-batches

    iters = args.steps * args.accumulate
    data = walk(config.vocab_size, iters * args.micro_batch, args.seq_len, args.seed).to(fabric.device)
    losses = []
    for it in range(iters):
        if it % args.accumulate == 0:  # litgpt's loop sets the lr at every iteration; once per step here
            lr = get_lr(args.lr, it // args.accumulate, warmup_iters=3, max_iters=args.steps, min_lr=args.lr / 10)
            for group in optimizer.param_groups:
                group["lr"] = lr
            head.lr = scheduled_lr(args.head_lr, lr, args.lr)
        rows = data[it * args.micro_batch:(it + 1) * args.micro_batch]
        input_ids, targets = rows[:, :-1], rows[:, 1:]
        accumulating = (it + 1) % args.accumulate != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = model(input_ids, targets=targets)  # was: chunked_cross_entropy(model(input_ids), targets)
            fabric.backward(loss / args.accumulate)
        losses.append(loss.item())
        if not accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()  # the head's step too (attached)
            optimizer.zero_grad()
    head.detach()

    plain = export_dense_head(model.module)  # an ordinary GPT: lm_head an nn.Linear again
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(plain.state_dict(), args.out / "lit_model.pth")
    save_config(config, args.out)
    plain.eval()
    plain.set_kv_cache(batch_size=1, device=fabric.device)
    prompt = data[0, :6]
    continuation = generate(plain, prompt, max_returned_tokens=16, top_k=1)  # greedy: the head's ranking by o
    summary = {"config": args.config, "padded_vocab_size": config.padded_vocab_size, "steps": args.steps,
               "head_steps": int(head.steps), "losses": losses, "prompt": prompt.tolist(),
               "greedy": continuation.tolist()}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"D = {config.padded_vocab_size}, {args.steps} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
          f"greedy {continuation.tolist()}")
    return summary


if __name__ == "__main__":
    main()
