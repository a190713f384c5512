"""A run stopped by SIGTERM (a preemption, ``scancel``, SLURM before a requeue) or by a first
Ctrl-C ends with one line saying where its checkpoint is, and exit code 143 (SIGTERM) or 130
(Ctrl-C).

Lightning catches SIGTERM itself: it finishes the batch it is in, then raises
``SIGTERMException`` (a ``SystemExit`` with code 0) on every rank;
``PeriodicCheckpoint`` saves last.ckpt at that point. Exit code 0 would tell a job
script that the run finished: here it becomes 128 + 15, as for a process ended by the
signal.

A first Ctrl-C (SIGINT) while Lightning fits or tests takes the same road: the process sends
itself SIGTERM, so the batch it is in finishes and last.ckpt is saved there. Lightning's own
Ctrl-C stops wherever the step is (possibly between the head's update in backward and the
optimizer's step) and saves nothing; it is what a first Ctrl-C does while Lightning holds no
SIGTERM handler (before fitting, between fitting and testing), and what a second Ctrl-C does."""
from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

EXIT_CODE = 143  # 128 + SIGTERM
CTRL_C_EXIT_CODE = 130  # 128 + SIGINT


@contextmanager
def exit_on_preemption(run_dir: str | Path) -> Iterator[None]:
    interrupted = []
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main_thread else None

    def first_ctrl_c(signum, frame) -> None:
        signal.signal(signal.SIGINT, previous)  # a second Ctrl-C: at once, unsaved
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):  # Lightning fits nothing now
            raise KeyboardInterrupt
        interrupted.append(signum)
        log.warning("Ctrl-C: stopping after the batch in progress and saving last.ckpt (Ctrl-C again to stop "
                    "at once, unsaved)")
        os.kill(os.getpid(), signal.SIGTERM)

    if main_thread:
        signal.signal(signal.SIGINT, first_ctrl_c)
    try:
        yield
    except SystemExit as e:
        from lightning.pytorch.utilities.exceptions import SIGTERMException  # noqa: PLC0415

        if not isinstance(e, SIGTERMException):
            raise
        what = "Ctrl-C" if interrupted else "SIGTERM"
        log.warning("stopped by %s; resume with the same command and ckpt_path=last "
                    "(hydra.run.dir=%s): checkpoints in %s", what, run_dir, Path(run_dir) / "checkpoints")
        raise SystemExit(CTRL_C_EXIT_CODE if interrupted else EXIT_CODE) from None
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)
