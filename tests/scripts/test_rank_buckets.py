"""scripts/rank_buckets.py: the buckets of known ranks, and a trained run read back."""
import csv

import pytest
import torch
from omegaconf import OmegaConf

import rank_buckets as rb
from lst_lightning.app.train import run

from app_configs import FAST, cfg_of


def test_buckets_split_rule_and_fresh_targets_by_decade():
    # targets 3 (rule: last 2 ^ 1), 3 (fresh: last 7), 250 (fresh), 11 (rule: last 10 ^ 1)
    target = torch.tensor([3, 3, 250, 11])
    last = torch.tensor([2, 7, 5, 10])
    rank = torch.tensor([1.0, 20.0, 4.0, 2.0])
    frequent = torch.tensor([9.0, 4.0, 6.0, 10.0])
    rows = {(r["target"], r["ids"]): r for r in rb.bucket_rows("x", rank, target, last, frequent)}
    assert set(rows) == {("all", "all"), ("rule", "[0, 10)"), ("rule", "[10, 100)"), ("fresh", "[0, 10)"),
                         ("fresh", "[100, 1,000)")}
    assert rows["all", "all"] == dict(run="x", target="all", ids="all", examples=4,
                                      mrr=round((1 + 1 / 20 + 1 / 4 + 1 / 2) / 4, 4), top1_error=0.75,
                                      top10_error=0.25, frequent_in_top10=7.25)
    assert (rows["fresh", "[0, 10)"]["top10_error"], rows["fresh", "[0, 10)"]["mrr"]) == (1.0, 0.05)
    assert rows["rule", "[10, 100)"]["top1_error"] == 1.0 and rows["rule", "[0, 10)"]["top1_error"] == 0.0
    assert rows["fresh", "[0, 10)"]["frequent_in_top10"] == 4.0 and rows["rule", "[0, 10)"]["frequent_in_top10"] == 9.0


def trained(tmp_path, *overrides):
    cfg = cfg_of(*FAST, "data=synthetic", "~data.vocab_size", "data.num_classes=300", "data.input_vocab_size=300",
                 "test=false", *overrides)
    result = run(cfg, tmp_path)
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(cfg, tmp_path / ".hydra" / "config.yaml")  # what lst-train's Hydra writes
    return result


def test_a_trained_run_read_back_gives_its_validation_ranks(tmp_path):
    result = trained(tmp_path / "run")
    out = tmp_path / "out"
    assert rb.main([str(tmp_path / "run"), "--out", str(out)]) == 0
    rows = list(csv.DictReader((out / "rank_buckets.csv").open()))
    every = next(r for r in rows if r["target"] == "all")
    assert int(every["examples"]) == sum(int(r["examples"]) for r in rows if r["target"] != "all") > 0
    # the same ranks as the run's own validation, from the checkpoint
    assert float(every["mrr"]) == pytest.approx(result["val"]["mrr"], abs=1e-4)
    assert float(every["top10_error"]) == pytest.approx(result["val"]["top10_error"], abs=1e-4)
    assert 0 < float(every["frequent_in_top10"]) <= 10  # a trained Zipf model ranks some of them high


def test_a_run_without_a_checkpoint_is_refused_in_one_line(tmp_path):
    trained(tmp_path / "run", "+callbacks.checkpoint.enabled=false")
    with pytest.raises(ValueError, match=r"no checkpoints/last.ckpt") as err:
        rb.main([str(tmp_path / "run"), "--out", str(tmp_path / "out")])
    assert "\n" not in str(err.value)
