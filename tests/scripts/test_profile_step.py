"""scripts/profile_step.py: the smoke run profiles the factored head's autograd step and its
device-flag step on the CPU and writes their tables, once per route to H U_new^-1 asked for and
once per pinned number of Neumann factors; the CUDA graph says it was skipped."""
from __future__ import annotations

import re

import pytest
import torch

import profile_step
from lst_lightning.spherical import FactoredSphericalHead


def test_smoke_profiles_the_step_and_writes_the_table(tmp_path):
    assert profile_step.main(["--smoke", "--inverse", "products,solve", "--factors", "2",
                              "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("profile_step_*.txt")
    text = path.read_text()
    for path_, route in [("factored", "products"), ("factored", "solve"), ("factored_sync", "products, factors=2")]:
        head = re.search(rf"== {path_}, loss=zloss, inverse={route}: D=300 d=16 m=8: wall ([\d.]+) ms/step", text)
        assert head and float(head.group(1)) > 0, (path_, route, text[:500])
    assert text.count("11 steps, {'steps': 11") >= 2  # 5 warm-up, 3 timed, 3 profiled: every one a real step
    assert "_HeadLoss" in text  # the profiler's table of operators
    assert "== factored_sync, loss=zloss, inverse=solve" not in text  # pinned runs in place of the unpinned
    assert "== factored_graph: skipped (CUDA only)" in text


@pytest.mark.parametrize("pinned", [False, True])
def test_pinned_factors_survive_a_read_of_the_flags(pinned):
    """Unpinned, the adaptive rule's reads move the factors away from 3 on these steps; pinned, they stay."""
    torch.manual_seed(0)
    head = FactoredSphericalHead(50, 8, loss="zloss", sync_every=2, lr=0.5,
                                 stabiliser={"inverse": "products", "neumann": "adaptive"})
    if pinned:
        profile_step.pin_factors(head, 3)
    else:
        head.step_checks.factors = 3
    seen = set()
    for _ in range(6):  # three reads of the flags, each of which would pick the factors anew
        head.train_step(torch.randn(6, 8), torch.randint(0, 50, (6,)))
        seen.add(head.step_checks.factors)
    assert head.step_checks.calls == 6 and (seen == {3}) == pinned, seen


def test_factors_out_of_range_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        profile_step.main(["--smoke", "--factors", "7", "--out", str(tmp_path)])
    assert "--factors takes numbers of Neumann factors from 1 to 6" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
