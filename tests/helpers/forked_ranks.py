"""Ranks started as torchrun starts them: ``start_ranks(fn, args, world)`` runs ``fn(rank, *args)``
on each of ``world`` processes; ``fork_ranks(worker, out)`` runs ``worker(rank, port, out)`` (the
worker sets the rendezvous variables and saves ``out / rank<r>.pt``) and returns what each rank saved;
``in_fresh_process(fn, ...)`` returns ``fn(...)`` run in one such process (a run whose trainer forks
its own ranks, ``trainer.strategy=ddp_fork``).

The ranks are forked from a fresh process (``forkserver``, torch and the package imported once in
it), never from the test's own: a rank forked from a pytest worker that has run
tests/spherical/test_compiled.py fails at its first backward ("Unable to handle autograd's
threading in combination with fork-based multiprocessing": test_compiled.py and then
test_multi_process.py in one process), and which files a worker ran before is the suite's order,
not the test's."""
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

mp.set_forkserver_preload(["torch", "lst_lightning", "lst_lightning.app.train"])  # once its server runs: no effect
#: the repository: a rank imports its function's test module by the name pytest gave it (``tests.app.test_ddp``)
ROOT = str(Path(__file__).resolve().parents[2])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_ranks(fn, args: tuple, world: int = 2) -> None:
    added = ROOT not in sys.path
    if added:  # a rank takes this process's sys.path when it starts
        sys.path.append(ROOT)
    try:
        mp.start_processes(fn, args=args, nprocs=world, start_method="forkserver")
    finally:
        if added:
            sys.path.remove(ROOT)


def fork_ranks(worker, out: Path, world: int = 2) -> list:
    start_ranks(worker, (free_port(), out), world)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _call(rank: int, fn, args: tuple, kwargs: dict, out: Path) -> None:
    torch.save(fn(*args, **kwargs), out)


def in_fresh_process(fn, *args, **kwargs):
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.pt"
        start_ranks(_call, (fn, args, kwargs, out), 1)
        return torch.load(out, weights_only=False)
