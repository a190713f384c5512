"""A CSV logger that never deletes a run's earlier rows.

Lightning's ``CSVLogger`` creates its writer lazily, once per process, and a new writer
deletes ``metrics.csv`` when the file exists ("Previous log files in this directory will
be deleted"). Under ``trainer=ddp_cpu`` (spawned workers) every trainer call (fit,
validate, test) starts fresh workers, each with a new writer: the test's writer deleted
the train and validation curves. This writer appends to the file it finds, and reads its
header first so that a new column rewrites the file with every earlier row kept. A fresh start
(no checkpoint to resume) in a directory that holds an earlier run's log begins the file anew
(``start_afresh``, called by the launching process before training): its rows are another run's."""
from __future__ import annotations

import csv
import os

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter


class AppendingExperimentWriter(ExperimentWriter):
    """``ExperimentWriter`` that continues an existing ``metrics.csv``."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                self.metrics_keys = list(csv.DictReader(f).fieldnames or [])


class AppendingCSVLogger(CSVLogger):
    """``CSVLogger`` whose writer is an ``AppendingExperimentWriter``."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = AppendingExperimentWriter(log_dir=self.log_dir)
        return self._experiment

    def start_afresh(self) -> bool:
        """An earlier run's ``metrics.csv`` removed before a fresh run logs (True when there was one)."""
        path = os.path.join(self.log_dir, ExperimentWriter.NAME_METRICS_FILE)
        self._experiment = None  # a writer made before read the old header
        if not self._fs.isfile(path):
            return False
        self._fs.rm(path)
        return True
