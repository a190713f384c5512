"""The body's optimisers: a dense one for the ordinary parameters, and a row-sparse one
for the parameters of sparse ``nn.Embedding`` modules (the body's input embedding with
``model.sparse_embedding=true``) and the row-sparse parameters a head declares
(``OutputHead.sparse_parameters()``: the sampled and hierarchical softmax's class rows
with ``head.sparse=true``), which reads and writes only the rows a step touched
(``optimizer.embedding``; a head's rows may take another, ``optimizer.head_rows``).
``row_adam`` (``optimizer.embedding=auto``'s choice where the run compiles or trains on a GPU)
steps them in static shapes: ``static_rows_for`` gives those tables static rows (``lst_lightning.rows``: the gradient as the batch's (ids, rows), which
``torch.compile`` takes whole) and ``RowAdam`` steps them (``row_sgd``: ``RowSGD``, torch's sparse
SGD in static shapes); the others take torch's sparse COO gradients.
An ordinary head's parameters may have their own lr (``optimizer.head_lr``): their own groups.

Lightning's automatic optimisation drives one optimiser, so ``PairedOptimizer`` presents
the parts as one: its ``param_groups`` are the parts' own group dicts (the lr schedule
sets them all), ``step`` runs the closure once and steps every part, the state dict
holds every part's (exact resume). ``clip_gradients`` clips dense and row-sparse gradients together
(torch's ``clip_grad_norm_`` refuses sparse gradients)."""
from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ..heads.base import OutputHead
from ..rows import RowAdam, RowSGD, coalesce_rows, row_grad_of, static_rows

DENSE = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
# optimizer.embedding: the optimiser of sparse embeddings' rows (dense: none may be sparse);
# row_adam: SparseAdam's arithmetic in static shapes (lst_lightning.rows); row_sgd: SGD's
ROW_ADAM, ROW_SGD = "row_adam", "row_sgd"
#: the optimisers of tables with static rows
STATIC = {ROW_ADAM: RowAdam, ROW_SGD: RowSGD}
EMBEDDING = (ROW_ADAM, ROW_SGD, "sparse_adam", "sparse_sgd", "adagrad", "dense")
# optimizer.head_rows: the optimiser of a head's row-sparse class rows (null: optimizer.embedding's)
HEAD_ROWS = (None, *EMBEDDING[:-1])
#: optimizer.embedding=auto: row_adam where the run compiles or trains on a GPU (static rows: they
#: compile whole, and no step reads the host, on several processes too), sparse_adam where it runs
#: eager on a CPU (the same arithmetic, faster eager there: SparseAdam's sparse tensors)
AUTO_EMBEDDING = "auto"


def embedding_for(setting: str, compiles: bool, device: torch.device | str = "cpu") -> str:
    """``optimizer.embedding`` as the run takes it: ``auto`` is row_adam where the run compiles or
    trains on a GPU, else sparse_adam."""
    if setting != AUTO_EMBEDDING:
        return setting
    return ROW_ADAM if compiles or torch.device(device).type == "cuda" else "sparse_adam"


def sparse_embedding_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters with row-sparse gradients: the weights of the sparse ``nn.Embedding``
    modules and the heads' ``sparse_parameters()``."""
    found = [m.weight for m in module.modules()
             if isinstance(m, nn.Embedding) and (m.sparse or row_grad_of(m.weight) is not None)]
    found += [p for m in module.modules() if isinstance(m, OutputHead) for p in m.sparse_parameters()]
    return list({id(p): p for p in found if p.requires_grad}.values())


def check_optimizer_config(cfg: dict, module: nn.Module | None = None) -> None:
    """Bad names and lrs; with ``module``, a sparse embedding with no row-sparse optimiser."""
    if cfg["name"] not in DENSE:
        raise ValueError(f"optimizer.name must be one of {sorted(DENSE)}, not {cfg['name']!r}")
    if cfg.get("embedding") == AUTO_EMBEDDING:
        raise ValueError("optimizer.embedding=auto is lst-train's choice, made once it knows the device and whether the run compiles: "
                         "pass embedding_for('auto', compiles, device) (row_adam or sparse_adam) to LanguageModel")
    if cfg.get("embedding", "dense") not in EMBEDDING:
        raise ValueError(f"optimizer.embedding must be one of {list(EMBEDDING)}, not {cfg.get('embedding')!r}")
    if cfg.get("head_rows") not in HEAD_ROWS:
        raise ValueError(f"optimizer.head_rows must be one of {list(HEAD_ROWS[1:])} or null (optimizer.embedding), "
                         f"not {cfg.get('head_rows')!r}")
    for key in ("embedding_lr", "head_lr"):  # the one rule of the optional lrs
        lr = cfg.get(key)
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0):
            raise ValueError(f"optimizer.{key} must be a number > 0 or null (optimizer.lr), not {lr!r}")
    if module is not None and cfg.get("embedding", "dense") == "dense" and sparse_embedding_params(module):
        raise ValueError("the model has row-sparse parameters (model.sparse_embedding=true or head.sparse=true) "
                         "but optimizer.embedding=dense: set optimizer.embedding to one of "
                         f"{list(EMBEDDING[:-1])}, or model.sparse_embedding=false and head.sparse=false")


def static_rows_for(body: nn.Module, head: OutputHead, cfg: dict) -> None:
    """Static rows (``lst_lightning.rows.static_rows``) for the tables ``row_adam`` or ``row_sgd``
    steps: the body's sparse embeddings under ``optimizer.embedding``, the head's row-sparse
    parameters under ``optimizer.head_rows`` (null: ``optimizer.embedding``)."""
    name = cfg.get("embedding", "dense")
    if name in STATIC:
        static_rows(body)
    if (cfg.get("head_rows") or name) in STATIC and head.sparse_parameters():
        static_rows(head, head.sparse_parameters())


def _dense_optimizer(groups: list, cfg: dict) -> torch.optim.Optimizer:
    kw = {"lr": cfg["lr"], "weight_decay": cfg.get("weight_decay", 0.0)}
    if cfg["name"] == "sgd":
        kw["momentum"] = cfg.get("momentum", 0.0)
    return DENSE[cfg["name"]](groups, **kw)


def _sparse_optimizer(groups: list, name: str, lr: float, compiled: str | None = None) -> torch.optim.Optimizer:
    # No weight decay and no momentum: both would touch all D rows every step.
    static = [p for g in groups for p in g["params"] if row_grad_of(p) is not None]
    if (name in STATIC) != bool(static) or (static and len(static) != sum(len(g["params"]) for g in groups)):
        raise ValueError(f"optimizer.embedding (or head_rows)={name}: row_adam and row_sgd step the tables with "
                         "static rows (lst_lightning.rows) and only those; sparse_adam, sparse_sgd and adagrad take "
                         "torch's sparse gradients")
    if name in STATIC:  # compiled: "" for torch.compile's default mode, else a mode's name
        return STATIC[name](groups, lr=lr, compiled=compiled is not None, mode=compiled or None)
    if name == "sparse_adam":
        return torch.optim.SparseAdam(groups, lr=lr)
    if name == "sparse_sgd":
        return torch.optim.SGD(groups, lr=lr)
    return torch.optim.Adagrad(groups, lr=lr)  # its sparse path updates only the rows given


def _groups(params: list, own: set[int], lr: float, own_lr: float, name: str) -> list[dict]:
    """The body's parameters first (group 0 is the schedule's reference), then the head's own."""
    groups = [{"params": [p for p in params if id(p) not in own], "lr": lr, "name": name},
              {"params": [p for p in params if id(p) in own], "lr": own_lr, "name": f"head_{name}"}]
    return [g for g in groups if g["params"]]


def make_optimizer(module: nn.Module, cfg: dict, head: nn.Module | None = None,
                   compiled_rows: str | None = None) -> torch.optim.Optimizer:
    """The dense optimiser of ``cfg`` over the trainable parameters; with row-sparse
    parameters in ``module`` (sparse embeddings, a head's ``sparse_parameters()``), a
    ``PairedOptimizer`` whose second half (``cfg['embedding']``) steps their rows: the
    embedding's at lr ``cfg['embedding_lr']`` or ``cfg['lr']``, those of ``head`` (when
    given) in a group of their own at ``cfg['head_lr']`` or ``cfg['lr']``. With
    ``cfg['head_lr']`` the head's dense parameters get a group of their own too.
    ``compiled_rows``: ``RowAdam``'s update through ``torch.compile`` in that mode ("": the
    default mode; None: eager)."""
    check_optimizer_config(cfg, module)
    head_lr = cfg.get("head_lr")
    sparse = sparse_embedding_params(module)
    name = cfg.get("embedding", "dense")
    ids = {id(p) for p in sparse}
    dense = [p for p in module.parameters() if p.requires_grad and id(p) not in ids]
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    if cfg.get("weight_decay", 0.0) and head_ids & ids:
        warnings.warn(f"optimizer.weight_decay={cfg['weight_decay']} applies to the dense parameters only: the "
                      "head's row-sparse rows (head.sparse=true) take none (head.sparse=false decays them)",
                      stacklevel=2)
    own = head_ids if head_lr is not None else set()
    lr, own_lr = cfg["lr"], cfg["lr"] if head_lr is None else head_lr
    if not sparse:
        groups = _groups(dense, own, lr, own_lr, "dense")
        return _dense_optimizer(groups if len(groups) > 1 else dense, cfg)
    # the head's rows never take optimizer.embedding_lr (the input embedding's)
    sparse_groups = _groups(sparse, head_ids, cfg.get("embedding_lr") or lr, own_lr, "embedding")
    head_rows = cfg.get("head_rows") or name
    by_name = {}  # optimizer.embedding's groups, and optimizer.head_rows' where it differs
    for g in sparse_groups:
        by_name.setdefault(head_rows if g["name"] == "head_embedding" else name, []).append(g)
    parts = [_dense_optimizer(_groups(dense, own, lr, own_lr, "dense"), cfg)] if dense else []
    parts += [_sparse_optimizer(groups, n, lr, compiled_rows) for n, groups in by_name.items()]
    return PairedOptimizer(*parts)


class PairedOptimizer(torch.optim.Optimizer):
    """A dense optimiser and the row-sparse ones (the input embedding's, and a head's rows'
    where ``optimizer.head_rows`` differs), stepped as one (see the module docstring)."""

    def __init__(self, *parts: torch.optim.Optimizer):
        self.parts = list(parts)
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
        if any("whole" in s for s in parts):
            raise ValueError("the checkpoint's optimiser state was saved under trainer.strategy=fsdp2 in an earlier "
                             "format (its row-sparse parts under 'whole'): resume it under trainer.strategy=fsdp2")
        for o, s in zip(self.parts, parts):
            o.load_state_dict(s)
        # load_state_dict replaces the parts' group dicts: share them again
        self.param_groups = [g for o in self.parts for g in o.param_groups]


def _coalesced(p: Tensor) -> Tensor:
    """``p.grad``, coalesced in place if sparse (an embedding's backward repeats rows)."""
    if p.grad.is_sparse and not p.grad.is_coalesced():
        p.grad = p.grad.coalesce()
    return p.grad


def _static_values(p: Tensor) -> Tensor | None:
    """A table with static rows: its gradient coalesced in place (each row once, in static
    shapes: ``coalesce_rows``; the padding's and the unused slots' rows zero), its rows; None
    without a gradient."""
    got = row_grad_of(p).grad()
    if got is None:
        return None
    ids, rows = got
    uids, summed = coalesce_rows(ids, rows)
    ids.copy_(uids)
    return rows.copy_(torch.where((uids >= 0).view(-1, *[1] * (rows.dim() - 1)), summed, 0))


def has_gradient(p: Tensor) -> bool:
    """Whether ``p`` has a gradient to step: its ``.grad``, or its static rows' (``lst_lightning.rows``)."""
    rg = row_grad_of(p)
    return p.grad is not None if rg is None else rg.grad() is not None


@torch.no_grad()
def clip_gradients(params, value: float, algorithm: str = "norm") -> None:
    """``clip_grad_norm_`` / ``clip_grad_value_`` over dense and row-sparse gradients:
    a sparse gradient counts with its coalesced values (the norm of the dense
    gradient it stands for), a table with static rows with its rows coalesced."""
    vals = []
    for p in params:
        if row_grad_of(p) is not None:
            v = _static_values(p)
            vals += [] if v is None else [v]
        elif p.grad is not None:
            g = _coalesced(p)
            vals.append(g._values() if g.is_sparse else g)
    if not vals:
        return
    if algorithm == "value":
        for v in vals:
            v.clamp_(-value, value)
        return
    if algorithm != "norm":
        raise ValueError(f"trainer.gradient_clip_algorithm must be norm or value, not {algorithm!r}")
    # FSDP2 shards (DTensor, trainer.strategy=fsdp2): the norm of the whole gradient, and a plain factor
    norms = [torch.linalg.vector_norm(v) for v in vals]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = (value / (total + 1e-6)).clamp(max=1.0)
    for v in vals:
        v.mul_(float(coef) if isinstance(v, DTensor) else coef)
