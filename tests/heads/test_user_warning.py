"""A head's warnings point at the user's line, whatever route raised them: the fused step, the
autograd step's backward (through torch's engine), a state loaded into an attached head."""
import warnings

import pytest
import torch

from lst_lightning.spherical import FactoredSphericalHead


def nan_batch():
    H = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    T = torch.ones(3, dtype=torch.float64)
    T[1] = float("nan")
    return H, torch.tensor([1, 2, 3]), T


@pytest.mark.parametrize("route", ["backward", "train_step"])
@pytest.mark.parametrize("sync_every", [1, 64])
def test_a_skipped_steps_warning_is_at_the_line_that_stepped_or_read(route, sync_every):
    head = FactoredSphericalHead(20, 4, loss="zloss", dtype=torch.float64, sync_every=sync_every)
    H, idx, T = nan_batch()
    with pytest.warns(RuntimeWarning, match="skipped") as seen:
        if route == "backward":
            head(H, idx, T).backward()
        else:
            head.train_step(H.detach(), idx, T)
        head.sync()
    assert {w.filename for w in seen} == {__file__}


def test_a_load_into_an_attached_head_with_pending_rows_warns_at_the_load():
    head = FactoredSphericalHead(20, 4, loss="zloss", dtype=torch.float64)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    head.attach(optimizer)
    H, idx, _ = nan_batch()
    head(H, idx).backward()  # rows kept for the optimizer's step
    state = FactoredSphericalHead(20, 4, loss="zloss", dtype=torch.float64).state_dict()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        head.load_state_dict(state)
    assert [w.filename for w in seen if "drops" in str(w.message)] == [__file__]
