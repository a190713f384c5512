"""HeadSteps: a spherical head in a plain LightningModule steps at Lightning's optimizer
step: exact gradient accumulation, and the unscaled step under a GradScaler (16-mixed)."""
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.tuner import Tuner

from lst_lightning.app.callbacks import HeadSteps
from lst_lightning.app.train import run

from app_configs import FAST, cfg_of
from head_pairs import deferred, make_pair, rel, state_of

IN, D, d = 6, 40, 8


class Plain(pl.LightningModule):
    """A user's module: a linear body, a spherical head, SGD on the body."""

    def __init__(self, head):
        super().__init__()
        torch.manual_seed(7)
        self.body = torch.nn.Linear(IN, d, dtype=torch.float64)
        self.head = head

    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.autocast("cpu", enabled=False):  # the scaler's path alone, in float64
            return self.head(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.body.parameters(), lr=0.05)


def data(n=6, m=4, K=2):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(n * m, IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, D, (n * m, K), generator=g)
    y[0, 1] = -1  # padding
    y[1, 1] = y[1, 0]  # a class repeated in a row
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=m)


def fit(module, **trainer_kw):
    trainer = pl.Trainer(**{**dict(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                                   enable_progress_bar=False, enable_model_summary=False, callbacks=[HeadSteps()]),
                            **trainer_kw})
    trainer.fit(module, data())
    return trainer


def by_hand(head, *groups):
    """The reference: per optimizer step, one forward and backward on the union of ``group`` batches
    (an epoch for each of ``groups``)."""
    module = Plain(head)
    opt = torch.optim.SGD(module.body.parameters(), lr=0.05)
    batches = list(data())
    for group in groups:
        for i in range(0, len(batches), group):
            x, y = (torch.cat(t) for t in zip(*batches[i:i + group]))
            opt.zero_grad()
            head(module.body(x), y).backward()
            opt.step()
    return module


@pytest.mark.parametrize("which", [0, 1])  # factored, naive
def test_accumulate_grad_batches_is_one_step_on_the_union(which):
    heads = make_pair("spherical_softmax", D=D, d=d, lr=0.3, weight_decay=0.01)
    ref_heads = make_pair("spherical_softmax", D=D, d=d, lr=0.3, weight_decay=0.01)
    head, ref = heads[which], ref_heads[which]
    ref.reset_weight(head.weight())
    module = Plain(head)
    trainer = fit(module, accumulate_grad_batches=2)
    reference = by_hand(ref, 2)
    assert trainer.global_step == 3 and int(head.steps) == 3 and not head.attached
    assert rel(head.weight(), ref.weight()) < 1e-12
    assert rel(module.body.weight, reference.body.weight) < 1e-12


@pytest.mark.parametrize("which", [0, 1])  # factored, naive
def test_a_gradient_accumulation_scheduler_gives_one_step_on_each_union(which):
    """Lightning's GradientAccumulationScheduler sets accumulate_grad_batches at each epoch's start,
    after training started: HeadSteps attaches for its largest (it saw 1 and left the head
    stepping in each backward, half steps in the second epoch)."""
    head = make_pair("spherical_softmax", D=D, d=d, lr=0.3)[which]
    ref = make_pair("spherical_softmax", D=D, d=d, lr=0.3)[which]
    ref.reset_weight(head.weight())
    module = Plain(head)
    schedule = pl.callbacks.GradientAccumulationScheduler({0: 1, 1: 2})
    trainer = fit(module, max_epochs=2, callbacks=[HeadSteps(), schedule])
    reference = by_hand(ref, 1, 2)
    assert trainer.global_step == 9 and int(head.steps) == 9
    assert rel(head.weight(), ref.weight()) < 1e-12
    assert rel(module.body.weight, reference.body.weight) < 1e-12


def test_the_learning_rate_finder_leaves_no_warning_for_the_fit_after_it():
    """Lightning's Tuner.lr_find runs steps without the Trainer's callbacks (the head unattached,
    stepping in each of the accumulated backwards), then restores the state it saved: the fit after
    it is the fit without it, and says nothing of the finder's steps."""
    module = Plain(make_pair("zloss", D=D, d=d, lr=0.3)[0])
    module.lr = 0.05
    module.configure_optimizers = lambda: torch.optim.SGD(module.body.parameters(), lr=module.lr)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[HeadSteps()],
                         accumulate_grad_batches=2)
    Tuner(trainer).lr_find(module, data(), num_training=3, update_attr=False)
    assert int(module.head.steps) == 0
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*multiplied by")
        trainer.fit(module, data())
    assert trainer.global_step == int(module.head.steps) == 3


def test_accumulation_with_sampled_classes_equals_the_naive_head():
    """loss=sampled draws its negatives per micro-batch, so no union of batches is the
    reference; under Lightning's accumulation the factored head takes one exact step per
    optimizer step on both micro-batches' slots, equal to the naive head's on the same draws."""
    f, n = make_pair("sampled", D=D, d=d, lr=0.3)
    module_f, module_n = Plain(f), Plain(n)
    trainer = fit(module_f, accumulate_grad_batches=2)
    fit(module_n, accumulate_grad_batches=2)
    assert trainer.global_step == 3 and int(f.steps) == int(n.steps) == 3 and not f.attached
    assert rel(f.weight(), n.weight()) < 1e-10
    assert rel(module_f.body.weight, module_n.body.weight) < 1e-10


def test_16_mixed_grad_scaler_step_is_unscaled():
    head, _ = make_pair("zloss", D=D, d=d, lr=0.3)
    ref, _ = make_pair("zloss", D=D, d=d, lr=0.3)
    ref.reset_weight(head.weight())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    module = Plain(head)
    fit(module, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])  # Trainer(precision=) says bf16 on CPU
    reference = by_hand(ref, 1)
    assert scaler.get_scale() == 2.0 ** 16 and int(head.steps) == 6  # it scaled and skipped nothing
    assert rel(head.weight(), ref.weight()) < 1e-12  # not a 65536x step
    assert rel(module.body.weight, reference.body.weight) < 1e-12


class Manual(Plain):
    """Manual optimization, without HeadSteps: the head attached by hand to ``self.optimizers()``
    (a LightningOptimizer), two micro-batches an optimizer step."""

    def __init__(self, head):
        super().__init__(head)
        self.automatic_optimization = False

    def on_train_start(self):
        self.head.attach(self.optimizers())

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(super().training_step(batch, batch_idx) / 2)
        if batch_idx % 2 == 1:
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("which", [0, 1])  # factored, naive
def test_manual_optimization_under_16_mixed_attaches_with_the_trainers_scaler(which):
    """``head.attach(self.optimizers())`` takes the scaler of the Trainer's precision: one unscaled
    step per optimizer step, on the union (not given it, the head stepped 65 536 times too far)."""
    head = make_pair("zloss", D=D, d=d, lr=0.3)[which]
    ref = make_pair("zloss", D=D, d=d, lr=0.3)[which]
    ref.reset_weight(head.weight())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    module = Manual(head)
    fit(module, callbacks=[], plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    reference = by_hand(ref, 2)
    assert head.pending.scaler is scaler and scaler.get_scale() == 2.0 ** 16 and int(head.steps) == 3
    assert rel(head.weight(), ref.weight()) < 1e-12
    assert rel(module.body.weight, reference.body.weight) < 1e-12


@pytest.mark.parametrize("which", [0, 1])  # factored, naive
def test_weight_averaging_of_a_factored_heads_buffers_is_refused_and_without_them_the_head_is_as_trained(which):
    """Lightning's EMAWeightAveraging averages every buffer by default and writes the average into
    the module at the end of training: a factored head's averaged factors are no factored head
    (without HeadSteps, here: U U^-1 off I, Q off W^T W, the step counter averaged). Refused in
    one line before any step; the naive head's W is the weight itself and averages. With
    use_buffers=False the body is averaged and the head ends bit for bit as without the callback."""
    ema = pytest.importorskip("lightning.pytorch.callbacks").EMAWeightAveraging

    def fresh():
        torch.manual_seed(0)  # make_pair draws W from torch's generator
        return make_pair("zloss", D=D, d=d, lr=0.5)[which]

    alone = fresh()
    fit(Plain(alone), max_epochs=2)
    head = fresh()
    before = state_of(head)
    if which == 0:
        broken = fresh()  # why: the averaged factors, written into the head by the callback alone
        fit(Plain(broken), max_epochs=2, callbacks=[ema(decay=0.5)])
        W, eye = broken.weight(), torch.eye(d, dtype=torch.float64)
        assert (broken.U @ broken.Uinv - eye).abs().max() > 1e-4 and (broken.Q - W.T @ W).abs().max() > 1e-2
        assert int(broken.steps) != 12
        with pytest.raises(ValueError, match=r"EMAWeightAveraging averages every buffer.*use_buffers=False\)") as e:
            fit(Plain(head), max_epochs=2, callbacks=[HeadSteps(), ema(decay=0.5)])
        assert "\n" not in str(e.value) and int(head.steps) == 0
        assert all(torch.equal(v, before[k]) for k, v in state_of(head).items())
    else:
        fit(Plain(head), max_epochs=2, callbacks=[HeadSteps(), ema(decay=0.5)])  # W averaged, as a weight is
        assert not torch.equal(head.weight(), alone.weight())
    head = fresh()
    fit(Plain(head), max_epochs=2, callbacks=[HeadSteps(), ema(decay=0.5, use_buffers=False)])
    assert int(head.steps) == 12 and all(torch.equal(v, state_of(alone)[k]) for k, v in state_of(head).items())


def test_heads_that_cannot_wait_are_refused_before_any_step():
    head = deferred(num_classes=D, hidden_dim=d, step="fused", bias=False)
    W0 = head.weight()
    with pytest.raises(ValueError, match="accumulate_grad_batches=2 needs the head to step"):
        fit(Plain(head), accumulate_grad_batches=2)
    assert torch.equal(head.weight(), W0) and int(head.steps) == 0


def test_lst_train_accumulation_equals_the_doubled_batch(tmp_path):
    """lst-train trainer.accumulate_grad_batches=2 over batches of 16 == batches of 32 (the
    sampler's same permutation): one head step per optimizer step, on the union. With the
    Z-loss: the default loss=sampled draws its negatives per micro-batch, so two micro-batches
    see other negatives than their union (its accumulation: the test above, and
    tests/spherical/test_sampled_slots.py)."""
    over = [*FAST, "head=factored", "loss=zloss", "trainer.max_epochs=1", "test=false", "model.dropout=0.0"]
    res = run(cfg_of(*over, "data.batch_size=16", "trainer.accumulate_grad_batches=2",
                     "trainer.limit_train_batches=6"), tmp_path / "acc")
    run(cfg_of(*over, "data.batch_size=32", "trainer.limit_train_batches=3"), tmp_path / "big")
    a, b = (torch.load(tmp_path / n / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
            for n in ("acc", "big"))
    assert res["train_steps"] == 3 and int(a["head.steps"]) == int(b["head.steps"]) == 3
    for k in a:  # float32: the mean of two means against one mean
        if torch.is_tensor(a[k]) and a[k].is_floating_point():
            assert rel(a[k], b[k]) < 1e-5, k


def test_accumulation_without_the_callback_warns_once():
    head, _ = make_pair("zloss", D=D, d=d, lr=0.3)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2)
    with pytest.warns(UserWarning, match="multiplied by 0.5.*HeadSteps") as caught:
        trainer.fit(Plain(head), data())
        head.sync()  # device flags: said at the next read of the flags (every 64 steps; here, by hand)
    (message,) = [str(w.message) for w in caught if "multiplied by" in str(w.message)]
    fix = message.split("`")[1]  # the callback's import, as the warning gives it
    namespace = {}
    exec(fix, namespace)
    assert namespace["HeadSteps"] is HeadSteps
    assert int(head.steps) == 6  # half steps, as warned


def test_training_that_raises_detaches_the_heads():
    """An exception inside an accumulation window: HeadSteps detaches the head (the rows kept
    for the step that will not come are dropped), so it steps in each backward again."""
    class Failing(Plain):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise RuntimeError("a bad batch")
            return super().training_step(batch, batch_idx)

    head, _ = make_pair("zloss", lr=0.1)
    module = Failing(head)
    with pytest.raises(RuntimeError, match="a bad batch"):
        fit(module, accumulate_grad_batches=2)
    assert not head.attached and head.pending_rows == 0 and int(head.steps) == 0
    x, y = next(iter(data()))
    head(module.body(x), y).backward()
    assert int(head.steps) == 1
