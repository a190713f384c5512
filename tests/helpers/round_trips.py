"""A module's copies as a user makes them: ``torch.save`` then ``torch.load``, and ``copy.deepcopy``."""
import copy
import io

import torch


def pickled(module):
    """``module`` saved whole by ``torch.save`` and loaded back (``weights_only=False``)."""
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


#: each way a user copies a module whole
COPIES = (pickled, copy.deepcopy)
