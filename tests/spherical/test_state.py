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


def test_u_inverse_loaded_without_the_heads_extra_state_is_taken_as_stale():
    """A loader that sets one tensor at a time (Fabric's FSDP2 full-state loading) passes no
    extra state: whether U^-1 is fresh is then unknown, so it is refreshed when next needed."""
    head = deferred()
    for _ in range(2):
        step(head, *batch(16, d, D, 2))
    saved = head.state_dict()
    other = deferred()
    assert other.uinv_fresh
    other.load_state_dict({"Uinv": saved["Uinv"]}, strict=False)
    assert not other.uinv_fresh and torch.equal(other.Uinv, saved["Uinv"])
    other.load_state_dict(saved)  # with the extra state: as saved
    assert other.uinv_fresh == head.uinv_fresh


def test_a_state_holding_another_heads_shard_of_v_is_refused_and_nothing_changes():
    head = deferred()
    saved = head.state_dict()
    shard = {**saved, "V": saved["V"][: D // 2].clone() + 1, "_extra_state": {**saved["_extra_state"], "v_rows": (0, D // 2)}}
    V = head.V.clone()
    for state, said in [(shard, f"rows 0:{D // 2} of V's {D}"),
                        ({k: v for k, v in shard.items() if k != "_extra_state"}, f"{D // 2} rows of V's {D}")]:
        try:
            head.load_state_dict(state)
        except ValueError as e:
            assert said in str(e) and f"this head holds rows 0:{D}" in str(e) and "\n" not in str(e)
        else:
            raise AssertionError("a shard of V loaded into a head holding all of it")
        assert torch.equal(head.V, V)


def test_a_head_built_under_the_meta_device_context_is_the_head_as_constructed_after_reset():
    """docs/factored_head.md, "Built on the meta device": ``with torch.device("meta")`` with the
    default loss (its sampler's tables on the host), then ``to_empty`` and ``reset_weight()``."""
    with torch.device("meta"):
        head = FactoredSphericalHead(num_classes=D, hidden_dim=d, generator=torch.Generator().manual_seed(3))
    assert head.V.device.type == "meta" and head.negatives is not None
    head.to_empty(device="cpu")
    try:
        head(*batch(4, d, D, 1)[:2])
    except RuntimeError as e:
        assert "reset_weight" in str(e) and "\n" not in str(e)
    else:
        raise AssertionError("a head of uninitialised memory trained")
    head.reset_weight()
    built = FactoredSphericalHead(num_classes=D, hidden_dim=d, generator=torch.Generator().manual_seed(3))
    for (n, a), b in zip(head.named_buffers(), built.buffers()):
        assert torch.equal(a, b), n
