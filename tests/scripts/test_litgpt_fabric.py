"""scripts/examples/litgpt_fabric.py: litgpt's GPT (a named config, pythia-14m's vocabulary)
with the factored head, trained by litgpt's loop shape under Fabric, exported and saved as
litgpt's checkpoint."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch
from litgpt import GPT, Config

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "examples" / "litgpt_fabric.py"
spec = importlib.util.spec_from_file_location("litgpt_fabric", SCRIPT)
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


def test_trains_with_accumulation_and_saves_an_ordinary_litgpt_checkpoint(tmp_path):
    out = example.main(["--layers", "1", "--steps", "12", "--accumulate", "2", "--micro-batch", "2", "--seq-len", "8",
                        "--out", str(tmp_path)])
    assert out["padded_vocab_size"] == 50304 and out["head_steps"] == out["steps"] == 12  # one per optimizer step
    assert len(out["losses"]) == 24 and all(math.isfinite(x) for x in out["losses"])
    assert sum(out["losses"][-4:]) < sum(out["losses"][:4])
    plain = GPT(Config.from_file(tmp_path / "model_config.yaml"))  # what `litgpt generate` builds
    plain.load_state_dict(torch.load(tmp_path / "lit_model.pth"))
    assert isinstance(plain.lm_head, torch.nn.Linear) and plain.lm_head.weight.shape == (50304, 128)
    assert len(out["greedy"]) == 16 and out["greedy"][:6] == out["prompt"]
