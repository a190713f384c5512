"""What the baseline heads' tests share: tiny sizes, targets with padding and repeated
classes, dense references, and one head of each kind."""
import torch

from lst_lightning.baselines import AdaptiveSoftmaxHead, HierarchicalSoftmaxHead, SampledSoftmaxHead, SoftmaxHead
from lst_lightning.baselines.samplers import KernelSumTree

D, d, m = 23, 5, 7


def zipf_counts(n=D):
    return (1000.0 / torch.arange(1, n + 1)).round()


def make_targets(K=3, seed=1):
    """(m, K) targets with padding and classes repeated across rows and within a row."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, D, (m, K), generator=g)
    t[0, 1:] = -1
    t[2, 0] = t[1, 0]
    if K > 1:
        t[3, 1] = t[3, 0]
    t[4, :] = -1  # a row with no target at all
    return t


def dense_loss(log_probs, t, val=None):
    """-sum_k t_k log p(idx_k), mean over rows, from a full (m, D) log-probability matrix."""
    t2 = t.reshape(t.shape[0], -1)
    v = (t2 >= 0).to(log_probs.dtype) if val is None else val.reshape(t2.shape) * (t2 >= 0)
    return -(v * log_probs.gather(1, t2.clamp(min=0))).sum(1).mean()


def grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


HEADS = {
    "softmax": lambda: SoftmaxHead(num_classes=D, hidden_dim=d),
    "hsoftmax": lambda: HierarchicalSoftmaxHead(num_classes=D, hidden_dim=d, class_counts=zipf_counts()),
    "adaptive": lambda: AdaptiveSoftmaxHead(num_classes=D, hidden_dim=d, cutoffs=[4]),
    "sampled_rff": lambda: SampledSoftmaxHead(num_classes=D, hidden_dim=d, sampler="rff", num_samples=4),
}


def KernelTreeOf(head):  # noqa: N802
    tree = KernelSumTree(head.sampler.tree.kernel, head.sampler.tree.leaf_size)
    tree.build(head._keys(head.weight).detach())
    return tree.sums
