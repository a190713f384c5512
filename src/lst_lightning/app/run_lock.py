"""One lst-train run at a time in a run directory: the launching process (global rank 0) holds
an exclusive ``flock`` on the directory itself while the run is built, trains and tests; a second
run given the same directory (``hydra.run.dir``) is refused in one line before it reads or writes
anything there, where the two would have written one set of checkpoints, one CSV log and one
results.json between them. The lock is the kernel's: it ends with the process, however that
ends (a SIGKILL leaves nothing to clean up), and it creates no file.

The other ranks of a run (torchrun, srun, a relaunched command) share its directory and take
no lock. On a file system that cannot lock a directory, the run goes on without one."""
from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # not on POSIX: no lock
    fcntl = None

#: the variables launchers set to a process's global rank, first found first
GLOBAL_RANK = ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
#: where none is set: a process's rank on its node, and its node's (Lightning's relaunched commands)
LOCAL_RANKS = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK")


def global_rank_zero() -> bool:
    """Whether this process is rank 0 of its run, or no launcher gave it a rank."""
    for name in GLOBAL_RANK:
        if name in os.environ:
            return os.environ[name].strip() == "0"
    return all(os.environ.get(name, "0").strip() == "0" for name in LOCAL_RANKS)


@contextmanager
def holding(run_dir: str | Path) -> Iterator[None]:
    """The run directory's lock for the block (made when missing); ValueError, one line, where
    another process holds it."""
    if fcntl is None or not global_rank_zero():
        yield
        return
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:  # another errno: no locks on directories here (some network file systems)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ValueError(f"{run_dir} is in use by another lst-train run (it holds the directory's "
                                 "lock): give this run another hydra.run.dir, or start it when that run has "
                                 "ended") from None
        yield
    finally:
        os.close(fd)  # the lock with it
