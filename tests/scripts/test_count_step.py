"""scripts/count_step.py: the step's matrix products by call site, in units of 2 m d^2, and
its operators, counted under a dispatch mode; the same on any machine."""
from __future__ import annotations

import count_step
from output_sandbox import make_sandbox


def test_counts_each_product_where_the_step_makes_it(tmp_path, monkeypatch):
    """H [Q, U^T] is one m x d x 2d product: 2 units; (Yd V) U one: 1 unit. The GPU's step
    (device flags, U_new^-1 by products) forms U_new^-1 from d x d products."""
    c = count_step.count(D=500, d=16, m=32)
    unit = 2 * 32 * c.width ** 2  # the width: d, and one more for the bias
    assert c.flops["step.py:outputs"] == 2 * unit and c.gemms["step.py:outputs"] == 1
    assert c.flops["step.py:hidden_grad"] == unit
    assert c.gemms["inverse_update.py:uinv_by_products"] > 0
    assert sum(c.ops.values()) > 100 and "aten.view" not in c.ops  # views are not counted
    box = make_sandbox(tmp_path, monkeypatch)  # a default run writes its own run directory only
    run_dir = box.run_default(count_step.main, ["--D", "500", "--d", "16", "--m", "32"], "count_step")
    text = (run_dir / "count_step_zloss_D500_d16_m32.md").read_text()
    assert "| `step.py:outputs` | 1 | 2.00 |" in text
    argv = ["--D", "500", "--d", "16", "--m", "32"]
    box = make_sandbox(tmp_path / "update", monkeypatch)  # --update-results: the results folder only
    assert box.run_update(count_step.main, argv) == {"count_step_zloss_D500_d16_m32.md"}


def test_the_default_head_counts_its_sampled_columns_and_its_host_checked_step():
    """loss=sampled is lst-train's head (its negatives and preconditioner); sync_every=1 the
    CPU's step, which solves with U_new instead of the products."""
    c = count_step.count(D=500, d=16, m=32, loss="sampled", sync_every=1, inverse="solve")
    assert any(site.startswith("negatives.py:") for site in c.flops)
    assert any(site.startswith("preconditioner.py:") for site in c.flops)
    assert "inverse_update.py:uinv_by_products" not in c.flops
