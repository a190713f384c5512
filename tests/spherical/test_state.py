"""state.py: every buffer of the factored head declared once, registered, reset and shared from there."""
import torch

from lst_lightning.spherical import FactoredSphericalHead
from lst_lightning.spherical.state import EXACT_STATE, REPLICATED_STATE, STATE

from head_pairs import D, batch, d, deferred, step


def test_the_head_has_exactly_the_declared_buffers():
    head = deferred()
    assert [n for n, _ in head.named_buffers()] == [b.name for b in STATE]
    assert {k for k in head.state_dict() if k != "_extra_state"} == {b.name for b in STATE if b.persistent}
    assert "V" not in REPLICATED_STATE and set(EXACT_STATE) <= {b.name for b in STATE}


def test_reset_restores_every_buffer_as_constructed():
    head = deferred(sync_every=1, generator=torch.Generator().manual_seed(5))
    fresh = {n: b.clone() for n, b in head.named_buffers()}
    for _ in range(3):
        step(head, *batch(16, d, D, 2))
    head.stabilise()
    assert not torch.equal(head.V, fresh["V"]) and int(head.steps) == 3
    head.reset_weight()
    for n, b in head.named_buffers():
        torch.testing.assert_close(b, fresh[n], rtol=0, atol=1e-12, msg=n)  # Q, wbar: recomputed from V


def test_a_meta_head_declares_its_buffers_on_the_meta_device():
    head = FactoredSphericalHead(num_classes=D, hidden_dim=d, device="meta")
    assert {b.device.type for b in head.buffers()} == {"meta"}
