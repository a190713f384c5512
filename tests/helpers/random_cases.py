"""The factored/naive head pairs in settings drawn at random, from a seed, and their run
(``run_case``: test_random_settings.py's, and the compiled step's in test_compiled.py): every
setting together, and batches whose size changes every step, with padding and repeated classes."""
import random

import torch

from lst_lightning.spherical import FactoredSphericalHead, NaiveSphericalHead

from head_pairs import LOSS_KW, rel


def settings(r: random.Random, hard: bool) -> dict:
    loss = r.choice(["zloss", "mse", "spherical_softmax", "taylor_softmax", "sampled", "sampled"])
    negatives = None
    if loss == "sampled":
        negatives = {"num": r.randint(1, 7), "seed": 7, "shared": r.random() < 0.6,
                     "sampler": r.choice(["log_uniform", "uniform"])}
    return dict(
        num_classes=r.choice([7, 30, 60]), hidden_dim=r.choice([2, 5, 8]), loss=loss,
        loss_kwargs=LOSS_KW.get(loss, {}), bias=r.random() < 0.5,
        reduction=r.choice(["mean", "mean_real", "sum"]), weight_decay=r.choice([0.0, 0.0, 0.05]),
        negatives=negatives,
        preconditioner=r.choice([None, {"beta": 0.9, "damping": 0.1}, {"beta": 0.0, "damping": 0.3}]),
        lr=r.choice([1.0, 3.0, 10.0] if hard else [0.01, 0.1, 0.5]), dtype=torch.float64)


def stabiliser(r: random.Random) -> dict:
    """The repairs' settings: the U^-1 route, and checks, refreshes and singular-value fixes from
    as shipped to every step (a check at every read, U^-1 refreshed every 3 steps, Q and wbar
    every 5, one fix at most before U is folded)."""
    return {"inverse": r.choice(["woodbury", "solve", "products", "auto"]), "check_every": r.choice([100, 7, 1]),
            "sv_method": r.choice(["power", "svd"]), "uinv_refresh_every": r.choice([100, 3]),
            "q_refresh_every": r.choice([10000, 5]), "cond_trigger": r.choice([4.0, 1.5]),
            "max_sv_fixes": r.choice([8, 1])}


def batch(r: random.Random, D: int, d: int, hard: bool, values: bool):
    m, K = r.randint(1, 9), r.randint(1, 3)
    H = torch.randn(m, d, dtype=torch.float64) * (r.choice([0.3, 1.0, 3.0]) if hard else 1.0)
    idx = torch.randint(0, D, (m, K))
    if K > 1 and r.random() < 0.7:
        idx[0, -1] = -1
    if K > 1 and m > 1:
        idx[1, 1] = idx[1, 0]  # repeated within a row
    if m > 2:
        idx[2, 0] = idx[0, 0]  # shared across rows
    if m > 3 and r.random() < 0.3:
        idx[3] = -1  # a fully padded row
    T = torch.rand(m, K, dtype=torch.float64) + 0.5 if values else None
    return H, idx, T


STEPS = 10
CASES = 24  # of each kind
TOL = 1e-9  # float64: the largest gap over these cases is about 1e-11 (after folds)


def optimizer() -> torch.optim.Optimizer:
    """An optimizer to attach a head to (its step is the head's: exact accumulation)."""
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def run_case(seed: int, kind: str, steps: int = STEPS, **head_kw) -> FactoredSphericalHead:
    """Case ``seed`` of ``kind`` ("ordinary", "hard": large steps on large H, "accumulated": 1 to
    3 micro-batches a step, both heads attached to an optimizer): both heads from one W, ``steps``
    steps, each held to the naive head's loss, dL/dH and W; the factored head (``head_kw``: more
    of its settings, ``compile_step=True``), synced."""
    r = random.Random(seed)
    torch.manual_seed(seed)
    hard = kind == "hard"
    args = settings(r, hard)
    # drawn apart, so that the other settings' draws stay those of the cases without it
    args["clip_norm"] = random.Random(-1 - seed).choice([None, None, 0.05, 1.0])
    stab, sync_every = stabiliser(r), r.choice([1, 1, 3])
    fused, values = r.random() < 0.5 and kind != "accumulated", r.random() < 0.3
    f = FactoredSphericalHead(stabiliser=stab, sync_every=sync_every, **args, **head_kw)
    n = NaiveSphericalHead(**args)
    D, d = args["num_classes"], args["hidden_dim"]
    W0 = torch.randn(D, d + args["bias"], dtype=torch.float64) * 0.3
    f.reset_weight(W0)
    n.reset_weight(W0)
    opts = (optimizer(), optimizer()) if kind == "accumulated" else None
    if opts:
        f.attach(opts[0])
        n.attach(opts[1])
    for step in range(steps):
        micro = r.randint(1, 3) if opts else 1
        for _ in range(micro):
            H, idx, T = batch(r, D, d, hard, values)
            Hn = H.clone().requires_grad_()
            Ln = n(Hn, idx, T)
            (Ln / micro).backward()
            if fused:
                Lf, dH = f.train_step(H.clone(), idx, T)
            else:
                Hf = H.clone().requires_grad_()
                Lf = f(Hf, idx, T)
                (Lf / micro).backward()
                dH = Hf.grad
            gaps = rel(Lf, Ln), rel(dH, Hn.grad)
            assert max(gaps) < TOL, (step, gaps, args, stab, sync_every, fused)
        for opt in opts or ():
            opt.step()
        gap = rel(f.weight(), n.weight())
        assert gap < TOL, (step, gap, args, stab, sync_every, fused)
    f.sync()
    return f
