"""Ranks started as torchrun starts them, by forking this process: ``fork_ranks(worker, out)``
runs ``worker(rank, port, out)`` on each rank (the worker sets the rendezvous variables and
saves ``out / rank<r>.pt``) and returns what each rank saved."""
import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fork_ranks(worker, out: Path, world: int = 2) -> list:
    mp.start_processes(worker, args=(free_port(), out), nprocs=world, start_method="fork")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
