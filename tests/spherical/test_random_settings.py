"""The factored head against the naive head in settings drawn at random, float64, step after step.

The other tests of the step vary one or two settings at a time. Here each case draws all of them
together from its seed: the loss, the bias, the reduction, weight decay, the sampled classes
(shared or per row, how many, the proposal), P (off, a running mean, this batch's moment alone),
the bound on the gradient's norm (``clip_norm``: off, or one that most steps' gradients pass), the
U^-1 route and the repairs' settings (``stabiliser``), the checks (read at once or as device
flags), the driver (autograd or
``train_step``), the lr and target values. Each step draws a new batch size (m = 1 among them) and
K, with padding, classes repeated within a row and across rows, and sometimes a fully padded row.
The hard cases take large steps on large H: most of them fold steps into V (a nearly singular
B), and the head stays equal to the naive one through them. The accumulated cases attach both
heads to an optimizer and take each step on 1 to 3 micro-batches (exact accumulation).

In float32, the factored head is held to the float64 naive head as closely as the float32 naive
head is, within a factor: rounding is all either makes, whatever the settings (the hard ones,
weight decay among them: it shrinks U every step, and the repairs rescale it).
"""
import random

import pytest
import torch

from lst_lightning.spherical import FactoredSphericalHead, NaiveSphericalHead

from head_pairs import rel
from random_cases import CASES, STEPS, batch, run_case, settings, stabiliser

@pytest.mark.parametrize("kind", ["ordinary", "hard", "accumulated"])
@pytest.mark.parametrize("seed", range(CASES))
def test_the_factored_head_equals_the_naive_head(seed, kind):
    f = run_case(seed, kind)
    assert int(f.steps) == STEPS and int(f.skipped_nonfinite) == 0


def test_the_hard_cases_take_nearly_singular_steps():
    """What the hard cases are for: most of them fold steps into V."""
    folded = sum(int(run_case(seed, "hard").folds) > 0 for seed in range(CASES))
    assert folded >= CASES // 2, folded


F32_STEPS = 30
#: the float32 factored head's gap to the float64 naive head, at most this many times the float32
#: naive head's, plus an absolute floor (over seeds 0 to 999 the ratio's median is 1.9 and its 99th
#: percentile 30; seeds 76 and 891 pass the bound, at 115 and 180 times: docs/factored_head.md)
F32_FACTOR, F32_FLOOR = 100.0, 1e-5


@pytest.mark.parametrize("seed", range(CASES))
def test_in_float32_the_factored_head_rounds_no_worse_than_the_naive_head(seed):
    """Hard settings, ``F32_STEPS`` steps: after each, the float32 factored head's W against the
    float64 naive head's, beside the float32 naive head's, until the float64 run diverges (its W
    past 1e4: the squared error at the largest lrs)."""
    r = random.Random(seed)
    torch.manual_seed(seed)
    args = settings(r, True)
    stab, sync_every = stabiliser(r), r.choice([1, 3, 64])
    values = r.random() < 0.3
    f32 = dict(args, dtype=torch.float32)
    f = FactoredSphericalHead(stabiliser=stab, sync_every=sync_every, **f32)
    n, n32 = NaiveSphericalHead(**args), NaiveSphericalHead(**f32)
    D, d = args["num_classes"], args["hidden_dim"]
    W0 = (torch.randn(D, d + args["bias"], dtype=torch.float64) * 0.3).float()
    for head in (f, n, n32):
        head.reset_weight(W0.to(head.dtype))
    for step in range(F32_STEPS):
        H, idx, T = batch(r, D, d, True, values)
        H = H.float()
        for head in (n, n32, f):
            Hh = H.to(head.dtype).requires_grad_()
            head(Hh, idx, None if T is None else T.to(head.dtype)).backward()
        if n.weight().abs().max() > 1e4:
            break
        gap, gap32 = rel(f.weight(), n.weight()), rel(n32.weight(), n.weight())
        assert gap <= F32_FACTOR * gap32 + F32_FLOOR, (step, gap, gap32, args, stab, sync_every)
