"""The step pinned: each mode's hundred float64 steps (tests/helpers/step_reference.py: eager,
fused, compiled; host checks and device flags; each U^-1 route and Neumann rule, both Q routes;
P on and off; negatives shared, per row and from the kernel's sum-tree; the Z-loss, MSE and lst-train's
default loss=sampled; exact accumulation; folds, repairs and a bad batch) end where the code that
wrote tests/spherical/data/step_reference.pt ended, to 1e-12: its buffers, W, its counters, the
losses and the last dL/dH."""
import pytest
import torch

from step_reference import MODES, PATH, run_mode

TOL = 1e-12


@pytest.fixture(scope="module")
def reference():
    return torch.load(PATH)


def test_every_mode_has_its_reference(reference):
    assert sorted(reference) == sorted(MODES)


@pytest.mark.parametrize("name", list(MODES))
def test_a_hundred_steps_end_where_the_reference_did(name, reference):
    got, ref = run_mode(name), reference[name]
    assert sorted(got) == sorted(ref)
    steps, skipped = got["stats"][:2].tolist()
    assert (steps, skipped) == tuple(ref["stats"][:2].tolist())
    assert got["stats"][:10].tolist() == ref["stats"][:10].tolist(), "the repairs' counters"
    for key, value in got.items():
        finite = torch.isfinite(ref[key])  # the bad batch's loss
        assert torch.equal(torch.isfinite(value), finite), key
        value, want = value[finite], ref[key][finite]
        scale = max(1.0, float(want.abs().max()))
        assert float((value - want).abs().max()) <= TOL * scale, (key, float((value - want).abs().max()))
