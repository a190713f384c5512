"""The body's optimisers: a dense one for the ordinary parameters, and a row-sparse one
for the parameters of sparse ``nn.Embedding`` modules (the body's input embedding with
``model.sparse_embedding=true``), which reads and writes only the rows of the batch.

Lightning's automatic optimisation drives one optimiser, so ``PairedOptimizer`` presents
the two as one: its ``param_groups`` are the two optimisers' own group dicts (the lr
schedule sets both), ``step`` runs the closure once and steps both, the state dict holds
both (exact resume). ``clip_gradients`` clips dense and row-sparse gradients together
(torch's ``clip_grad_norm_`` refuses sparse gradients)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

DENSE = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
# optimizer.embedding: the optimiser of sparse embeddings' rows (dense: none may be sparse)
EMBEDDING = ("sparse_adam", "sparse_sgd", "adagrad", "dense")


def sparse_embedding_params(module: nn.Module) -> list[nn.Parameter]:
    """The weights of the sparse ``nn.Embedding`` modules (their gradients are row-sparse)."""
    return [m.weight for m in module.modules()
            if isinstance(m, nn.Embedding) and m.sparse and m.weight.requires_grad]


def check_optimizer_config(cfg: dict, module: nn.Module | None = None) -> None:
    """Bad names and lrs; with ``module``, a sparse embedding with no row-sparse optimiser."""
    if cfg["name"] not in DENSE:
        raise ValueError(f"optimizer.name must be one of {sorted(DENSE)}, not {cfg['name']!r}")
    if cfg.get("embedding", "dense") not in EMBEDDING:
        raise ValueError(f"optimizer.embedding must be one of {list(EMBEDDING)}, not {cfg.get('embedding')!r}")
    lr = cfg.get("embedding_lr")
    if lr is not None and not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"optimizer.embedding_lr must be a number > 0 or null (optimizer.lr), not {lr!r}")
    if module is not None and cfg.get("embedding", "dense") == "dense" and sparse_embedding_params(module):
        raise ValueError("the body has a sparse input embedding (model.sparse_embedding=true) but "
                         "optimizer.embedding=dense: set optimizer.embedding to one of "
                         f"{list(EMBEDDING[:-1])}, or model.sparse_embedding=false")


def _dense_optimizer(params: list, cfg: dict) -> torch.optim.Optimizer:
    kw = {"lr": cfg["lr"], "weight_decay": cfg.get("weight_decay", 0.0)}
    if cfg["name"] == "sgd":
        kw["momentum"] = cfg.get("momentum", 0.0)
    return DENSE[cfg["name"]](params, **kw)


def _sparse_optimizer(params: list, name: str, lr: float) -> torch.optim.Optimizer:
    # No weight decay and no momentum: both would touch all D rows every step.
    if name == "sparse_adam":
        return torch.optim.SparseAdam(params, lr=lr)
    if name == "sparse_sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.Adagrad(params, lr=lr)  # its sparse path updates only the rows given


def make_optimizer(module: nn.Module, cfg: dict) -> torch.optim.Optimizer:
    """The dense optimiser of ``cfg`` over the trainable parameters; with sparse
    embeddings in ``module``, a ``PairedOptimizer`` whose second half (``cfg['embedding']``,
    lr ``cfg['embedding_lr']`` or ``cfg['lr']``) steps their rows."""
    check_optimizer_config(cfg, module)
    sparse = sparse_embedding_params(module)
    name = cfg.get("embedding", "dense")
    ids = {id(p) for p in sparse}
    dense = [p for p in module.parameters() if p.requires_grad and id(p) not in ids]
    if not sparse:
        return _dense_optimizer(dense, cfg)
    lr = cfg.get("embedding_lr") or cfg["lr"]
    parts = (_dense_optimizer(dense, cfg) if dense else None, _sparse_optimizer(sparse, name, lr))
    for part, group_name in zip(parts, ("dense", "embedding")):
        if part is not None:  # LearningRateMonitor logs lr-PairedOptimizer/<name>
            part.param_groups[0]["name"] = group_name
    return PairedOptimizer(*parts)


class PairedOptimizer(torch.optim.Optimizer):
    """A dense optimiser and a row-sparse one, stepped as one (see the module docstring)."""

    def __init__(self, dense: torch.optim.Optimizer | None, sparse: torch.optim.Optimizer):
        self.parts = [o for o in (dense, sparse) if o is not None]
        # The parts' own group dicts: a schedule setting group["lr"] here sets it in the part.
        super().__init__([g for o in self.parts for g in o.param_groups], {})

    @property
    def state(self):  # Optimizer.__init__ assigns a fresh dict; the parts hold the real state
        merged = {}
        for o in getattr(self, "parts", ()):
            merged.update(o.state)
        return merged

    @state.setter
    def state(self, value) -> None:
        pass

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.parts:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"parts": [o.state_dict() for o in self.parts]}

    def load_state_dict(self, state_dict: dict) -> None:
        parts = state_dict.get("parts")
        if not isinstance(parts, list) or len(parts) != len(self.parts):
            raise ValueError(f"the checkpoint's optimiser state has {len(parts or ())} parts, this run's "
                             f"{len(self.parts)}: resume with the same model.sparse_embedding and optimizer settings")
        for o, s in zip(self.parts, parts):
            o.load_state_dict(s)
        # load_state_dict replaces the parts' group dicts: share them again
        self.param_groups = [g for o in self.parts for g in o.param_groups]


def _coalesced(p: Tensor) -> Tensor:
    """``p.grad``, coalesced in place if sparse (an embedding's backward repeats rows)."""
    if p.grad.is_sparse and not p.grad.is_coalesced():
        p.grad = p.grad.coalesce()
    return p.grad


@torch.no_grad()
def clip_gradients(params, value: float, algorithm: str = "norm") -> None:
    """``clip_grad_norm_`` / ``clip_grad_value_`` over dense and row-sparse gradients:
    a sparse gradient counts with its coalesced values (the norm of the dense
    gradient it stands for)."""
    grads = [_coalesced(p) for p in params if p.grad is not None]
    if not grads:
        return
    vals = [g._values() if g.is_sparse else g for g in grads]
    if algorithm == "value":
        for v in vals:
            v.clamp_(-value, value)
        return
    if algorithm != "norm":
        raise ValueError(f"trainer.gradient_clip_algorithm must be norm or value, not {algorithm!r}")
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(v) for v in vals]))
    coef = (value / (total + 1e-6)).clamp(max=1.0)
    for v in vals:
        v.mul_(coef)
