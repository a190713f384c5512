"""Lightning callbacks of the app: the head's share of the step time, and checkpoints
of a head whose rows are sharded over ranks. Both work with any LightningModule that
holds an ``OutputHead``."""
from .head_timing import HeadTiming
from .sharded_head_checkpoint import ShardedHeadCheckpoint

__all__ = ["HeadTiming", "ShardedHeadCheckpoint"]
