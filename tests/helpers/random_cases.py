"""The settings and batches of the factored/naive head pairs drawn at random, from a seed
(test_random_settings.py, and the compiled step's in test_compiled.py): every setting together,
and batches whose size changes every step, with padding and repeated classes."""
import random

import torch

from head_pairs import LOSS_KW


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
