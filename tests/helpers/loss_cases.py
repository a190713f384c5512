"""Random (q, s, a) cases of the spherical losses' tests."""
import torch

KWARGS = {"zloss": {"a": 0.3, "b": 3.0}}


def random_batch(m=5, D=40, K=3):
    O = torch.randn(m, D, dtype=torch.float64)
    idx = torch.randint(0, D, (m, K))
    idx[0, 1] = -1           # padding
    idx[1, 2] = idx[1, 0]    # a class repeated within a row
    idx[2, 0] = idx[3, 0]    # and across rows
    T = torch.rand(m, K, dtype=torch.float64) * (idx >= 0)
    return O, idx, T
