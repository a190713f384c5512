"""Two gloo processes (CPU) training the multi-process factored head on the same global
batches as one process, and what each rank saw: the shared run behind
test_multi_process.py and test_sharded_eval.py (fixtures in conftest.py)."""
import math
import os

import torch
import torch.distributed as dist
from host_reads import HostReads

from lst_lightning.spherical import FactoredSphericalHead
from lst_lightning.distributed.collectives import bit_hash
from lst_lightning.spherical.state import EXACT_STATE

WORLD, D, d, K, STEPS = 2, 50, 6, 3, 8
ROWS = [5, 3]  # ranks hold different numbers of rows
#: sampled classes inside the step (loss=sampled), 7 log-uniform negatives, with the right preconditioner
#: (as lst-train's default head): name -> (parallel, shared by the batch)
NEGATIVE_MODES = {"replicated_negatives": ("replicated", True), "sharded_negatives": ("sharded", True),
                  "sharded_negatives_per_row": ("sharded", False)}


#: the bound on the step's gradient (clip_norm) of the clipped runs: every step's gradient passes it
CLIP_NORM = 0.01


def negatives(shared: bool) -> dict:
    return {"loss": "sampled", "negatives": {"num": 7, "shared": shared},
            "preconditioner": {"beta": 0.9, "damping": 0.05}}


def make_head(mode, **kw):
    args = dict(num_classes=D, hidden_dim=d, loss="taylor_softmax", lr=0.05, weight_decay=0.01, bias=True,
                dtype=torch.float64, generator=torch.Generator().manual_seed(1), parallel=mode)
    args.update(kw)
    return FactoredSphericalHead(**args)


def global_batch(step):
    """Padding, a class repeated within a row and classes shared across rows (and ranks)."""
    g = torch.Generator().manual_seed(100 + step)
    M = sum(ROWS)
    H = torch.randn(M, d, generator=g, dtype=torch.float64)
    idx = torch.randint(0, D, (M, K), generator=g)
    idx[0, -1] = -1
    idx[1, 1] = idx[1, 0]
    idx[6, 0] = idx[0, 0]  # rank 1 shares a class with rank 0
    return H, idx


def padded_batch(step):
    """The global batch as the ranks share it under device flags (padded_rows.py): each rank's
    rows padded to the most rows a rank holds (padding rows: H 0, ids -1), rank 0 first."""
    H, idx = global_batch(step)
    C = max(ROWS)
    Hp, ip = H.new_zeros(WORLD * C, d), idx.new_full((WORLD * C, K), -1)
    for r, n in enumerate(ROWS):
        lo = sum(ROWS[:r])
        Hp[r * C:r * C + n], ip[r * C:r * C + n] = H[lo:lo + n], idx[lo:lo + n]
    return Hp, ip


def train_padded(head):
    """``train`` on the padded batches (the sampled classes drawn per row: one draw per
    padded row): the gradients of H."""
    grads = []
    for step in range(STEPS):
        H, idx = padded_batch(step)
        H.requires_grad_()
        head(H, idx).backward()
        grads.append(H.grad)
    return grads


#: the long run whose host reads are counted: its steps, and every 8th step's rows per rank
#: (an epoch's last batch: fewer rows than the first step's, which the ranks pad to); its heads
#: read their flags every LONG_SYNC_EVERY steps (once in the run, past its first 32 steps)
LONG_STEPS, SHORT_ROWS, LONG_SYNC_EVERY = 34, [2, 1], 32


def rows_at(step):
    return SHORT_ROWS if step % 8 == 7 else ROWS


def long_batch(step):
    """The long run's global batch of ``step``: random ids, padding slots among them."""
    g = torch.Generator().manual_seed(200 + step)
    M = sum(rows_at(step))
    return torch.randn(M, d, generator=g, dtype=torch.float64), torch.randint(-1, D, (M, K), generator=g)


def train_long(head, rank=None, micro=1):
    """LONG_STEPS steps on rank ``rank``'s rows of each long batch (None: every row, one
    process); ``micro`` > 1: that many batches a step, the head attached to the optimizer.
    The loss of each step's first batch."""
    opt = None
    if micro > 1:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        head.attach(opt, accumulate=micro)
    losses = []
    for step in range(LONG_STEPS):
        for t in range(micro * step, micro * step + micro):
            H, idx = long_batch(t)
            rows = rows_at(t)
            mine = slice(None) if rank is None else slice(sum(rows[:rank]), sum(rows[:rank + 1]))
            loss = head(H[mine].clone().requires_grad_(), idx[mine])
            loss.backward()
            if t == micro * step:
                losses.append(loss.detach())
        if opt is not None:
            opt.step()
    if opt is not None:
        head.detach()
    return torch.stack(losses)


#: the compiled step's run: batches of random sizes, 1 to RAGGED_MOST rows a rank
RAGGED_STEPS, RAGGED_MOST = 30, 6


def ragged_rows(step):
    return torch.randint(1, RAGGED_MOST + 1, (WORLD,), generator=torch.Generator().manual_seed(300 + step)).tolist()


def train_ragged(head, rank=None):
    """RAGGED_STEPS autograd steps on rank ``rank``'s rows of batches whose every rank's rows change
    size each step (None: every row, one process); the losses."""
    losses = []
    for step in range(RAGGED_STEPS):
        rows = ragged_rows(step)
        g = torch.Generator().manual_seed(400 + step)
        H = torch.randn(sum(rows), d, generator=g, dtype=torch.float64)
        idx = torch.randint(-1, D, (sum(rows), K), generator=g)  # padding slots among them
        mine = slice(None) if rank is None else slice(sum(rows[:rank]), sum(rows[:rank + 1]))
        loss = head(H[mine].clone().requires_grad_(), idx[mine])
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses)


def compiled_ragged(rank, **kw):
    """The replicated default head's compiled step (shared negatives, the preconditioner; Dynamo and
    AOTAutograd, without Inductor's code generation; ``kw``: more settings) on ``train_ragged``'s
    batches: its losses, W and the graphs compiled."""
    from torch._dynamo.utils import counters  # noqa: PLC0415

    from lst_lightning.spherical import driver  # noqa: PLC0415

    compile_, cache = torch.compile, driver._compiled
    torch.compile, driver._compiled = (lambda fn, **kw: compile_(fn, backend="aot_eager", **kw)), {}
    torch._dynamo.reset()
    counters.clear()
    try:
        head = make_head("replicated", compile_step=True, **negatives(True), **kw)
        head.rows_per_rank = RAGGED_MOST
        head.distribute()
        losses = train_ragged(head, rank)
        head.sync()
        return {"losses": losses, "W": head.weight(), "graphs": counters["stats"]["unique_graphs"],
                "steps": int(head.steps), "compiles": head.compiles}
    finally:
        torch.compile, driver._compiled = compile_, cache
        torch._dynamo.reset()


def void_input(mode, rank, case, step="autograd"):
    """Three steps, then at the fourth (a read of the flags: sync_every=4) rank 1's input is bad
    (``case``: "shape", H with a column too many; "rows", more rows than the first step's;
    "rows_reserved", the same with ``head.rows_per_rank`` set, which takes them): what the
    fourth step raised, and whether it left the exact state untouched."""
    head = make_head(mode, sync_every=4, step=step)
    if case == "rows_reserved":
        head.rows_per_rank = ROWS[0] + 1
    head.distribute()
    lo = sum(ROWS[:rank])
    rows = slice(lo, lo + ROWS[rank])
    for step in range(3):
        H, idx = global_batch(step)
        head(H[rows].clone().requires_grad_(), idx[rows]).backward()
    before = bit_hash([getattr(head, n) for n in EXACT_STATE])
    H, idx = global_batch(3)
    H, idx = H[rows], idx[rows]
    if rank == 1 and case == "shape":
        H = torch.cat([H, H[:, :1]], 1)
    elif rank == 1:
        H, idx = torch.cat([H, H[:ROWS[0] + 1 - ROWS[1]]]), torch.cat([idx, idx[:ROWS[0] + 1 - ROWS[1]]])
    try:
        head(H.clone().requires_grad_(), idx).backward()
        error = None
    except ValueError as e:
        error = str(e)
    return {"error": error, "untouched": bit_hash([getattr(head, n) for n in EXACT_STATE]) == before,
            "steps": int(head.steps)}


def eval_batch():
    g = torch.Generator().manual_seed(7)
    return torch.randn(sum(ROWS), d, generator=g, dtype=torch.float64), torch.randint(0, D, (sum(ROWS),), generator=g)


def train(head, rows):
    """STEPS steps on rows ``rows`` of each global batch: the gradients of H and the state."""
    grads = []
    for step in range(STEPS):
        H, idx = global_batch(step)
        Hr = H[rows].clone().requires_grad_()
        head(Hr, idx[rows]).backward()
        grads.append(Hr.grad)
    return grads


def train_accumulated(head, rows, micro=2):
    """STEPS // micro optimizer steps, each accumulating ``micro`` global batches (rows
    ``rows`` of each, loss / micro): the head attached to the optimizer steps once on
    all of them (exact accumulation). One process with every row: the reference."""
    dummy = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([dummy], lr=0.0)
    head.attach(opt)
    for step in range(0, STEPS, micro):
        for t in range(step, step + micro):
            H, idx = global_batch(t)
            (head(H[rows].clone().requires_grad_(), idx[rows]) / micro).backward()
        opt.step()
    head.detach()


def train_on_unions(head, micro=2):
    """The one-process reference of ``train_accumulated``: one step per union of ``micro``
    global batches."""
    for step in range(0, STEPS, micro):
        H, idx = (torch.cat(t) for t in zip(*(global_batch(t) for t in range(step, step + micro))))
        head(H.requires_grad_(), idx).backward()


def evaluate(head, rows):
    H, t = eval_batch()
    head.eval()
    out = {"rank": head.target_rank(H[rows], t[rows]), "topk": head.topk(H[rows], 4),
           "log_prob": head.log_prob(H[rows], t[rows]), "loss": head(H[rows], t[rows])}
    head.train()
    return out


def worker(rank, rdv, out):
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    lo = sum(ROWS[:rank])
    rows = slice(lo, lo + ROWS[rank])
    res = {}
    for mode in ("replicated", "sharded", "sharded_sync_free"):
        head = make_head("sharded", sync_every=3) if mode == "sharded_sync_free" else make_head(mode)
        head.distribute()
        grads = train(head, rows)
        res[mode] = {"grads": grads, "W": head.weight(), "rows": (head.row_lo, head.row_hi),
                     "hash": head.state_hash(), "eval": evaluate(head, rows), "V": head.V.clone()}
    for name, (mode, shared) in NEGATIVE_MODES.items():  # every rank draws the same negatives from the head's seed
        sampled = make_head(mode, **negatives(shared))
        sampled.distribute()
        res[name] = {"grads": train(sampled, rows), "W": sampled.weight(), "hash": sampled.state_hash()}
    for mode in ("replicated", "sharded"):  # the step's gradient clipped: its norm the global batch's
        clipped = make_head(mode, clip_norm=CLIP_NORM, **negatives(True))
        clipped.distribute()
        res[f"clipped_{mode}"] = {"grads": train(clipped, rows), "W": clipped.weight()}
    for mode in ("replicated", "sharded"):  # gradient accumulation across the processes
        acc = make_head(mode)
        acc.distribute()
        train_accumulated(acc, rows)
        res[f"accumulated_{mode}"] = {"W": acc.weight(), "hash": acc.state_hash()}
    # A checkpoint with the whole V (gathered) loads into a fresh sharded head on each rank.
    full = [head.gather_v(dst=r) for r in range(WORLD)][rank]
    state = {**head.state_dict(), "V": full}
    fresh = make_head("sharded")
    fresh.distribute()
    fresh.load_state_dict(state)
    res["reloaded_equal"] = torch.equal(fresh.V, head.V) and fresh.state_hash() == head.state_hash()
    res["full_v"] = full
    # One rank's bad target: every rank raises, no rank's state changes; with the checks read at
    # once (sync_every=1) at this step, under device flags at the next read of the flags.
    for sync_every, key in ((1, "bad_input"), (2, "bad_input_deferred")):
        head = make_head("replicated", sync_every=sync_every)
        head.distribute()
        H, idx = global_batch(0)
        head(H[rows].clone().requires_grad_(), idx[rows]).backward()
        before = bit_hash([getattr(head, n) for n in EXACT_STATE])  # (a void step counts itself skipped)
        idx = idx[rows].clone()
        if rank == 1:
            idx[0, 0] = D
        try:
            head(H[rows].clone().requires_grad_(), idx).backward()
            res[key] = None
        except ValueError as e:
            res[key] = str(e)
        res[f"{key}_untouched"] = bit_hash([getattr(head, n) for n in EXACT_STATE]) == before
    # A replica that drifts by one bit is caught at the next checksum, on every rank (under
    # device flags at a read of the flags: every 2 steps here).
    for sync_every, key in ((1, "diverged"), (2, "diverged_deferred")):
        head = make_head("replicated", checksum_every=2, sync_every=sync_every)
        head.distribute()
        H, idx = global_batch(0)
        head(H[rows].clone().requires_grad_(), idx[rows]).backward()
        if rank == 1:
            head.U[0, 0] = torch.nextafter(head.U[0, 0], torch.tensor(math.inf, dtype=torch.float64))
        try:
            head(H[rows].clone().requires_grad_(), idx[rows]).backward()
            res[key] = None
        except RuntimeError as e:
            res[key] = str(e)
    # The default step (device flags) reads the host at its flags' reads only, ragged batches included.
    for mode in ("replicated", "sharded"):
        for micro in (1, 2):
            head = make_head(mode, sync_every=LONG_SYNC_EVERY)
            head.distribute()
            with HostReads() as reads:
                losses = train_long(head, rank, micro)
            res[f"reads_{mode}_{micro}"] = {"reads": reads.count, "sites": dict(reads.sites), "losses": losses,
                                             "W": head.weight(), "steps": int(head.steps)}
    # One rank's bad input under device flags after the first step: every rank raises at the next read.
    for mode in ("replicated", "sharded"):
        for case in ("shape", "rows", "rows_reserved"):
            res[f"void_{mode}_{case}"] = void_input(mode, rank, case)
    res["void_replicated_shape_fused"] = void_input("replicated", rank, "shape", step="fused")
    res["compiled_ragged"] = compiled_ragged(rank)
    res["compiled_ragged_sync1"] = compiled_ragged(rank, sync_every=1)  # exact rows gathered, padded to a batch size
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def rel(a, b):
    return float((a - b).norm() / b.norm())
