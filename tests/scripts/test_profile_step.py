"""scripts/profile_step.py: the smoke run profiles the factored head's autograd step on the
CPU and writes its table, once per route to H U_new^-1 asked for; the CUDA-only paths say
they were skipped."""
from __future__ import annotations

import re

import profile_step


def test_smoke_profiles_the_step_and_writes_the_table(tmp_path):
    assert profile_step.main(["--smoke", "--inverse", "products,solve", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("profile_step_*.txt")
    text = path.read_text()
    for route in ("products", "solve"):  # each route profiled, side by side
        head = re.search(rf"== factored, loss=zloss, inverse={route}: D=300 d=16 m=8: wall ([\d.]+) ms/step", text)
        assert head and float(head.group(1)) > 0, text[:500]
    assert text.count("11 steps, {'steps': 11") == 2  # 5 warm-up, 3 timed, 3 profiled: every one a real step
    assert "_HeadLoss" in text  # the profiler's table of operators
    assert "== factored_sync: skipped (CUDA only)" in text and "== factored_graph: skipped (CUDA only)" in text
