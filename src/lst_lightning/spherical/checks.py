"""How the factored step checks itself: at once on the host, or with device flags read
every ``sync_every`` steps. The head holds one of the two (``head.step_checks``), chosen from
``sync_every`` when it is built (or ``sync_every`` changes).

- ``HostChecks`` (``sync_every == 1``): every check is read on the host when it is made
  (a host synchronisation on a GPU); a bad target id raises before anything changes, a
  non-finite or singular step is skipped and counted at once, the repairs that fell due
  run after each step. The step's driver (driver.py's ``backward``) makes these checks
  inline and never calls this object: it holds only the host counts.
- ``DeviceFlags`` (``sync_every > 1``): the step reads nothing on the host, so a GPU
  never waits for it and it can be captured in a CUDA graph. Every check becomes a device
  flag: bad target ids turn into padding and void the step; a non-finite or singular
  step is masked out with ``torch.where`` (every buffer keeps its value) and counted; lr
  is a device scalar. ``head.sync()`` reads the flags every ``sync_every`` steps: it warns
  about skipped steps, runs the repairs that fell due, and raises for the bad ids.
"""
from __future__ import annotations

import warnings

import torch
from torch import Tensor

from .inverse_update import MAX_FACTORS, adaptive_factors


def capturing() -> bool:
    """Whether a CUDA graph is being captured on this thread's stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class HostChecks:
    """``sync_every == 1``: each check read on the host when it is made (inline in driver.py's ``backward``)."""

    deferred = False

    def __init__(self):
        self.calls = 0           # training steps run (host count; device flags)
        self.synced = (0, 0)     # (steps, skipped) at the last host read

    def note_loss_factor(self, head, grad: Tensor, scale: float) -> None:
        """A backward whose loss reached the head multiplied by a factor (not the loss scale):
        warned once, at once."""
        if float(grad) != scale:
            head._warn_loss_factor(float(grad) / scale)

    def read(self, head, peek: bool = False):
        """(steps at the last read, steps now, cond(U)'s bound, the step of a bad batch: 0) or
        None when no step ran since. ``peek`` (``DeviceFlags``'s) changes nothing here: each
        check was read as it was made."""
        n = int(head.steps)
        n_prev = self.synced[0]
        if n == n_prev:
            return None
        self.synced = (n, int(head.skipped_nonfinite))
        return n_prev, n, None, 0


class DeviceFlags(HostChecks):
    """``sync_every > 1``: each check a device flag, read every ``sync_every`` steps."""

    deferred = True

    def __init__(self):
        super().__init__()
        self.lr_filled = None    # the lr held in the device scalar head._lr_t
        self.pinned = False      # pin_lr(): the device lr holds a value of its own
        #: the products route's Neumann factors a step (Stabiliser.neumann: "max" keeps them there)
        self.factors = MAX_FACTORS
        #: "adaptive": the largest rho bound of the steps since the last read, on the device
        self.rho_max: Tensor | None = None
        self.read_at = -1  # the steps run (``calls``) at the last read
        self.warned_skipped = 0  # the skipped steps warned about
        #: several processes: the void step the last read found, (its rank, why: None for bad
        #: ids in that rank's rows; padded_rows.py)
        self.fault: tuple[int, str | None] | None = None
        #: the head's ``stats()`` as the last read took them ({}: no read yet): ``logged_stats()``
        self.stats: dict[str, float] = {}

    def note_loss_factor(self, head, grad: Tensor, scale: float) -> None:
        """The factor the loss reached the head with, kept on the device where it is not the loss
        scale: warned once at the next read."""
        head._loss_factor.copy_(torch.where(grad != scale, grad.to(torch.float64) / scale, head._loss_factor))

    def before_step(self, head) -> None:
        """The host's part before a step: lr refilled into the device scalar ``head._lr_t``
        (outside any graph capture) when it changed, which the step reads (a captured graph
        and a compiled step at each call: no recompile for a new lr); the adaptive rule's rho
        bound made once."""
        if not self.pinned and self.lr_filled != head.lr and not capturing():
            head._lr_t.fill_(head.lr)
            self.lr_filled = head.lr
        if self.rho_max is None and head.plan.neumann == "adaptive":
            self.rho_max = torch.zeros((), dtype=head.cond_bound.dtype, device=head.device)

    def lr(self, head) -> Tensor:
        """lr as the device scalar the step reads, refilled when lr changed (``before_step``)."""
        self.before_step(head)
        return head._lr_t

    def pin_lr(self, head, value: float | None) -> None:
        """Hold the device lr at ``value`` whatever ``head.lr`` (None: follow ``head.lr`` again)."""
        self.pinned = value is not None
        self.lr_filled = None
        if value is not None:
            head._lr_t.fill_(value)

    def tick(self, head) -> bool:
        """One more step run (on the host, after its device part); whether the flags are due to
        be read (every ``sync_every``). A step being captured is counted by its replays
        (``head.count_replay``), not here."""
        if capturing():
            return False
        self.calls += 1
        return self.calls % head.driving.sync_every == 0

    def read(self, head, peek: bool = False):
        """Read the flags in one host transfer (the steps taken and skipped, the step of a bad
        batch, cond(U)'s bound, a loss factor, the adaptive rule's rho bound; several processes:
        the void step's rank), and warn about skipped steps and a loss that reached the head
        multiplied. (steps at the last read, steps now, cond(U)'s bound, the step of a bad batch
        or 0), or None when no step ran since the last read (nothing is read then). ``peek``: the
        read changes nothing the steps depend on (the read's place in the run, the Neumann
        factors): the next read takes the same window of steps, and its repairs, as without it."""
        if self.calls == self.read_at:
            return None
        if not peek:
            self.read_at = self.calls
        stats = [getattr(head, n) for n in head.STATS]  # the head's stats() ride on the same transfer
        flags = stats + [head._bad_input, head._loss_factor]
        if self.rho_max is not None:
            flags.append(self.rho_max)
        padded = head.processes.padded if head.processes.padded.fault is not None else None
        ranks = [] if padded is None else padded.flags()  # several processes: the void step's rank and code
        values = torch.stack([f.to(torch.float64) for f in flags + ranks]).tolist()
        self.stats = head.stats_of(values[:len(stats)])
        bad, factor, *rho_max = values[len(stats):len(flags)]
        steps, skipped, cond_bound, bad = self.stats["steps"], self.stats["skipped_nonfinite"], \
            self.stats["cond_bound"], int(bad)
        if padded is not None:  # every rank reads at the same step: a void rank's message is gathered here
            self.fault = padded.read(tuple(int(v) for v in values[len(flags):]) if bad else None)
        if factor:
            head._warn_loss_factor(factor)
            head._loss_factor.zero_()
        n_prev, skipped_prev = self.synced
        warned = max(skipped_prev, self.warned_skipped)
        if any(k & (k - 1) == 0 for k in range(warned + 1, skipped + 1)):
            warnings.warn(f"{type(head).__name__}: {skipped - warned} step(s) with non-finite or invalid "
                          f"values since the last check were skipped, the head's state left untouched "
                          f"({skipped} skipped so far)", RuntimeWarning, stacklevel=3)
        self.warned_skipped = skipped
        if not peek:
            self.synced = (steps, skipped)
            self.adapt_factors(head, skipped > skipped_prev, rho_max[0] if rho_max else None, cond_bound)
        return n_prev, steps, cond_bound, bad

    def adapt_factors(self, head, skipped: bool, rho_max: float | None, cond_bound: float) -> None:
        """``Stabiliser.neumann="adaptive"``: the factors of the steps up to the next read, from
        the largest rho bound since the last (then reset); the maximum after a skipped step."""
        if head.plan.neumann != "adaptive":
            self.factors = MAX_FACTORS
            return
        if rho_max is None:  # no step yet
            return
        self.factors = adaptive_factors(rho_max, cond_bound, head.repairs.settings.cond_trigger, skipped, head.dtype)
        self.rho_max.zero_()

    def raise_bad_input(self, head, step: int) -> None:
        """Raise for the void step ``step`` (as the read found it), in one line: its bad target
        ids; several processes: the rank whose rows held them, or the rank whose input failed
        and its message (``self.fault``, from the read)."""
        head._bad_input.zero_()
        fault, self.fault = self.fault, None
        where = "" if fault is None else f" in rank {fault[0]}'s rows"
        what = (f"had target ids outside [0, {head.num_classes}){where} (class ids, or -1 for padding)"
                if fault is None or fault[1] is None else f"was void on every rank: rank {fault[0]}'s input {fault[1]}")
        raise ValueError(f"{type(head).__name__}: the batch of step {step} {what}; that step was skipped and left "
                         f"the head's state untouched (device flags are read every sync_every={head.sync_every} "
                         "steps; sync_every=1 checks each batch as it comes)")


def checks_for(deferred: bool, old: HostChecks | None = None) -> HostChecks:
    """The checks for a step mode; ``old`` is kept when it is already of that kind (its
    host counts carry over a change of ``sync_every``)."""
    cls = DeviceFlags if deferred else HostChecks
    if type(old) is cls:
        return old
    new = cls()
    if old is not None:
        new.calls, new.synced = old.calls, old.synced
    return new
