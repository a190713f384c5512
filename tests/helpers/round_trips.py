"""A module's copies as a user makes them: ``torch.save`` then ``torch.load``, and ``copy.deepcopy``;
and a module sent to a spawned process, as ``ddp_spawn`` sends its model (``spawned``)."""
import copy
import io
import os
import tempfile

import torch
import torch.multiprocessing


def pickled(module):
    """``module`` saved whole by ``torch.save`` and loaded back (``weights_only=False``)."""
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


#: each way a user copies a module whole
COPIES = (pickled, copy.deepcopy)


def spawned(module):
    """``module`` handed to a spawned process by ``torch.multiprocessing`` (its tensors shared, as
    Lightning's ``ddp_spawn`` hands its workers the model), saved whole there by ``torch.save`` and
    loaded back here: about 5 s, a process that imports torch."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "module.pt")
        torch.multiprocessing.spawn(_save, args=(module, path), nprocs=1)
        return torch.load(path, weights_only=False)


def _save(rank, module, path):
    torch.save(module, path)
