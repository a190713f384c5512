"""Which checkpoint a run resumes from: ``ckpt_path`` as the user gave it.

- a file: that checkpoint;
- ``last``: the newest checkpoint of this run directory (``<run_dir>/checkpoints/*.ckpt``, or
  a SLURM requeue's ``<run_dir>/hpc_ckpt_<n>.ckpt``); none is an error;
- ``auto``: the same, or a fresh start when there is none: the one command a requeued job
  runs every time (with a fixed ``hydra.run.dir``, docs/app.md "Checkpoints and resuming");
- null: a fresh start.

A run directory holds one run's checkpoints: a fresh start, or a resume from another directory's
checkpoint, in a directory that holds checkpoints is refused (its saves would mix with the earlier
run's, and ``ckpt_path=last`` after an interruption would resume the earlier run).

Needs no torch: the answer is known before the heavy imports."""
from __future__ import annotations

import zipfile
from pathlib import Path

NEWEST = ("last", "auto")


def run_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run directory's checkpoints, oldest first (last.ckpt after a step file of the same time)."""
    run_dir = Path(run_dir)
    found = [*(run_dir / "checkpoints").glob("*.ckpt"), *run_dir.glob("hpc_ckpt_*.ckpt")]
    return sorted((p for p in found if p.is_file()), key=lambda p: (p.stat().st_mtime_ns, p.name == "last.ckpt"))


def resolve_ckpt_path(ckpt_path, run_dir: str | Path) -> str | None:
    """The checkpoint file to resume from, or None for a fresh start; raises (one line) when
    ``ckpt_path=last`` finds nothing, a file does not exist, or the run directory holds an
    earlier run's checkpoints that this run would not continue."""
    if not ckpt_path:
        refuse_mixing(ckpt_path, run_dir)
        return None
    if str(ckpt_path) in NEWEST:
        found = run_checkpoints(run_dir)
        if found:
            return readable(ckpt_path, found[-1])
        if ckpt_path == "auto":
            return None
        raise FileNotFoundError(f"ckpt_path=last: no checkpoint to resume in {Path(run_dir) / 'checkpoints'}; "
                                "give the run's directory with hydra.run.dir=<dir> (the same as the interrupted "
                                "run's), or ckpt_path=auto to start afresh when there is none")
    if not Path(ckpt_path).is_file():
        raise FileNotFoundError(f"ckpt_path={ckpt_path}: no such checkpoint file; give a run's "
                                "checkpoints/last.ckpt, ckpt_path=last (hydra.run.dir=<the run's directory>), "
                                "or ckpt_path=null to start afresh")
    refuse_mixing(ckpt_path, run_dir)
    return readable(ckpt_path, ckpt_path)


def resumes_its_own_run(ckpt_path, run_dir: str | Path) -> bool:
    """Whether ``ckpt_path`` resumes a checkpoint of ``run_dir`` itself (the run that directory holds)."""
    found = resolve_ckpt_path(ckpt_path, run_dir)
    return found is not None and one_of(found, run_checkpoints(run_dir))


def one_of(path, checkpoints: list[Path]) -> bool:
    """Whether ``path`` is one of ``checkpoints`` (``run_checkpoints``'), however either is written."""
    return Path(path).resolve() in {p.resolve() for p in checkpoints}


def refuse_mixing(ckpt_path, run_dir: str | Path) -> None:
    """One line when ``run_dir`` holds checkpoints and ``ckpt_path`` (null, or a file) is not one of them."""
    run_dir = Path(run_dir)
    found = run_checkpoints(run_dir)
    if not found or (ckpt_path and one_of(ckpt_path, found)):
        return
    what = "a fresh start" if not ckpt_path else f"ckpt_path={ckpt_path} (another directory's checkpoint)"
    names = ", ".join(str(p.relative_to(run_dir)) for p in reversed(found))
    raise ValueError(f"{what} in {run_dir}, which holds an earlier run's checkpoints ({names}): ckpt_path=last "
                     "resumes that run; to start another, give an empty hydra.run.dir (hydra.sweep.dir in a "
                     "multirun) or delete those files")


#: the first bytes of torch.save's format before its zip files (``_use_new_zipfile_serialization=False``)
LEGACY_MAGIC = b"\x80\x02\x8a\x0a"


def readable(ckpt_path, path: str | Path) -> str:
    """``path`` where it is a checkpoint as torch.save writes it (a zip file whose directory is whole, or
    the legacy format); else one line, before any process starts or loads it (a file cut short by a
    full disk or a copy, another kind of file)."""
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            if f.read(len(LEGACY_MAGIC)) != LEGACY_MAGIC:
                named = "the file" if str(path) == str(ckpt_path) else path
                raise ValueError(f"ckpt_path={ckpt_path}: {named} is not a checkpoint torch.load can read (cut "
                                 "short, or another kind of file); give another of the run's checkpoints "
                                 "(checkpoints/step<N>.ckpt), or ckpt_path=null to start afresh")
    return str(path)
