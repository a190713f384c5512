"""For the sampler tests: a chi-square check that draws follow a law, and the kernels."""
import torch
from scipy.stats import chisquare

from lst_lightning.heads.kernel_functions import QuadraticKernel, RandomFourierKernel


def empirical(ids, n):
    return torch.bincount(ids.reshape(-1), minlength=n).double()


def assert_draws_follow(ids, probs, min_p=1e-3):
    """Chi-square goodness of fit of draws to probs (classes below min_p pooled)."""
    obs = empirical(ids, probs.numel())
    exp = probs.double() * ids.numel()
    big = probs > min_p
    obs = torch.cat([obs[big], obs[~big].sum(0, keepdim=True)])
    exp = torch.cat([exp[big], exp[~big].sum(0, keepdim=True)])
    keep = exp > 0
    assert obs[~keep].sum() == 0, "drew a class of probability 0"
    if keep.sum() < 2:
        return
    obs, exp = obs[keep], exp[keep]
    p = chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue
    assert p > 1e-4, f"draws do not follow the claimed law (chi-square p = {p:.2g})"


KERNELS = {
    # nu large and D_rff small: many negative kernel values, so the clamping paths run.
    "rff_noisy": lambda d: RandomFourierKernel(d, num_features=8, nu=8.0, seed=1),
    "rff": lambda d: RandomFourierKernel(d, num_features=64, nu=2.0, seed=2),
    "quadratic": lambda d: QuadraticKernel(d, alpha=4.0),
}
