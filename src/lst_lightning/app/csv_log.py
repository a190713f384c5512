"""A CSV logger that never deletes a run's earlier rows.

Lightning's ``CSVLogger`` creates its writer lazily, once per process, and a new writer
deletes ``metrics.csv`` when the file exists ("Previous log files in this directory will
be deleted"). Under ``trainer=ddp_cpu`` (spawned workers) every trainer call (fit,
validate, test) starts fresh workers, each with a new writer: the test's writer deleted
the train and validation curves. This writer appends to the file it finds, and reads its
header first so that a new column rewrites the file with every earlier row kept."""
from __future__ import annotations

import csv

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
