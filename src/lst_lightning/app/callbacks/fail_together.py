"""When one process of a multi-process run raises, every process stops with its message.

Without this, the other ranks wait in their next collective (DDP's gradient all-reduce,
the head's) for the one that failed: until the process group's timeout (30 min by
default) under NCCL, or with gloo until the lost connection surfaces as an error of its
own ("Connection closed by peer") that says nothing of the cause. ``ddp_spawn`` and
torchrun end the other processes, still without the message.

Each rank opens its own client to the rendezvous store of the process group
(``MASTER_ADDR:MASTER_PORT``, set by Lightning's launchers, torchrun and SLURM alike)
and watches one key from a thread. A rank whose training raises writes
``rank r: <exception>`` there (Lightning's ``on_exception``) and, before its error goes
on, gives the others a moment to read it; every other rank logs the message and exits
with code 1 within about a second, wherever it waits. The key is unique to the launch, so
a restarted group never reads an old one. SIGTERM and Ctrl-C are not failures:
Lightning stops every rank together at the end of the batch.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid
from datetime import timedelta

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)

POLL_S = 0.5
GRACE_S = 4 * POLL_S  # the failing rank waits this long for the others to read its message


class FailTogether(pl.Callback):
    def __init__(self):
        self._store = None
        self._key = None
        self._rank = 0
        self._stop = None  # the watcher's stop flag, made in setup (ddp_spawn pickles the callbacks: no Event here)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.world_size <= 1 or not (dist.is_available() and dist.is_initialized()) or self._store is not None:
            return
        launch = trainer.strategy.broadcast(uuid.uuid4().hex)  # rank 0's: one key per launch
        try:
            self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                        timeout=timedelta(seconds=30), wait_for_workers=False)
        except (KeyError, ValueError, RuntimeError) as e:  # no rendezvous store to reach: nothing to watch
            log.warning("ranks will not fail together: no rendezvous store at MASTER_ADDR:MASTER_PORT (%s)", e)
            return
        self._key, self._rank = f"lst_lightning/failed/{launch}", trainer.global_rank
        self._stop = threading.Event()  # this stage's watcher's own
        threading.Thread(target=self._watch, args=(self._store, self._key, self._stop), name="fail-together",
                         daemon=True).start()

    def _watch(self, store, key: str, stop: threading.Event) -> None:
        while not stop.wait(POLL_S):
            try:
                if not store.check([key]):
                    continue
                said = store.get(key).decode()
            except Exception:  # the store went away: the group is ending, by failure or not
                return
            if stop.is_set():  # this rank failed and wrote the key itself
                return
            print(f"[rank {self._rank}] stopping: {said}", file=sys.stderr, flush=True)
            log.error("stopping: %s", said)
            time.sleep(2 * GRACE_S)  # the failing rank ends first: ddp_spawn and torchrun report its error
            os._exit(1)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._store is None or isinstance(exception, (SIGTERMException, KeyboardInterrupt)):
            return
        self._stop.set()
        try:
            if self._store.check([self._key]):  # another rank failed first: its message is the cause
                print(f"[rank {self._rank}] stopping: {self._store.get(self._key).decode()}", file=sys.stderr,
                      flush=True)
                return
            self._store.set(self._key, f"rank {self._rank} failed: {type(exception).__name__}: {exception}")
            time.sleep(GRACE_S)
        except Exception:  # noqa: S110 - the store is gone: the others are going too
            pass

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._stop is not None:
            self._stop.set()
        self._stop = self._store = None  # picklable again for the next trainer call's workers
