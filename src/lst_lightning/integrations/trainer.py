"""The factored head under the Hugging Face ``Trainer``: exact accumulation and the lr schedule.

The head updates itself with its own ``lr`` and holds no parameter, so the Trainer's
optimizer and scheduler never see it. ``head_follows_trainer()`` is a ``TrainerCallback``
that, at the start of training, attaches the head to the Trainer's optimizer (one exact
step for all the micro-batches of ``gradient_accumulation_steps``, taken at the
optimizer's step, with fp16's loss scale divided out; spherical/pending.py), and before
each step sets ``head.lr = base_lr * current_lr / initial_lr``, the Trainer's schedule
scaled to the head's own lr (as the app does, app/schedule.py); ``initial_lr`` is the
schedule's own start, the optimizer's lr where the Trainer is given an optimizer.

Several processes (DDP under ``torchrun`` / ``accelerate launch``; processes.py): at the
start of training the head joins the process group (its ``parallel`` mode; ``"none"`` is
refused there, before any step, with the fix), the model's loss follows the Trainer's
token count (``average_tokens_across_devices``), and before each checkpoint a sharded
head's V is gathered on rank 0, so that the checkpoint holds all of V and resumes on any
number of processes; at the end of training too, for ``trainer.save_model()``.

The head's device flags (its checks, read every ``sync_every`` steps) are read at the end of
training too, as a report (``sync(repair=False)``: the repairs due wait for the next read, so
that a run's state never depends on where it stopped or was saved): a bad label since the last
read raises there, naming its step, which left the head untouched.

A PEFT model (``peft.get_peft_model`` on a patched model) saves its adapter alone, so its
checkpoints would leave out the head's state: each checkpoint of one gets the head's state in a
file of its own beside the adapter (``HEAD_FILE``), which a resumed run loads before its first
step from the folder the Trainer loaded the adapter from (``AdapterFolders``).

The head is attached with ``accumulate=gradient_accumulation_steps``: when ``train()``
raises inside an accumulation window (a bad label in a micro-batch), the head stays
attached to that Trainer's optimizer (the Trainer has no exception hook), and a later
training forward that finds a whole window kept and no optimizer step raises with the
fix in one line (``head.detach()``, or ``train()`` again, which re-attaches).
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

#: a PEFT model's checkpoint: the head's state (its tensors, as a patched model's state dict
#: holds them under ``lm_head.``), beside the adapter
HEAD_FILE = "factored_head.safetensors"
#: the smallest head lr the schedule sets: a scheduler at 0 (warm-up start, end of a
#: linear decay) would give 0, which the head refuses; this step is then a no-op in effect.
MIN_LR = 1e-30


def scheduled_lr(base_lr: float, current_lr: float, initial_lr: float) -> float:
    """The head's lr when the body's scheduler is at ``current_lr`` of ``initial_lr``."""
    return max(base_lr * current_lr / initial_lr, MIN_LR)


def initial_lr(lr_scheduler, learning_rate: float) -> float:
    """The lr the Trainer's schedule starts from: its first group's initial lr (``base_lrs``),
    which is the optimizer's own where the Trainer is given one (``optimizers=(opt, None)``,
    whatever ``args.learning_rate``); ``learning_rate`` for a scheduler that keeps none."""
    base = getattr(getattr(lr_scheduler, "scheduler", lr_scheduler), "base_lrs", None)  # accelerate wraps it
    return float(base[0]) if base else learning_rate


def check_trainer_args(args) -> None:
    """One ValueError, when the Trainer is built, for settings under which the Trainer computes
    the loss itself from the logits (label smoothing): the factored head makes no logits in
    training and trains through its own loss; and for several GPUs in one process, which the
    Trainer trains through ``nn.DataParallel``, whose copies of the head lose their steps."""
    if getattr(args, "n_gpu", 1) > 1:
        raise ValueError(f"the Trainer sees {args.n_gpu} GPUs in one process and would train through nn.DataParallel, "
                         "whose copies of the factored head would each lose their step: launch one process per GPU "
                         f"(torchrun --nproc_per_node {args.n_gpu} train.py, or accelerate launch, with factor_lm_head"
                         "(..., parallel=\"replicated\") or \"sharded\"), or train on one GPU (CUDA_VISIBLE_DEVICES=0)")
    if getattr(args, "label_smoothing_factor", 0):
        raise ValueError(f"label_smoothing_factor={args.label_smoothing_factor} cannot train the factored head: the "
                         "Trainer then takes the labels from the model's inputs and computes the loss from logits, "
                         "which the head does not make in training (it trains through its own loss); set "
                         "label_smoothing_factor=0")


def drop_autocast_wrapper(model) -> None:
    """Give a patched model its own forward back from accelerate's mixed-precision wrapper.
    accelerate (the Trainer's ``bf16``/``fp16``) wraps ``model.forward`` in an autocast of a local
    function, which cannot be pickled, and keeps the forward it wrapped as ``_original_forward``:
    an ordinary model's forward is a bound method, which pickling takes back to the class's, but
    the patched forward is the model's own attribute, so ``torch.save(model)`` failed after
    training. The model is then as an ordinary one is once saved and loaded."""
    from .hf import OwnForward

    original = vars(model).get("_original_forward")
    if isinstance(original, OwnForward) and "forward" in vars(model):
        model.forward = original
        del model._original_forward


def saves_adapter_only(model) -> bool:
    """Whether the Trainer's checkpoints of ``model`` leave out the head: a PEFT model's
    ``save_pretrained`` writes its adapter alone."""
    return hasattr(model, "peft_config")


def head_file(args, state) -> str:
    """Where the checkpoint of step ``state.global_step`` in ``args.output_dir`` holds the head's state."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}", HEAD_FILE)


class AdapterFolders:
    """The folders a PEFT model's ``load_adapter`` reads while the Trainer starts (its resume
    loads the adapter so, from the checkpoint it resumes): ``watch`` shadows the model's method
    with this object, which notes the folder and calls the method; ``done`` takes the shadow
    away and gives the last folder. (An object, not a closure: a model still watched, a Trainer
    made and never trained, pickles.)"""

    def __init__(self):
        self.last: str | None = None
        self.model = None

    def watch(self, model) -> None:
        self.model = model
        model.load_adapter = self

    def __call__(self, model_id, *args, **kwargs):
        self.last = str(model_id)
        return type(self.model).load_adapter(self.model, model_id, *args, **kwargs)

    def done(self) -> str | None:
        if self.model is not None and vars(self.model).get("load_adapter") is self:
            del self.model.load_adapter  # the class's method again
        self.model = None
        return self.last


def save_head_file(head, path: str) -> None:
    """The head's state as a patched model's state dict holds it (tensors only), in ``path``."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in head.state_dict().items()}, path)


def load_head_file(head, path: str, doing: str) -> None:
    """The head's state from a PEFT model's checkpoint (``save_head_file``), where the Trainer
    loads the adapter (``doing``: a resume, the best model at the end); one ValueError, the head
    unchanged, where the file is missing."""
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise ValueError(f"{doing}: the checkpoint holds the PEFT adapter alone, and the factored head's state, which "
                         f"head_follows_trainer saves beside it, is not at {path} (a checkpoint saved without "
                         "head_follows_trainer cannot give the head)")
    head.load_state_dict(load_file(path, device=str(head.device)))


def head_follows_trainer():
    """A ``transformers.TrainerCallback``: ``Trainer(..., callbacks=[head_follows_trainer()])``
    for a model patched by ``factor_lm_head``."""
    from transformers import TrainerCallback

    from .hf import PATCH, factored_head
    from .processes import check_processes, check_strategy, gather_for_checkpoint, join_processes

    class HeadFollowsTrainer(TrainerCallback):
        head = base_lr = patch = None

        def __init__(self):
            self.adapters = AdapterFolders()

        def on_init_end(self, args, state, control, model=None, **kwargs):
            from accelerate.state import AcceleratorState  # built by the Trainer before this event

            check_strategy(AcceleratorState().distributed_type)  # FSDP, DeepSpeed: one line, before any step
            check_trainer_args(args)
            if saves_adapter_only(model):  # where a resume loads the adapter from, its head's state is too
                self.adapters.watch(model)

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            core = getattr(model, "module", model)
            self.head, self.patch = factored_head(core), getattr(core, PATCH)
            check_processes(self.head, args.world_size)  # one line on every rank, before any step
            folder = self.adapters.done()
            if saves_adapter_only(core) and state.global_step > 0:  # resumed: the adapter's checkpoint lacks the head
                path = head_file(args, state) if folder is None else os.path.join(folder, HEAD_FILE)
                load_head_file(self.head, path, f"resuming a PEFT model at step {state.global_step}")
            join_processes(self.head)
            self.patch.items_over_world = bool(args.average_tokens_across_devices)
            self.base_lr = self.head.lr
            self.head.attach(optimizer, accumulate=args.gradient_accumulation_steps)  # accelerate's, and its scaler
            if self.head.device.type == "cuda" and state.is_world_process_zero:
                log.info("head_follows_trainer: the head's %s step, its flags read every %d steps; not replayed from "
                         "a CUDA graph, which steps in the forward: the Trainer steps the head at its optimizer's step",
                         "compiled" if self.head.compiles else "eager", self.head.sync_every)

        def on_step_begin(self, args, state, control, lr_scheduler=None, **kwargs):
            initial = None if lr_scheduler is None else initial_lr(lr_scheduler, args.learning_rate)
            if initial is not None and initial > 0:
                self.head.lr = scheduled_lr(self.base_lr, lr_scheduler.get_last_lr()[0], initial)

        def on_step_end(self, args, state, control, **kwargs):
            self._before_save(control)

        def on_epoch_end(self, args, state, control, **kwargs):
            self._before_save(control)

        def _before_save(self, control):
            """Every rank, before the Trainer's checkpoint that rank 0 writes (the Trainer's
            flow callback, which runs first, has decided ``should_save``)."""
            if control.should_save:
                self.patch.whole_v = gather_for_checkpoint(self.head)

        def on_save(self, args, state, control, model=None, **kwargs):
            if saves_adapter_only(getattr(model, "module", model)) and state.is_world_process_zero:
                save_head_file(self.head, head_file(args, state))  # (a sharded head: V gathered whole)
            self.patch.whole_v = None

        def on_train_end(self, args, state, control, model=None, **kwargs):
            if self.head is not None:
                try:  # the flags of the last steps read: a bad batch among them raises from train()
                    self.head.sync(repair=False)  # (a report: the state must not depend on where a run stopped)
                finally:
                    self.head.detach()
                    self.head.lr = self.base_lr
                best = state.best_model_checkpoint if args.load_best_model_at_end else None
                if best is not None and saves_adapter_only(getattr(model, "module", model)):
                    # the Trainer loaded the best checkpoint's adapter alone: its head too, on every rank
                    load_head_file(self.head, os.path.join(best, HEAD_FILE), f"loading the best model ({best})")
                # for trainer.save_model() / save_pretrained() after training, on rank 0 only:
                # the whole V while the head is unchanged (hf.py checks its version)
                self.patch.whole_v = gather_for_checkpoint(self.head)
                if model is not None:  # torch.save(model) after training
                    drop_autocast_wrapper(getattr(model, "module", model))

    return HeadFollowsTrainer()
