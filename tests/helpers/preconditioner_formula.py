"""heads/preconditioner.py's P written out from its formula, with an explicit inverse: the
reference the preconditioned heads' tests hold P to."""
import torch


def p_of(S: torch.Tensor, w: torch.Tensor, damping: float) -> torch.Tensor:
    """P from the running moment ``S`` and its weight ``w``: tau (1 + damping) (S / w + damping tau I)^-1,
    tau the mean of S / w's diagonal."""
    mean = S / w
    tau = mean.trace() / S.shape[0]
    return tau * (1 + damping) * torch.linalg.inv(mean + damping * tau * torch.eye(S.shape[0], dtype=S.dtype))
