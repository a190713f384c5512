"""scripts/examples/hf_trainer_ddp.py: the HF Trainer with the factored head, alone and under
the real launchers (torchrun, accelerate launch) on two gloo processes."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "examples" / "hf_trainer_ddp.py"
sys.path.insert(0, str(SCRIPT.parent))  # the script imports hf_causal_lm from its folder
spec = importlib.util.spec_from_file_location("hf_trainer_ddp", SCRIPT)
ddp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ddp)

TINY = ["--vocab", "48", "--hidden", "16", "--seq-len", "12", "--batch-size", "2"]


def test_one_process_trains_the_head_once_per_step(tmp_path):
    out = ddp.main([*TINY, "--steps", "4", "--save-steps", "2", "--accumulate", "2", "--out", str(tmp_path)])
    assert out["world_size"] == 1 and out["steps"] == out["head_steps"] == 4 and out["rows"] == [0, 48]
    assert (tmp_path / "checkpoint-4").is_dir()


def launch(launcher: list[str], out: Path, *args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*launcher, str(SCRIPT), *TINY, "--parallel", "sharded", "--out", str(out), *args], check=True,
                   env=env, capture_output=True, timeout=600)
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_two_launched_processes_train_a_sharded_head_and_resume(tmp_path, launcher):
    bin_dir = Path(sys.executable).parent
    cmd = ([str(bin_dir / "torchrun"), "--standalone", "--nproc_per_node", "2"] if launcher == "torchrun" else
           [str(bin_dir / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no"])
    first = launch(cmd, tmp_path, "--steps", "4", "--save-steps", "2")
    assert first["world_size"] == 2 and first["steps"] == first["head_steps"] == 4 and first["rows"] == [0, 24]
    resumed = launch(cmd, tmp_path, "--steps", "6", "--save-steps", "2", "--resume")
    assert resumed["steps"] == resumed["head_steps"] == 6  # the checkpoint held the whole V; each rank took its rows
    assert resumed["losses"][:4] == first["losses"]
