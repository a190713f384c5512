"""The naive/factored head pair the spherical tests compare step after step, and
their batches: padding, classes repeated within a row and across rows; ``no_host_reads``."""
import contextlib
import io
import sys

import pytest
import torch

from lst_lightning.spherical import FactoredSphericalHead, NaiveSphericalHead
from lst_lightning.distributed.collectives import bit_hash
from lst_lightning.spherical.state import EXACT_STATE

from host_reads import cpu_kernel

LOSS_KW = {"zloss": {"a": 0.5, "b": 2.0}, "sampled": {"spherical_kwargs": {"a": 0.5, "b": 2.0}}}
#: the composite loss needs sampled classes: both heads of a pair draw the same ones (one seed)
HEAD_KW = {"sampled": {"negatives": {"num": 5, "seed": 7}, "preconditioner": None}}  # P: test_preconditioner.py
D, d = 60, 8  # the sizes of ``deferred`` heads


@contextlib.contextmanager
def no_host_reads(monkeypatch):
    """Any read of a tensor's value into Python (the host synchronisations on a GPU) raises,
    but a CPU kernel's own branch on a CPU value (``host_reads.cpu_kernel``)."""
    with monkeypatch.context() as mp:
        for name in ("__bool__", "__float__", "__int__", "__index__", "item", "tolist"):
            def refuse(t, *a, _original=getattr(torch.Tensor, name), **k):
                if cpu_kernel(t, sys._getframe(1)):
                    return _original(t, *a, **k)
                raise AssertionError("the step read a device value on the host")
            mp.setattr(torch.Tensor, name, refuse)
        yield


def make_pair(loss, D=60, d=8, bias=False, dtype=torch.float64, ref_dtype=None, scale=0.3, stabiliser=None,
              sync_every=None, **kw):
    """A factored head (with ``stabiliser`` settings; ``sync_every``: its checks, None the
    head's default, device flags) and a naive head, both at one random W."""
    args = dict(num_classes=D, hidden_dim=d, loss=loss, loss_kwargs=LOSS_KW.get(loss, {}), bias=bias)
    args.update(HEAD_KW.get(loss, {}))
    args.update(kw)
    f = FactoredSphericalHead(dtype=dtype, stabiliser=stabiliser, **args,
                              **({} if sync_every is None else {"sync_every": sync_every}))
    n = NaiveSphericalHead(dtype=ref_dtype or dtype, **args)
    W0 = torch.randn(D, d + bias, dtype=torch.float64) * scale
    f.reset_weight(W0.to(dtype))
    n.reset_weight(W0.to(ref_dtype or dtype))
    return f, n


def batch(m, d, D, K, classes=None, dtype=torch.float64):
    """Targets with padding, a class repeated within a row and classes shared across rows."""
    H = torch.randn(m, d, dtype=dtype)
    idx = torch.randint(0, classes or D, (m, K))
    if K > 1:
        idx[0, -1] = -1
        if m > 1:
            idx[1, 1] = idx[1, 0]
    if m > 2:
        idx[2, 0] = idx[0, 0]
    return H, idx


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def step_both(f, n, H, idx, val=None, scale=1.0):
    """One step of both heads on copies of the batch, each on its own device."""
    on = lambda t, head: None if t is None else t.to(head.device)  # noqa: E731
    Hf = H.clone().to(f.device, f.dtype).requires_grad_()
    Hn = H.clone().to(n.device, n.dtype).requires_grad_()
    Lf = f(Hf, on(idx, f), on(val, f))
    Ln = n(Hn, on(idx, n), on(val, n))
    (scale * Lf).backward()
    (scale * Ln).backward()
    return rel(Lf, Ln), rel(Hf.grad, Hn.grad), rel(f.weight(), n.weight())


def hard_batch(m=7, K=3, classes=8, d=6):
    """K > 1 targets over a few classes (sampled negatives hit them: accidental hits),
    padding -1 and -100, a class repeated within a row and across rows, a fully padded row."""
    H = torch.randn(m, d, dtype=torch.float64)
    idx = torch.randint(0, classes, (m, K))
    idx[0, -1] = -1
    idx[1, 1] = idx[1, 0]
    idx[2, 0] = idx[0, 0]
    idx[3, 2] = -100
    idx[4] = -1
    return H, idx


def run_hard(f, n, steps=5, tol=1e-10, **kw):
    """``steps`` steps of both heads on hard batches (``hard_batch(**kw)``): loss, dL/dH and W equal."""
    for _ in range(steps):
        errs = step_both(f, n, *hard_batch(**kw))
        assert max(errs) < tol, f"relative errors (loss, dL/dH, W) = {errs}"


def assert_resumes_alike(make, batches, before=3, after=3):
    """A head (``make()``) trained ``before`` steps, saved, loaded into a fresh one: the next
    ``after`` steps of both give bit-identical losses and W. Returns the loaded head."""
    f = make()
    for _ in range(before):
        H, idx = batches()
        f(H.clone().requires_grad_(), idx).backward()
    buf = io.BytesIO()
    torch.save(f.state_dict(), buf)
    g = make()
    buf.seek(0)
    g.load_state_dict(torch.load(buf, weights_only=False))
    for _ in range(after):
        H, idx = batches()
        Lf, Lg = f(H.clone().requires_grad_(), idx), g(H.clone().requires_grad_(), idx)
        Lf.backward()
        Lg.backward()
        assert torch.equal(Lf, Lg)
    assert torch.equal(f.weight(), g.weight())
    return g


def accumulate_both(f, n, batches, steps=2, micro=2, tol=1e-10):
    """Both heads attached to an optimizer, ``micro`` micro-batches (``batches()``: H, idx) per
    optimizer step: dL/dH and, after each step, W equal within ``tol``."""
    fo, no = (torch.optim.SGD([torch.zeros(1, requires_grad=True)]) for _ in range(2))
    f.attach(fo)
    n.attach(no)
    for _ in range(steps):
        for _ in range(micro):
            H, idx = batches()
            Hf, Hn = H.clone().requires_grad_(), H.clone().requires_grad_()
            f(Hf, idx).backward()
            n(Hn, idx).backward()
            assert rel(Hf.grad, Hn.grad) < tol
        fo.step()
        no.step()
        assert rel(f.weight(), n.weight()) < tol


def run_steps(f, n, steps, m, K, classes=10, tol=1e-9, vals=False):
    worst = [0.0, 0.0, 0.0]
    for _ in range(steps):
        H, idx = batch(m, f.hidden_dim, f.num_classes, K, classes)
        val = torch.rand(idx.shape, dtype=torch.float64) + 0.5 if vals else None
        errs = step_both(f, n, H, idx, val)
        worst = [max(w, e) for w, e in zip(worst, errs)]
    assert max(worst) <= tol, f"relative errors (loss, dL/dH, W) = {worst}"
    return worst


def deferred(sync_every=4, **kw):
    args = dict(num_classes=D, hidden_dim=d, loss="zloss", loss_kwargs={"a": 0.5, "b": 2.0}, lr=0.05,
                bias=True, dtype=torch.float64, sync_every=sync_every)
    args.update(kw)
    return FactoredSphericalHead(**args)


def step(head, H, idx):
    """One training step on a copy of H; returns dL/dH."""
    Hc = H.clone().requires_grad_()
    head(Hc, idx).backward()
    return Hc.grad


def state(head):
    """A hash of the head's exact state (V, U, U^-1, omega, Q, wbar, the carried bound: state.py)."""
    return bit_hash([getattr(head, n) for n in EXACT_STATE])


def state_of(head):
    return {k: v.clone() for k, v in head.state_dict().items() if isinstance(v, torch.Tensor)}


def assert_load_refused(head, saved: dict, match: str, generator, error: type = ValueError) -> None:
    """Loading ``saved`` into ``head`` is refused in one line matching ``match`` (an ``error``); the
    head's state and ``generator``'s state (its negatives' draws) are left as they were."""
    before, rng = state_of(head), generator.get_state()
    with pytest.raises(error, match=match) as err:
        head.load_state_dict(saved)
    assert "\n" not in str(err.value)
    assert_untouched(head, before)
    assert torch.equal(generator.get_state(), rng)


def assert_untouched(head, before):
    for k, v in head.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, before[k]), f"{k} changed"
