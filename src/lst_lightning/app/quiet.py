"""What a run shows: its own lines, not other libraries' chatter. gensim's INFO about its
toy dictionary, ``datasets``' "Generating train split" progress bars, Lightning's
advertisement tips and deprecation warnings raised outside this package are silenced;
warnings and errors of every library still show."""
from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

# INFO that says nothing about the run: shown from WARNING up
CHATTY = ("gensim", "datasets", "urllib3", "filelock", "fsspec")
# Lightning's rank-zero messages advertising its cloud products
ADVERTISEMENT = "💡 Tip:"
# a warning raised outside these modules is not ours to show
OURS = r"(?!lst_lightning|lst_kernels)"
#: this package's lines where nothing configured logging: Hydra's job-log format
LINE_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


class _NoAdvertisements(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(ADVERTISEMENT)


def quiet_libraries() -> None:
    """Silence the chatter (idempotent; call in every process, spawned workers too)."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # read when datasets is imported
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.WARNING)
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoAdvertisements) for f in rank_zero.filters):
        rank_zero.addFilter(_NoAdvertisements())
    for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=OURS)


def one_handler_for_lightning() -> None:
    """Lightning adds a stderr handler of its own to the ``lightning`` logger and lets the
    records propagate too: under Hydra's logging (a root handler) each line came twice.
    Call after importing Lightning."""
    if logging.getLogger().hasHandlers():
        for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
            lg = logging.getLogger(name)
            for h in list(lg.handlers):
                lg.removeHandler(h)
            lg.propagate = True


def show_our_lines(log_file: str | Path | None = None) -> None:
    """Where nothing configured logging (a script calling ``train.run``, as
    ``scripts/quality_table.py`` does; a spawned worker), this package's INFO lines (the
    progress, ``head.step=auto``'s choice) go to stderr, and to ``log_file`` where given.
    Under ``lst-train`` Hydra's handlers show them. Idempotent."""
    if logging.getLogger().handlers:
        return
    ours = logging.getLogger("lst_lightning")
    ours.setLevel(logging.INFO)
    have = {getattr(h, "baseFilename", None) for h in ours.handlers}
    new = [] if None in have else [logging.StreamHandler()]
    if log_file is not None and str(Path(log_file).resolve()) not in have:
        new.append(logging.FileHandler(log_file))
    for h in new:
        h.setFormatter(logging.Formatter(LINE_FORMAT))
        ours.addHandler(h)
