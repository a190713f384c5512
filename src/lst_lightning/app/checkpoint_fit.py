"""Whether a checkpoint to resume fits the model this run has built: the same state keys, with
the same shapes (a head sharded over the ranks excepted: its rows are laid out by the number of
ranks, and its own loader checks them). A resume with settings that change the model (another
``model.hidden_dim``, ``head``, ``data.vocab_size``) is refused in one line, before the run
writes anything into its directory (its config.yaml and vocab.json are the checkpoint's run's),
naming the first tensors that differ and the settings that differ from the config.yaml beside
the checkpoint. So is a resume on other data with the same shapes: another vocabulary (an edited
corpus) or another ``data.seed`` (other splits, or another synthetic task)."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from .wiring import flatten

#: how many differing tensors and settings the line names
SHOWN = 6


def saved_config(ckpt: Path) -> dict | None:
    """The flat resolved config.yaml of the run that saved ``ckpt`` (``<run>/checkpoints/*.ckpt``, or
    ``<run>/hpc_ckpt_<n>.ckpt``), or None where there is none."""
    for path in (ckpt.parent.parent / "config.yaml", ckpt.parent / "config.yaml"):
        if path.is_file():
            loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
            return flatten(loaded) if isinstance(loaded, dict) else None
    return None


def differing_settings(cfg: DictConfig, ckpt: Path) -> list[str]:
    """``key=saved (here now)`` for every setting of ``cfg`` whose value differs from the saved run's."""
    saved = saved_config(ckpt)
    if saved is None:
        return []
    here = flatten(OmegaConf.to_container(cfg, resolve=True))
    keys = [k for k in dict.fromkeys([*saved, *here]) if k != "ckpt_path" and saved.get(k) != here.get(k)]
    return [f"{k}={saved.get(k)} (here {here.get(k)})" for k in keys]


def vocabulary_change(words: list[str] | None, ckpt: Path) -> str | None:
    """How the data's vocabulary ``words`` differs from the vocab.json of the run that saved
    ``ckpt`` (its ids are the checkpoint's rows), or None where it is the same or either is missing."""
    if words is None:  # data without a vocabulary (the synthetic task)
        return None
    for path in (ckpt.parent.parent / "vocab.json", ckpt.parent / "vocab.json"):
        if path.is_file():
            there = json.loads(path.read_text())["words"]
            if there == words:
                return None
            i = next((i for i, (a, b) in enumerate(zip(there, words)) if a != b), min(len(there), len(words)))
            a, b = (w[i] if i < len(w) else None for w in (there, words))
            return (f"the data's vocabulary is not the one {path} holds ({len(there)} words there, {len(words)} "
                    f"here; id {i} is {a!r} there, {b!r} here)")
    return None


def data_seed_change(cfg: DictConfig, ckpt: Path) -> str | None:
    """How this run's ``data.seed`` differs from the run that saved ``ckpt``, or None. The seed draws
    a corpus's held-out documents and the synthetic task's examples, so another one resumes on other
    training examples, held-out ones among them, and the vocabulary check misses it where the
    vocabulary stays (the synthetic task has none)."""
    saved, here = (saved_config(ckpt) or {}).get("data.seed"), OmegaConf.select(cfg, "data.seed")
    if saved is None or here is None or saved == here:
        return None
    return (f"data.seed={here} draws other examples than the checkpoint's run's data.seed={saved} (its splits, "
            f"or the synthetic task's examples); set data.seed={saved} to keep them (seed={here} may stay, "
            f"for the rest)")


def mismatches(saved: dict, here: dict, skip: str | None = None) -> list[str]:
    """The tensors of ``here`` (the built model's state) that ``saved`` lacks, holds beyond it, or
    holds in another shape; a key under ``skip`` is compared by name only."""
    out = [f"{k} missing there" for k in here if k not in saved]
    out += [f"{k} not in this model" for k in saved if k not in here]
    for k in here:
        a, b = saved.get(k), here[k]
        if (skip is None or not k.startswith(skip)) and torch.is_tensor(a) and torch.is_tensor(b) \
                and a.shape != b.shape:
            out.append(f"{k} is {tuple(a.shape)} there, {tuple(b.shape)} here")
    return out


def check_fits(cfg: DictConfig, module: torch.nn.Module, ckpt_path: str | Path, words: list[str] | None = None) -> None:
    """One line (ValueError) when the checkpoint's model state does not fit ``module``, or the data's
    vocabulary ``words`` is not the one the checkpoint's run trained on (the same shapes, other
    words for its ids: the corpus changed)."""
    ckpt = Path(ckpt_path)
    mmap = zipfile.is_zipfile(ckpt)  # torch.save's format (the legacy one cannot be mapped)
    state = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=mmap).get("state_dict", {})
    sharded = getattr(getattr(module, "head", None), "parallel", "none") == "sharded"
    wrong = mismatches(state, module.state_dict(), "head." if sharded else None)
    changed = "; ".join(filter(None, (data_seed_change(cfg, ckpt), vocabulary_change(words, ckpt))))
    if not wrong:
        if changed:
            raise ValueError(f"ckpt_path={cfg.get('ckpt_path')}: {changed}: resume on the data of the run that "
                             f"saved {ckpt}")
        return
    if changed:
        wrong.insert(0, changed)
    settings = differing_settings(cfg, ckpt)
    more = f" (and {len(wrong) - SHOWN} more)" if len(wrong) > SHOWN else ""
    hint = (f"; the settings that differ from the run that saved it: {', '.join(settings[:SHOWN])}"
            f"{' ...' if len(settings) > SHOWN else ''}" if settings else "")
    raise ValueError(f"ckpt_path={cfg.get('ckpt_path')}: {ckpt} does not fit the model of these settings: "
                     f"{'; '.join(wrong[:SHOWN])}{more}{hint}; resume with the settings of the run that saved it")
