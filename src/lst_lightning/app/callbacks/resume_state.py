"""What Lightning does not bring back itself when a run resumes mid-epoch.

- The random generators' states, so that a resumed run draws what the interrupted one
  would have drawn next (dropout masks, a sampled head's negatives, kernel samplers'
  draws). Lightning seeds them once and saves none. Every rank's states (Python's
  ``random``, NumPy's, torch's CPU and CUDA generators) go into the checkpoint under
  ``"rng_states"`` (a list by rank); a resumed rank gets its own back just before its
  first step (the training loader draws from a generator of its own, never from these). A
  checkpoint of another number of ranks restores none (the streams cannot be mapped) and
  says so.
- The training loader's position. Lightning saves the state of a loader that has
  ``state_dict`` (``data.ResumableLoader``) and loads it only if it makes the loader after
  restoring its loops; ``LanguageModel.configure_optimizers`` asks
  ``trainer.estimated_stepping_batches``, which makes it before. The saved state is
  handed to the loader here, before its first batch (loading it twice is harmless)."""
from __future__ import annotations

import logging
import random

import lightning.pytorch as pl
import numpy as np
import torch

from ...distributed.collectives import ProcessGroup

log = logging.getLogger(__name__)

KEY = "rng_states"


def rng_states() -> dict:
    """The states, as tensors and plain Python values (checkpoints load with ``weights_only``)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    states = {"python": random.getstate(), "numpy": numpy, "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def saved_loader_states(checkpoint: dict) -> list:
    return checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader", [])


class ResumeState(pl.Callback):
    def __init__(self):
        self._pending: dict | None = None
        self._loader_states: list = []

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        # every rank builds the checkpoint; rank 0 writes it
        checkpoint[KEY] = ProcessGroup.current().all_gather_objects(rng_states())

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self._loader_states = saved_loader_states(checkpoint)
        every = checkpoint.get(KEY)
        if every is None:
            return
        if len(every) != trainer.world_size:
            log.warning("the checkpoint holds the random states of %d rank(s), this run has %d: they are not "
                        "restored (the run goes on, but not as the interrupted one would have)",
                        len(every), trainer.world_size)
            return
        self._pending = every[trainer.global_rank]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._loader_states:
            loaders = trainer.train_dataloader  # one loader, or a list or dict of them
            loaders = list(loaders.values()) if isinstance(loaders, dict) else (
                list(loaders) if isinstance(loaders, (list, tuple)) else [loaders])
            loaders = [dl for dl in loaders if hasattr(dl, "load_state_dict")]
            if len(loaders) != len(self._loader_states):
                raise ValueError(f"the checkpoint holds {len(self._loader_states)} training loader state(s), "
                                 f"this run has {len(loaders)} resumable training loader(s)")
            for loader, state in zip(loaders, self._loader_states):
                loader.load_state_dict(state)
            self._loader_states = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        if self._pending is not None:
            set_rng_states(self._pending)
            self._pending = None
