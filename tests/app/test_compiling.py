"""compile=: a compiled training run (the n-gram body and the sampled softmax with static rows,
RowAdam's update) equals the eager run, its recompiles are counted and bounded, and what cannot
be compiled whole is refused in one line (compile=true) or left eager (auto). torch.compile runs
with the aot_eager backend here: the same graphs as Inductor's, without its C++ build."""
from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader

import lst_lightning.rows.adam as row_adam
import lst_lightning.rows.sgd as row_sgd
from lst_lightning.app.compiling import Compiled, choose, install
from lst_lightning.app.loss_checks import LossChecks
from lst_lightning.app.module import LanguageModel, as_rows
from lst_lightning.app.optimizers import clip_gradients, make_optimizer
from lst_lightning.baselines import AdaptiveSoftmaxHead, SampledSoftmaxHead, SoftmaxHead
from lst_lightning.models import LSTMBody, NgramMLP
from lst_lightning.spherical import FactoredSphericalHead

from host_reads import HostReads

V, D, CTX, d = 60, 300, 3, 8
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def aot_eager(monkeypatch):
    """torch.compile with the aot_eager backend (and fresh caches), its counters from zero."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", functools.partial(lambda *a, **k: compile_(
        *a, **{**{x: y for x, y in k.items() if x != "mode"}, "backend": "aot_eager"})))
    monkeypatch.setattr(row_adam, "_compiled", {})
    monkeypatch.setattr(row_sgd, "_compiled", {})
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def model(compiled: bool, preconditioner: dict | None = None, **optimizer):
    torch.manual_seed(0)
    body = NgramMLP(V, CTX, embed_dim=4, hidden_sizes=[16], hidden_dim=d, sparse_embedding=True)
    head = SampledSoftmaxHead(num_classes=D, hidden_dim=d, num_samples=16, bias=True, sparse=True,
                              preconditioner=preconditioner)
    lm = LanguageModel(body, head, optimizer={"name": "adam", "lr": 0.01, "embedding": "row_adam", **optimizer})
    lm.compiled = Compiled(body=compiled, head=compiled)
    install(body, head, lm.compiled)
    opt = make_optimizer(lm, lm.optim_cfg, head=head, compiled_rows="" if compiled else None)
    return lm, opt


def batches(sizes):
    g = torch.Generator().manual_seed(1)
    # ids repeat within a batch (40 of 60 input ids, Zipf-like targets)
    return [(torch.randint(0, 40, (m, CTX), generator=g), torch.randint(0, D // 3, (m,), generator=g) ** 1)
            for m in sizes]


def train(lm, opt, data):
    losses = []
    lm.train()
    for i, (x, y) in enumerate(data):
        torch.manual_seed(100 + i)  # the sampled classes: the same draws eager and compiled
        loss = lm.head(*as_rows(lm.body(x), y))
        loss.backward()
        clip_gradients([p for g in opt.param_groups for p in g["params"]], 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def test_a_compiled_run_equals_the_eager_run_and_recompiles_are_bounded(aot_eager):
    data = batches([24] * 5 + [10])  # an epoch's last, smaller batch: one more graph each
    eager, opt_e = model(False)
    want = train(eager, opt_e, data)
    assert counters["stats"]["unique_graphs"] == 0
    comp, opt_c = model(True)
    got = train(comp, opt_c, data)
    # tolerance: float32, six steps of Adam; the graphs run torch's own ops (aot_eager)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (k, a), b in zip(eager.state_dict().items(), comp.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=k)
    # the body and the head: a graph each for the batch of 24 and for the last of 10; RowAdam's
    # update: a graph each for its three tables (the embedding, W, b), whose static rows keep their size
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 2 * 2 + 3, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    train(comp, opt_c, batches([24, 10]))  # the same shapes again: no graph more
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_preconditioned_rows_compile_whole_and_equal_eager(aot_eager):
    """The sampled softmax with P on its drawn rows (head.preconditioner), its rows stepped by SGD in
    static shapes (optimizer.head_rows=row_sgd, as on a GPU): its autograd function, the moments it
    writes in the forward and the rows' update compile with no graph break, and the run equals eager."""
    data = batches([24] * 4)
    rows = {"head_rows": "row_sgd", "head_lr": 4.0}
    eager, opt_e = model(False, preconditioner={}, **rows)
    want = train(eager, opt_e, data)
    comp, opt_c = model(True, preconditioner={}, **rows)
    got = train(comp, opt_c, data)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert float(comp.head.input_moment_weight) > 0 and counters["stats"]["unique_graphs"] > 0
    for (k, a), b in zip(eager.state_dict().items(), comp.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=k)
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("mode, marks", [("reduce-overhead", 3), ("max-autotune-no-cudagraphs", 0)])
def test_each_step_under_cuda_graphs_is_one_generation_of_the_graph_trees(aot_eager, monkeypatch, mode, marks):
    """Under CUDA graph trees each training step marks its start once (torch's
    cudagraph_mark_step_begin): RowAdam's compiled update, after the backward, then runs in the
    step's generation instead of starting one that frees the row ids and gradients it reads (on a
    GPU: "accessing tensor output of CUDAGraphs that has been overwritten"). Without CUDA graphs
    nothing is marked. A Lightning run, its forwards and RowAdam compiled."""
    calls = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: calls.append(1))
    lm, _ = model(False)
    lm.compiled = Compiled(body=True, head=True, mode=mode)
    trainer = pl.Trainer(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(lm, DataLoader(batches([8] * 3), batch_size=None))
    assert len(calls) == marks and lm.body.forward.calls == 3
    assert not Compiled(mode="reduce-overhead").graphed  # nothing compiled: nothing to mark


def test_auto_compiles_on_a_gpu_what_compiles_whole_and_says_why_not_the_rest():
    body = NgramMLP(V, CTX, sparse_embedding=True)
    sampled = SampledSoftmaxHead(num_classes=D, hidden_dim=128, sparse=False)
    c = choose("auto", body, sampled, CUDA)
    assert (c.body, c.head, c.mode, c.why_not) == (True, True, "reduce-overhead", [])
    c = choose("auto", body, SoftmaxHead(num_classes=D, hidden_dim=128), CUDA)
    if hasattr(torch.nn.functional, "linear_cross_entropy"):  # torch's fused kernel runs as it is
        assert c.body and not c.head and "F.linear_cross_entropy" in c.describe()
    else:  # torch 2.11 and 2.12: the same loss unfused, compiled with the body
        assert c.body and c.head
    c = choose("auto", body, FactoredSphericalHead(num_classes=D, hidden_dim=128), CUDA)
    assert c.body and not c.head and "steps itself" in c.describe()
    assert not choose("auto", body, sampled, CPU).any  # on the CPU: nothing
    assert not choose("auto", body, sampled, CUDA, world_size=2).any
    assert not choose("auto", body, sampled, CUDA, accumulate=2).any
    assert not choose(False, body, sampled, CUDA).any
    c = choose("max-autotune", body, sampled, CPU)
    assert c.body and c.head and c.mode == "max-autotune"


@pytest.mark.parametrize("body,head,match", [
    (LSTMBody(V, CTX), SampledSoftmaxHead(num_classes=D, hidden_dim=128), "LSTMBody cannot be compiled whole: .*nn.LSTM"),
    (NgramMLP(V, CTX), AdaptiveSoftmaxHead(num_classes=D, hidden_dim=128), "AdaptiveSoftmaxHead cannot be compiled"),
    (NgramMLP(V, CTX), SampledSoftmaxHead(num_classes=D, hidden_dim=128, sparse=True), "torch sparse tensor"),
])
def test_compile_true_refuses_what_cannot_be_compiled_whole_in_one_line(body, head, match):
    with pytest.raises(ValueError, match=match) as e:
        choose(True, body, head, CPU)
    assert "\n" not in str(e.value) and str(e.value).startswith("compile=true: ")


def test_a_bad_setting_is_refused():
    with pytest.raises(ValueError, match="compile must be auto, true, false or a torch.compile mode"):
        choose("fast", NgramMLP(V, CTX), SoftmaxHead(num_classes=D, hidden_dim=128), CPU)


def test_the_loss_is_read_every_n_steps_and_a_non_finite_one_names_its_step():
    checks = LossChecks(check_every=4)
    with HostReads() as reads:
        for step in range(3):
            checks.record(torch.tensor(1.0), step)
    assert reads.count == 0  # no host read between the due steps
    with pytest.raises(FloatingPointError, match="at step 3 "):
        checks.record(torch.tensor(float("nan")), 3)  # due at step 3: read
    checks = LossChecks(check_every=4)
    checks.record(torch.tensor(float("inf")), 1)
    checks.record(torch.tensor(float("nan")), 2)
    with pytest.raises(FloatingPointError, match="non-finite training loss at step 1 .read at step 3"):
        checks.record(torch.tensor(1.0), 3)


class _Breaks(torch.nn.Module):
    """A body whose forward reads a value on the host: a graph break."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        y = self.lin(x)
        return y * 2 if float(y.sum()) > 0 else y


def test_a_body_that_breaks_its_graph_is_refused_in_one_line_at_its_first_compiled_call(aot_eager):
    from lst_lightning.app.compiling import TrainingForward  # noqa: PLC0415

    body = _Breaks()
    forward = TrainingForward(body, None)
    x = torch.randn(2, 3)
    forward(x)  # the first training call: eager
    with pytest.raises(ValueError, match="compile: _Breaks cannot be compiled whole: .*compile=false") as e:
        forward(x)
    assert "\n" not in str(e.value)
    body.eval()
    forward(x)  # outside training: eager, nothing compiled


def test_the_embedding_optimizer_follows_the_compilation(tmp_path):
    """optimizer.embedding=auto (the default): SparseAdam where the run runs eager on a CPU
    (faster there), RowAdam where it compiles or trains on a GPU (its static rows compile whole); a name given
    is kept."""
    from lst_lightning.app.optimizers import embedding_for  # noqa: PLC0415
    from lst_lightning.app.train import build  # noqa: PLC0415

    from app_configs import FAST, cfg_of  # noqa: PLC0415

    assert (embedding_for("auto", False), embedding_for("auto", True), embedding_for("adagrad", True)) == (
        "sparse_adam", "row_adam", "adagrad")
    # on a GPU, compiled or not (several processes, accumulation): static rows, no host read a step
    assert (embedding_for("auto", False, "cuda"), embedding_for("sparse_adam", False, "cuda")) == (
        "row_adam", "sparse_adam")
    for setting, want in (("auto", "sparse_adam"), ("true", "row_adam")):
        _, module, _ = build(cfg_of(*FAST, "head=sampled", f"compile={setting}"), tmp_path / setting)
        assert module.optim_cfg["embedding"] == want, setting


def test_language_model_refuses_an_unresolved_auto_embedding_in_one_line():
    """lst-train resolves optimizer.embedding=auto; a LanguageModel built by hand from the config is told how."""
    from lst_lightning.app.module import LanguageModel  # noqa: PLC0415
    from lst_lightning.baselines.softmax import SoftmaxHead  # noqa: PLC0415

    with pytest.raises(ValueError, match="embedding_for") as e:
        LanguageModel(torch.nn.Embedding(10, 4), SoftmaxHead(num_classes=10, hidden_dim=4), optimizer={"embedding": "auto"})
    assert "\n" not in str(e.value)
