"""The one naming rule of run_keys.py: results.json <-> flat names (W&B summary, CSV columns)."""
from lst_lightning.app.run_keys import FACTS, results_of, summary_of


def test_summary_names_and_back():
    results = {"name": "r", "head": "FactoredSphericalHead", "loss": "zloss", "a": 0.1, "D": 500,
               "val": {"top5_error": 0.4, "mrr": 0.3}, "test": {"top5_error": 0.5, "loss": float("nan")},
               "unigram_test": {"perplexity": 31.0}, "step_time_ms": 6.5, "train_steps": 10, "head/folds": 2.0,
               "world_size": 1, "run_dir": "/x", "flag": True}
    flat = summary_of(results)
    assert flat == {"val/top5_error": 0.4, "val/mrr": 0.3, "test/top5_error": 0.5, "unigram_test/perplexity": 31.0,
                    "step_time_ms": 6.5, "train_steps": 10, "head/folds": 2.0, "world_size": 1}
    # facts are config, strings and booleans are not numbers, NaN is not written
    assert not set(flat) & set(FACTS)
    config = {"head": "FactoredSphericalHead", "loss": "zloss", "a": 0.1, "D": 500, "loss.kwargs.a": 0.1}
    back = results_of({**flat, "_runtime": 3.0, "train/loss": 9.0, "note": "text"}, config)
    assert back == {"head": "FactoredSphericalHead", "loss": "zloss", "a": 0.1, "D": 500,
                    "val": {"top5_error": 0.4, "mrr": 0.3}, "test": {"top5_error": 0.5},
                    "unigram_test": {"perplexity": 31.0}, "step_time_ms": 6.5, "train_steps": 10, "head/folds": 2.0,
                    "world_size": 1, "train/loss": 9.0}
