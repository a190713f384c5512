"""scripts/bench_step_cpu.py: the two steps side by side at a small size, each timed and counted."""
from __future__ import annotations

import bench_step_cpu as bs


def test_it_prints_both_steps_and_their_ratio(capsys):
    assert bs.main(["--D", "300", "--d", "8", "--m", "8", "--steps", "10"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in ("default", "sampled_softmax"):
        line = next(x for x in lines if x.strip().startswith(f"{name}:"))
        assert "ms/step" in line and "op calls/step profiled" in line
    assert any(x.startswith("default / sampled_softmax: ") for x in lines)
