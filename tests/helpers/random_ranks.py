"""Two gloo processes training the factored head in settings drawn at random, each case against
one process on the global batch (test_random_ranks.py): the loss, the bias, the reduction, weight
decay, P, a bound on the gradient's norm, the U^-1 route and the repairs, the flags' reads,
sampled classes (shared; per row where the flags are read at once), replicated or sharded, the
autograd step, the fused step or exact accumulation over two micro-batches, and every rank's rows
changing number at every step (1 to ``MOST``)."""
import os
import random

import torch
import torch.distributed as dist

from lst_lightning.spherical import FactoredSphericalHead

from random_cases import settings, stabiliser

WORLD, STEPS, K, MOST = 2, 8, 2, 5


def case(seed: int) -> tuple[dict, str, str, list]:
    """(the head's settings, its parallel, the driver: "autograd", "fused" or "accumulated", each
    step's rows per rank): random_cases.py's draws of the settings and the repairs, with a bound
    on the gradient's norm, the flags' reads, and negatives per row only where the flags are read
    at once (the ranks' exact rows; under device flags each rank's rows are padded, and so drawn)."""
    r = random.Random(seed)
    kw = dict(settings(r, False), stabiliser=stabiliser(r), clip_norm=r.choice([None, None, 0.05]),
              sync_every=r.choice([1, 3, 64]))
    if kw["negatives"] is not None and kw["sync_every"] > 1:
        kw["negatives"]["shared"] = True
    parallel, driver = r.choice(["replicated", "sharded"]), r.choice(["autograd", "fused", "accumulated"])
    return kw, parallel, driver, [[r.randint(1, MOST) for _ in range(WORLD)] for _ in range(STEPS)]


def global_batches(seed: int, kw: dict, rows: list) -> list:
    """Each step's global batch (every rank's rows, rank 0 first): padding slots among the ids."""
    out = []
    for step, per_rank in enumerate(rows):
        g = torch.Generator().manual_seed(1000 * seed + step)
        H = torch.randn(sum(per_rank), kw["hidden_dim"], generator=g, dtype=torch.float64)
        idx = torch.randint(-1, kw["num_classes"], (sum(per_rank), K), generator=g)
        idx[0, 0] = idx[0, 0].clamp(min=0)  # a real target in the batch
        out.append((H, idx))
    return out


def make_head(kw: dict, parallel: str, seed: int) -> FactoredSphericalHead:
    return FactoredSphericalHead(parallel=parallel, generator=torch.Generator().manual_seed(seed), **kw)


def train(head: FactoredSphericalHead, seed: int, rank: int | None) -> torch.Tensor:
    """The case's steps on rank ``rank``'s rows of each global batch (None: every row, one
    process), then the flags read: W (sharded: this rank's rows)."""
    kw, _, driver, rows = case(seed)
    opt = None
    if driver == "accumulated":
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        head.attach(opt)
    for t, ((H, idx), per_rank) in enumerate(zip(global_batches(seed, kw, rows), rows)):
        mine = slice(None) if rank is None else slice(sum(per_rank[:rank]), sum(per_rank[:rank + 1]))
        if driver == "fused":
            head.train_step(H[mine].clone(), idx[mine])
        else:
            (head(H[mine].clone().requires_grad_(), idx[mine]) / (2 if opt else 1)).backward()
        if opt is not None and t % 2 == 1:
            opt.step()
    if opt is not None:
        head.detach()
    head.sync()
    return head.weight()


def worker(rank: int, rdv: str, out: str, seeds: list) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    res = {}
    for seed in seeds:
        kw, parallel, _, _ = case(seed)
        head = make_head(kw, parallel, seed)
        head.rows_per_rank = MOST
        head.distribute()
        res[seed] = train(head, seed, rank)
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()
