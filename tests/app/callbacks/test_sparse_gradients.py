"""SparseGradients and LanguageModel's part in it: the row-sparse parameters (a sparse
embedding, a head.sparse head's rows) are kept out of DDP and the module adds the
callback once; alone, the callback changes nothing. Its work on two ranks (the averaged
gradients, the bytes logged) is tested in tests/app/test_ddp.py and
tests/app/test_sparse_exchange.py."""
from types import SimpleNamespace

import torch

from lst_lightning.app.callbacks import SparseGradients
from lst_lightning.app.module import LanguageModel
from lst_lightning.baselines import HierarchicalSoftmaxHead
from lst_lightning.models import NgramMLP


def model(sparse: bool) -> LanguageModel:
    body = NgramMLP(20, 2, 4, [4], 4, sparse_embedding=sparse)
    head = HierarchicalSoftmaxHead(num_classes=30, hidden_dim=4, class_counts=torch.ones(30), sparse=sparse)
    return LanguageModel(body, head, optimizer={"embedding": "sparse_sgd" if sparse else "dense"})


def test_the_row_sparse_parameters_are_kept_out_of_ddp_and_the_callback_added():
    m = model(sparse=True)
    m.setup("fit")
    sparse = {id(p) for p in m.parameters() if p.requires_grad and
              (p is m.body.input_embedding.weight or any(p is q for q in m.head.sparse_parameters()))}
    ignored = set(m._ddp_params_and_buffers_to_ignore)
    assert "body.input_embedding.weight" in ignored and len(sparse) >= 2
    assert {n for n, p in m.named_parameters() if id(p) in sparse} <= ignored
    assert not any(n.startswith("body.") and n != "body.input_embedding.weight" for n in ignored)  # dense: DDP's
    assert [type(c) for c in m.configure_callbacks()] == [SparseGradients]
    dense = model(sparse=False)
    dense.setup("fit")
    assert not getattr(dense, "_ddp_params_and_buffers_to_ignore", []) and dense.configure_callbacks() == []


def test_alone_the_callback_leaves_the_gradients_as_they_are():
    m = model(sparse=True)
    m(torch.randint(0, 20, (5, 2))).sum().backward()
    before = m.body.input_embedding.weight.grad
    trainer = SimpleNamespace(world_size=1)
    cb = SparseGradients()
    cb.on_fit_start(trainer, m)
    cb.on_before_optimizer_step(trainer, m, None)
    assert m.body.input_embedding.weight.grad is before and cb.bytes_last_step == 0
