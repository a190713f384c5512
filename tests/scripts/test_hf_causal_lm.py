"""scripts/examples/hf_causal_lm.py: a transformers Llama with the factored head (factor_lm_head),
trained by Lightning with a compiled body, checkpointed and resumed exactly."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "examples" / "hf_causal_lm.py"
spec = importlib.util.spec_from_file_location("hf_causal_lm", SCRIPT)
hf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hf)

# Tiny and cheap, under bf16-mixed: the eager backend still goes through torch.compile (dynamo)
# without a C compiler (inductor works too where one is: gcc here).
TINY = ["--epoch-steps", "3", "--batch-size", "4", "--seq-len", "12", "--vocab", "48", "--hidden", "16",
        "--compile-backend", "eager", "--precision", "bf16-mixed"]


def state(path):
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


def test_trains_checkpoints_and_resumes_exactly(tmp_path):
    full = hf.main([*TINY, "--steps", "6", "--out", str(tmp_path / "full")])
    assert full["steps"] == full["head_steps"] == 6
    assert full["losses"][-1] < full["losses"][0]  # it learns the walk
    part = hf.main([*TINY, "--steps", "6", "--stop-after", "3", "--out", str(tmp_path / "part")])
    assert part["steps"] == 3 and part["losses"] == full["losses"][:3]
    resumed = hf.main([*TINY, "--steps", "6", "--resume", str(tmp_path / "part" / "last.ckpt"),
                       "--out", str(tmp_path / "resumed")])
    assert resumed["steps"] == resumed["head_steps"] == 6
    assert resumed["losses"] == full["losses"][3:]  # the resumed run continues exactly
    a, b = state(tmp_path / "full" / "last.ckpt"), state(tmp_path / "resumed" / "last.ckpt")
    assert a.keys() == b.keys() and any(k.startswith("lm.lm_head.") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k], k


def test_accumulation_steps_the_head_once_per_optimizer_step(tmp_path):
    out = hf.main([*TINY, "--steps", "3", "--accumulate", "2", "--out", str(tmp_path)])
    assert out["steps"] == out["head_steps"] == 3 and len(out["losses"]) == 6


def test_stop_must_fall_on_an_epoch_end():
    with pytest.raises(SystemExit, match="multiple of --epoch-steps"):
        hf.main([*TINY, "--steps", "6", "--stop-after", "2"])
