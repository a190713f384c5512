"""A run stopped by SIGTERM (a preemption, ``scancel``, SLURM before a requeue) ends with
exit code 143 and one line saying where its checkpoint is.

Lightning catches SIGTERM itself: it finishes the batch it is in, then raises
``SIGTERMException`` (a ``SystemExit`` with code 0) on every rank;
``PeriodicCheckpoint`` saves last.ckpt at that point. Exit code 0 would tell a job
script that the run finished: here it becomes 128 + 15, as for a process ended by the
signal."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

EXIT_CODE = 143  # 128 + SIGTERM


@contextmanager
def exit_on_preemption(run_dir: str | Path) -> Iterator[None]:
    try:
        yield
    except SystemExit as e:
        from lightning.pytorch.utilities.exceptions import SIGTERMException  # noqa: PLC0415

        if not isinstance(e, SIGTERMException):
            raise
        log.warning("stopped by SIGTERM; resume with the same command and ckpt_path=last "
                    "(hydra.run.dir=%s): checkpoints in %s", run_dir, Path(run_dir) / "checkpoints")
        raise SystemExit(EXIT_CODE) from None
