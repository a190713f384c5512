"""Lightning callbacks of the app: the head's share of the step time, periodic checkpoints
(and on SIGTERM), the random states in them, checkpoints of a head whose rows are sharded
over ranks, the self-updating head's step at the optimizer's step (accumulation, loss
scaling), row-sparse gradients averaged over the ranks, a progress line every few steps,
the run's record (facts as hyperparameters, results as the W&B summary), every rank
stopped with the message of the one that failed, the time budget on the training clock, and
the progress bar. All work with any
LightningModule that holds an ``OutputHead``."""
from .fail_together import FailTogether
from .head_steps import HeadSteps
from .head_timing import HeadTiming
from .periodic_checkpoint import PeriodicCheckpoint
from .progress_bar import ProgressBar
from .progress_log import ProgressLog
from .resume_state import ResumeState
from .run_record import RunRecord, run_facts
from .sharded_head_checkpoint import ShardedHeadCheckpoint
from .sparse_gradients import SparseGradients
from .time_budget import TrainingClock, budget_timer

__all__ = ["FailTogether", "HeadSteps", "HeadTiming", "PeriodicCheckpoint", "ProgressBar", "ProgressLog", "ResumeState",
           "RunRecord", "ShardedHeadCheckpoint", "SparseGradients", "TrainingClock", "budget_timer", "run_facts"]
