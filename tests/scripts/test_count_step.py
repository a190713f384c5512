"""scripts/count_step.py: the step's matrix products by call site, in units of 2 m d^2, and
its operators, counted under a dispatch mode; the same on any machine."""
from __future__ import annotations

import re
from pathlib import Path

import count_step
from output_sandbox import make_sandbox

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_counts_each_product_where_the_step_makes_it(tmp_path, monkeypatch):
    """H [Q, U^T] is one m x d x 2d product: 2 units; (Yd V) U one: 1 unit. The GPU's step
    (device flags, U_new^-1 by products) forms U_new^-1 from d x d products."""
    c = count_step.count(D=500, d=16, m=32)
    unit = 2 * 32 * c.width ** 2  # the width: d, and one more for the bias
    assert c.flops["exact_step.py:outputs"] == 2 * unit and c.gemms["exact_step.py:outputs"] == 1
    assert c.flops["exact_step.py:hidden_grad"] == unit
    assert c.gemms["inverse_update.py:uinv_by_products"] > 0
    assert sum(c.ops.values()) > 100 and "aten.view" not in c.ops  # views are not counted
    box = make_sandbox(tmp_path, monkeypatch)  # a default run writes its own run directory only
    run_dir = box.run_default(count_step.main, ["--D", "500", "--d", "16", "--m", "32"], "count_step")
    text = (run_dir / "count_step_zloss_D500_d16_m32.md").read_text()
    assert "| `exact_step.py:outputs` | 1 | 2.00 |" in text
    argv = ["--D", "500", "--d", "16", "--m", "32"]
    box = make_sandbox(tmp_path / "update", monkeypatch)  # --update-results: the results folder only
    assert box.run_update(count_step.main, argv) == {"count_step_zloss_D500_d16_m32.md"}


def test_the_default_head_counts_its_sampled_columns_and_its_host_checked_step():
    """loss=sampled is lst-train's head (its negatives and preconditioner); sync_every=1 (the
    flags read after every step) with the CPU's route, which solves with U_new instead of the products."""
    c = count_step.count(D=500, d=16, m=32, loss="sampled", sync_every=1, inverse="solve")
    assert any(site.startswith("negatives.py:") for site in c.flops)
    assert any(site.startswith("preconditioner.py:") for site in c.flops)
    assert "inverse_update.py:uinv_by_products" not in c.flops


#: the target's budgets (at most 14 units of 2 m d^2 for the Z-loss step, 20 for lst-train's default)
BUDGETS = {"zloss": 14.0, "sampled": 20.0}


def test_the_step_stays_within_its_product_budget_at_the_target_size():
    """Each product's FLOPs are its units times 2 m w^2 (w: the width, d + 1 with the bias), by its
    shape: an m x w x w product is 1 unit at any size, a w^3 one w / m, an m x S x w one (the S
    shared negatives) S / w, an S x w x w one S / m, an m K w one K / w. At w = 33, m = 64, S = 33
    each ratio is at or above the target's (w = 513, m = 1024, S = 512: 0.501, 0.998, 0.5, 0.002),
    so the same routes counted here (device flags; U_new^-1 by products, 2 Neumann factors after a
    read of the flags, as at the target; Q from d x d products; the negatives in a padded block;
    D = 10^5, where the sampled loss takes the target's lr) give at least the target's units,
    in seconds and without the target's D x d matrix. The committed counts at the target size
    hold the same budgets."""
    for loss, budget in BUDGETS.items():
        c = count_step.count(D=100_000, d=32, m=64, loss=loss, negatives=33)
        assert c.width == 33 and c.factors == 2, (c.width, c.factors)
        assert c.gemms["torch_ops.py:q_update_factors"] > 0  # Q from d x d products, as at m = 2 d
        units = sum(c.flops.values()) / (2 * 64 * c.width ** 2)
        assert units <= budget, (loss, units)
        committed = (RESULTS / f"count_step_{loss}_D793471_d512_m1024.md").read_text()
        assert float(re.search(r"\*\*([0-9.]+) units of 2 m d\^2\*\*", committed)[1]) <= budget
        assert "2 Neumann factors" in committed
