"""The spherical heads in the precision and dtype setups of a real training run (base.py):
H in any float dtype under any autocast context, the state dtype following .double() and
.to(float64), half precision kept out of the state, a head built on the meta device."""
import warnings

import lightning.pytorch as pl
import pytest
import torch

from lst_lightning.spherical import FactoredSphericalHead, NaiveSphericalHead

from head_pairs import batch, make_pair, run_steps

HEADS = [FactoredSphericalHead, NaiveSphericalHead]


def twins(cls, loss="zloss", **kw):
    """Two equal heads: one to step under autocast, one the fp32 reference."""
    return (cls(40, 8, loss=loss, bias=True, generator=torch.Generator().manual_seed(3), **kw) for _ in range(2))


def assert_same_state(a, b):
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), k


@pytest.mark.parametrize("cls", HEADS)
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h_dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_autocast_step_is_the_float32_step(cls, autocast_dtype, h_dtype):
    head, ref = twins(cls, loss="spherical_softmax")
    idx = torch.tensor([[1, -1], [5, 5], [1, 39], [-1, -1], [7, 2]])
    for _ in range(3):
        H = torch.randn(5, 8).to(h_dtype).requires_grad_()
        with torch.autocast("cpu", dtype=autocast_dtype):
            L = head(H, idx)
        L.backward()
        Hr = H.detach().float().requires_grad_()
        Lr = ref(Hr, idx)
        Lr.backward()
        assert L.dtype == torch.float32 and torch.equal(L, Lr)
        assert H.grad.dtype == h_dtype and torch.equal(H.grad, Hr.grad.to(h_dtype))
    assert_same_state(head, ref)
    with torch.autocast("cpu", dtype=autocast_dtype):
        sc, top = head.scores(H), head.topk(H, 3)
        logp, rank = head.log_prob(H, idx[:, 0].clamp(min=0)), head.target_rank(H, idx[:, 0].clamp(min=0))
    assert sc.dtype == torch.float32 and torch.equal(sc, ref.scores(H.detach()))
    assert torch.equal(top[1], ref.topk(H.detach(), 3)[1])
    assert torch.equal(logp, ref.log_prob(H.detach(), idx[:, 0].clamp(min=0)))
    assert torch.equal(rank, ref.target_rank(H.detach(), idx[:, 0].clamp(min=0)))


@pytest.mark.parametrize("move", [lambda h: h.double(), lambda h: h.to(torch.float64),
                                  lambda h: h.to(dtype=torch.float64, device="cpu")])
def test_a_move_to_float64_takes_the_state_along(move):
    f, n = make_pair("zloss", dtype=torch.float32, bias=True)
    f, n = move(f), move(n)
    assert f.dtype == n.dtype == torch.float64 and f.V.dtype == f.Q.dtype == n.W.dtype == torch.float64
    W0 = torch.randn(60, 9, dtype=torch.float64) * 0.3
    f.reset_weight(W0)
    n.reset_weight(W0)
    run_steps(f, n, steps=6, m=5, K=2, tol=1e-9)  # exact in float64, padding and repeats included
    f.float()
    assert f.dtype == torch.float32 and f.V.dtype == torch.float32
    H, idx = batch(4, 8, 60, 2, dtype=torch.float32)
    f(H.requires_grad_(), idx).backward()


@pytest.mark.parametrize("cls", HEADS)
@pytest.mark.parametrize("move", [lambda h: h.half(), lambda h: h.bfloat16(), lambda h: h.to(torch.float16)])
def test_half_precision_keeps_the_state_float32_with_a_warning(cls, move):
    head, ref = twins(cls)
    with pytest.warns(UserWarning, match="keeps its state in torch.float32"):
        move(head)
    assert head.dtype == torch.float32
    assert all(t.dtype in (torch.float32, torch.float64, torch.long, torch.bool) for t in head.state_dict().values()
               if isinstance(t, torch.Tensor))
    assert_same_state(head, ref)  # nothing rounded on the way
    H = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    head(H, torch.tensor([1, 2, 3, 4])).backward()
    assert H.grad.dtype == torch.bfloat16 and int(head.steps) == 1


@pytest.mark.parametrize("cls", HEADS)
def test_built_on_meta_then_to_empty_and_reset_is_the_normal_head(cls):
    normal = cls(50, 8, loss="taylor_softmax", bias=True, generator=torch.Generator().manual_seed(7))
    with torch.device("meta"):
        head = cls(50, 8, loss="taylor_softmax", bias=True, generator=torch.Generator().manual_seed(7))
    assert head.device.type == "meta"
    head.to_empty(device="cpu")
    with pytest.raises(RuntimeError, match="reset_weight"):  # uninitialised memory is refused
        head(torch.randn(2, 8, requires_grad=True), torch.tensor([1, 2]))
    head.reset_weight()
    assert head.device.type == "cpu"
    assert_same_state(head, normal)
    for _ in range(30):  # and it trains like it
        H, idx = batch(6, 8, 50, 2, dtype=torch.float32)
        for h in (head, normal):
            h(H.clone().requires_grad_(), idx).backward()
    assert_same_state(head, normal)
    assert torch.isfinite(head.weight()).all() and int(head.steps) == 30


def test_reset_weight_without_w_restores_the_constructed_head():
    head, fresh = twins(FactoredSphericalHead)
    for _ in range(5):
        H, idx = batch(6, 8, 40, 2, dtype=torch.float32)
        head(H.requires_grad_(), idx).backward()
    head.reset_weight()
    assert_same_state(head, fresh)


class _UserModule(pl.LightningModule):
    """A plain user LightningModule: a linear body and the head as its output layer."""

    def __init__(self, head):
        super().__init__()
        self.body, self.head = torch.nn.Linear(8, 8), head

    def training_step(self, batch, _):
        x, y = batch
        return self.head(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.body.parameters(), lr=0.01)


def _fit(head, precision, steps=6):
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 8, generator=g), torch.randint(0, 40, (16,), generator=g)) for _ in range(steps)]
    torch.manual_seed(0)
    module = _UserModule(head)
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision=precision, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*(many workers|keeps its state).*")
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return module


@pytest.mark.parametrize("cls", HEADS)
@pytest.mark.parametrize("precision,state", [("64-true", torch.float64), ("bf16-true", torch.float32),
                                             ("bf16-mixed", torch.float32)])
def test_lightning_precisions_train_the_head(cls, precision, state):
    head, ref = twins(cls)
    module = _fit(head, precision)
    assert head.dtype == state and int(head.steps) == 6 and torch.isfinite(head.weight()).all()
    _fit(ref, "32-true")
    # bf16 bodies feed rounded H: close to fp32 training, not equal; float64 is closer still
    tol = 1e-6 if precision == "64-true" else 5e-3
    diff = (head.weight().double() - ref.weight().double()).norm() / ref.weight().double().norm()
    assert 0 < diff < tol or (precision == "64-true" and diff < tol)
    assert module.body.weight.dtype == (torch.bfloat16 if precision == "bf16-true" else state)
