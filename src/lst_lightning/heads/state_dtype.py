"""The dtypes a head keeps its own state in, and the module move that keeps them: a head whose
state is float32 or float64 (the exact heads' factored state, the preconditioner's moments) follows
``.float()`` and ``.double()``, and under a cast to half precision (``.half()``,
``.to(torch.bfloat16)``) moves that state to the new device only, in its dtype."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

#: the dtypes a head's own state may take
STATE_DTYPES = (torch.float32, torch.float64)


def kept_in_dtype(fn: Callable[[Tensor], Tensor], device: torch.device,
                  keep: Callable[[Tensor], bool] = Tensor.is_floating_point) -> Callable[[Tensor], Tensor]:
    """``fn``, a module's move (as ``nn.Module._apply`` takes it), except that each tensor ``keep``
    names moves to ``device`` only, in its dtype (default: every floating tensor)."""
    return lambda t: t.to(device=device) if keep(t) else fn(t)
