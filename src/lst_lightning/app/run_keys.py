"""The names a run's numbers and facts go by: the same in the CSV log, the W&B run and
``results.json``, so that ``lst-compare``, the W&B dashboards and a reader of any one
of them mean the same thing by the same name.

- A number's name: ``<split>/<metric>`` for the split sections of results.json
  (``test/top5_error`` is ``results["test"]["top5_error"]``, the CSV column and the W&B
  history and summary key), and its own key otherwise (``step_time_ms``, ``wall_s``,
  ``head/folds``: the head's counters at the end, named as their logged curves).
- A run's facts (``FACTS``): what the dashboards filter, group and plot runs by, as flat
  top-level keys of the W&B config and of results.json (the W&B config also holds the
  whole resolved Hydra config, flat: ``loss.kwargs.a``, ...).

No framework here: ``lst-compare`` imports it.
"""
from __future__ import annotations

import math
import re

# the sections of results.json whose metrics are named <section>/<metric>
SPLITS = ("val", "test", "unigram_test")

# The metrics of a split (val, test) as LanguageModel logs them: the mean loss, RankMetrics' top-k
# errors and MRR, the perplexity (a head with probabilities), SimLex-999 (text data).
LOSS, MRR, PERPLEXITY, SIMLEX = "loss", "mrr", "perplexity", ("simlex_rho", "simlex_pairs")


def topk_error(k: int) -> str:
    """The share of targets ranked below the k-th: ``top5_error``."""
    return f"top{k}_error"


def split_metrics(topk, perplexity: bool = True, simlex: bool = True) -> list[str]:
    """The metrics a split of results.json (val, test) can hold, with ``metrics.topk``; the
    perplexity unless ``metrics.perplexity`` is false, SimLex-999 unless ``metrics.simlex`` is."""
    return [LOSS, *map(topk_error, topk), MRR, *([PERPLEXITY] if perplexity else []), *(SIMLEX if simlex else ())]

FACTS = {
    "head": "the head's class (FactoredSphericalHead, SoftmaxHead, ...)",
    "loss": "the spherical loss (zloss, ...); null for heads outside the spherical family",
    "head_loss": "head and loss in one key (<head>-<loss>, or <head>): what learning curves group by",
    "a": "the Z-loss's a (null for other losses and heads)",
    "b": "the Z-loss's b (null for other losses and heads)",
    "lr": "the body's (and ordinary heads') optimiser learning rate",
    "head_lr": ("the head's own base learning rate: a self-updating head's SGD lr (head.lr), an ordinary head's "
                "optimiser lr (optimizer.head_lr; null: lr)"),
    "D": "the number of classes (output vocabulary)",
    "d": "the hidden size the head reads (the body's output)",
    "m": "the training batch size per process",
    "body": "the body's class (NgramMLP, ...)",
    "machine": "the GPU's name, or the CPU's model and core count",
}


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def summary_of(results: dict) -> dict[str, float]:
    """Every finite number of ``results`` under its flat name (facts and strings left out)."""
    out: dict[str, float] = {}
    for key, value in results.items():
        if key in SPLITS and isinstance(value, dict):
            out.update({f"{key}/{m}": v for m, v in value.items() if is_number(v) and math.isfinite(v)})
        elif key not in FACTS and is_number(value) and math.isfinite(value):
            out[key] = value
    return out


def results_of(summary: dict, config: dict) -> dict:
    """The inverse of ``summary_of`` for a run known only from W&B: results.json's shape
    from a W&B summary (numbers only) and the facts from its config."""
    results: dict = {k: config[k] for k in FACTS if k in config}
    for key, value in sorted(summary.items(), key=lambda kv: natural(kv[0])):  # top5 before top10, as logged
        split, _, metric = key.partition("/")
        if not is_number(value) or key.startswith("_"):
            continue
        if split in SPLITS and metric:
            results.setdefault(split, {})[metric] = value
        else:
            results[key] = value
    return results


def natural(key: str) -> list:
    """Sort key with the numbers in ``key`` compared as numbers (top5_error < top10_error)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]
