"""Lightning callbacks of the app: the head's share of the step time, checkpoints of a
head whose rows are sharded over ranks, the self-updating head's step at the optimizer's
step (accumulation, loss scaling), row-sparse gradients averaged over the ranks, a progress line every few steps, and the run's record
(facts as hyperparameters, results as the W&B summary). All work with any
LightningModule that holds an ``OutputHead``."""
from .head_steps import HeadSteps
from .head_timing import HeadTiming
from .progress_log import ProgressLog
from .run_record import RunRecord, run_facts
from .sharded_head_checkpoint import ShardedHeadCheckpoint
from .sparse_gradients import SparseGradients

__all__ = ["HeadSteps", "HeadTiming", "ProgressLog", "RunRecord", "ShardedHeadCheckpoint", "SparseGradients", "run_facts"]
