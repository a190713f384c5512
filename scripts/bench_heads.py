"""Training-step time of every output head over D, d and m, side by side.

    uv run python scripts/bench_heads.py [--smoke] [--out DIR | --update-results]
    uv run python scripts/bench_heads.py --sweep-d [--smoke]   # d = 512 .. 4096 against the fused softmaxes

On a GPU: D in {10k, 100k, 793 471, 2M, 10M, 20M}, d in {512, 300}, m in {128, 1024},
CUDA-event medians, peak memory beyond the parameters, the issue's target checks.
On CPU (one thread): D in {10k, 100k, 793 471}, d = 300, m = 128. ``--smoke``: every
code path at tiny sizes in seconds. See docs/benchmarks.md.

``--sweep-d``: d = 512, 1024, 2048 and 4096 at m = 1024 and D = 10^5 and 10^6 (each
unless given), lst-train's default factored step (``loss=sampled``; on a GPU replayed from its
CUDA graph) against torch's ``F.linear_cross_entropy`` and cut-cross-entropy in bf16: the
measured side of ``scripts/crossover.py``'s counted crossover in D for each d. Its files are
``bench_heads_dsweep_<machine>.*``.

One run on one machine, the same sizes for every head: the factored head (each
loss), the naive explicit-W head, torch's full softmax (``F.linear_cross_entropy``
through ``SoftmaxHead`` and plain logits + cross-entropy), Liger-Kernel and
cut-cross-entropy when installed, the hierarchical, adaptive and sampled heads.
A step is forward + backward + the update: self-updating heads update inside
backward, the others take an SGD ``optimizer.step()``.

Each head runs "as far as it fits": its memory is estimated before it is built and
before each step size, against free GPU memory (or ``--max-gb``); a head that would
not fit, runs out of memory, or is slower than ``--max-step-s`` is recorded in the
CSV with the reason instead of stopping the run. Results (CSV, plot, markdown) are
rewritten after every size, so a run cut short keeps what it measured: in a fresh run
directory (``outputs/bench/bench_heads/<time>/``), ``--out DIR``, or with
``--update-results`` benchmarks/results/.
"""
from __future__ import annotations

import argparse
import csv
import gc
import math
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

# benchlib first: in a bare checkout (the GPU machine) it puts the package on the path.
from benchlib import (add_output_args, cuda_clock, existing_path, interleaved_times, machine_name, markdown_table,
                      output_dir, perf_clock, positive_int, pyplot, quantile, save_figure, write_csv, wrote, zipf_targets)

import torch
import torch.nn.functional as F
import yaml
from rich.console import Console
from rich.table import Table

from lst_lightning.app.configs import config_dir
from lst_lightning.baselines.softmax import CCE_MAX_ELEMENTS
from lst_lightning.data.synthetic import zipf_counts
from lst_lightning.heads import (AdaptiveSoftmaxHead, CudaGraphStep, FactoredSphericalHead, HierarchicalSoftmaxHead,
                                 NaiveSphericalHead, SampledSoftmaxHead, SoftmaxHead)
from lst_lightning.losses import LOSSES

from gpu_targets import TARGET

PAPER = {"D": 793_471, "d": 300, "m": 128, "vs_naive_cpu": 3257.0, "vs_naive_gpu": 479.0}
SIZES = {
    "gpu": dict(D=[10_000, 100_000, 793_471, 2_000_000, 10_000_000, 20_000_000], d=[512, 300], m=[128, 1024]),
    "cpu": dict(D=[10_000, 100_000, 793_471], d=[300], m=[128]),
    "smoke": dict(D=[50, 300], d=[16], m=[6]),
}
# --sweep-d: the widths of real models, against the fused full softmaxes (the smoke run: tiny widths)
SWEEP = {"full": dict(D=[100_000, 1_000_000], d=[512, 1024, 2048, 4096], m=[1024]),
         "smoke": dict(D=[50, 300], d=[8, 16], m=[6])}
SWEEP_HEADS = ("factored/sampled", "factored_graph/sampled", "softmax/torch", "softmax/liger", "softmax/cce")
COLUMNS = ["machine", "device", "torch", "threads", "head", "variant", "dtype", "D", "d", "m", "median_ms",
           "p10_ms", "p90_ms", "steps", "peak_extra_mb", "param_mb", "status"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
REFERENCE = ("factored", "zloss")  # the head every ratio is taken against
LR = 0.01


@dataclass(frozen=True)
class HeadSpec:
    head: str
    variant: str
    self_updating: bool = False
    cuda_only: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.head, self.variant)


# the spherical losses; the composite loss="sampled" with the head's negatives and preconditioner at their defaults
# (S log-uniform classes shared by the batch, one dense block; S by D as for the sampled softmax
# below, heads.samplers.default_num_samples), as lst-train loss=sampled
HEADS = [HeadSpec("factored", loss, self_updating=True)
         for loss in ("zloss", *sorted(n for n in LOSSES if n != "zloss"))]
# The factored head's GPU paths: train_step with no host reads (sync_every > 1), and that step in a
# CUDA graph; with loss="sampled" the draw of its sampled classes is inside the graph (the app's default loss).
HEADS += [HeadSpec("factored_sync", "zloss", self_updating=True, cuda_only=True),
          HeadSpec("factored_graph", "zloss", self_updating=True, cuda_only=True),
          HeadSpec("factored_graph", "sampled", self_updating=True, cuda_only=True)]
FACTORED = ("factored", "factored_sync", "factored_graph")
LINEAR_IN_D = ("naive", "softmax", "logits_ce")  # the heads whose step scores all D classes
SYNC_EVERY = 64
HEADS += [HeadSpec("naive", "zloss", self_updating=True), HeadSpec("softmax", "torch"), HeadSpec("logits_ce", "torch"),
          HeadSpec("softmax", "liger", cuda_only=True), HeadSpec("softmax", "cce", cuda_only=True),
          HeadSpec("hsoftmax", "sqrt_mass"), HeadSpec("adaptive", "0.05,0.25"), HeadSpec("sampled", "log_uniform")]
# The app's default for these two (head.sparse=true): row-sparse W and b, stepped by a row-sparse
# optimiser (the variants above are the dense form, head.sparse=false).
SPARSE = ",sparse"
HEADS += [HeadSpec("hsoftmax", "sqrt_mass" + SPARSE), HeadSpec("sampled", "log_uniform" + SPARSE)]


def label(row: dict) -> str:
    return f"{row['head']}/{row['variant']} {row['dtype']}"


# --- memory estimates (bytes), checked before building and before stepping ---------------

def param_bytes(spec: HeadSpec, D: int, d: int, nbytes: int) -> int:
    if spec.head in (*FACTORED, "naive"):
        return 4 * D * d + 16 * d * d
    if spec.head == "adaptive":  # shortlist full width, tails at d/4 and d/16
        return nbytes * D * d // 2
    return nbytes * D * d


def step_bytes(spec: HeadSpec, D: int, d: int, m: int, nbytes: int, head=None) -> int:
    """What one step holds beyond the parameters, roughly and on the high side."""
    if spec.head in FACTORED:
        return 4 * (32 * m * d + 16 * d * d + 4 * m * m + (1 << 16) * d)
    if spec.head == "naive":  # scores, targets, loss temporaries and dO (m, D); dW, W_new (D, d)
        return 4 * (8 * m * D + 3 * D * d)
    grad = nbytes * D * d
    if spec.head == "softmax":
        return 2 * grad + 16 * min(m * D, 1 << 24) + 64 * m * d
    if spec.head == "logits_ce":  # logits, their float copy, softmax and its gradient
        return grad + (2 * nbytes + 12) * m * D
    if spec.head == "hsoftmax":
        width = head.max_cluster if head is not None else math.isqrt(D) * 4
        return grad + 4 * nbytes * m * width * d + 16 * m * width
    if spec.head == "adaptive":
        return grad + 12 * m * D
    return 2 * grad + 64 * m * d  # sampled


# --- building heads -------------------------------------------------------------------------

def loss_settings(loss: str, num_classes: int) -> tuple[float, dict]:
    """(head lr, loss kwargs) as the app trains with them: the loss's own default lr (the
    app builds the head without one: ``SphericalLoss.default_lr``) and the kwargs of
    ``conf/loss/<loss>.yaml``. A step's cost depends on how often the head's repairs run,
    and so on the lr. A config that cannot be read stops the run: other settings would
    time another step."""
    path = Path(config_dir()) / "loss" / f"{loss}.yaml"
    cfg = yaml.safe_load(path.read_text())
    if not isinstance(cfg, dict) or not isinstance(cfg.get("kwargs", {}), dict):
        raise ValueError(f"{path}: no usable kwargs ({cfg!r})")
    return float(LOSSES[loss].default_lr_for(num_classes)), dict(cfg.get("kwargs") or {})


def build(spec: HeadSpec, D: int, d: int, dtype: torch.dtype, device: torch.device):
    """(module, make(batches) -> step) for one head; raises ImportError when an optional package is missing."""
    if spec.key == ("softmax", "torch") and not hasattr(F, "linear_cross_entropy"):
        # SoftmaxHead would run unfused logits here: that is the logits_ce row, not this one
        # (bench_whole_step.py times the app's SoftmaxHead as it runs on this torch).
        raise ImportError(f"F.linear_cross_entropy: new in torch 2.13, this is torch {torch.__version__}")
    module, loss_of = _build(spec, D, d, dtype, device)
    # train_step returns dL/dH itself, outside autograd: it takes plain tensors.
    plain = lambda batches: [(H.detach(), y) for H, y in batches]  # noqa: E731
    if spec.head == "factored_sync":
        return module, lambda batches: cycle(plain(batches), lambda H, y: module.train_step(H, y))
    if spec.head == "factored_graph":
        def make(batches):
            graphed = CudaGraphStep(module, m=batches[0][0].shape[0], K=1, hidden_dtype=batches[0][0].dtype)
            return cycle(plain(batches), lambda H, y: graphed(H, y))
        return module, make
    return module, lambda batches: make_step(module, loss_of, spec.self_updating, batches)


def app_head_kwargs(loss: str) -> dict:
    """What lst-train gives the factored head besides its loss: with a sampled loss (its
    default head) the negatives and the right preconditioner on, at their settings for D."""
    return {"negatives": {}, "preconditioner": {}} if LOSSES[loss].sampled else {}


def _build(spec: HeadSpec, D: int, d: int, dtype: torch.dtype, device: torch.device):
    kw = dict(num_classes=D, hidden_dim=d, device=device)
    if spec.head in (*FACTORED, "naive"):
        cls = NaiveSphericalHead if spec.head == "naive" else FactoredSphericalHead
        if spec.head in ("factored_sync", "factored_graph"):
            kw["sync_every"] = SYNC_EVERY
        lr, loss_kwargs = loss_settings(spec.variant, D)
        kw.update(loss=spec.variant, loss_kwargs=loss_kwargs, lr=lr, bias=False)
        kw.update(app_head_kwargs(spec.variant))
        head = cls(**kw)  # draws its D x d matrix on the device itself
        return head, head
    kw["dtype"] = dtype
    if spec.head in ("softmax", "logits_ce"):
        head = SoftmaxHead(impl=spec.variant, bias=False, **kw)
        if spec.head == "logits_ce":
            return head, lambda H, y: F.cross_entropy(head.scores(H).float(), y)
        return head, head
    variant, sparse = spec.variant.removesuffix(SPARSE), spec.variant.endswith(SPARSE)
    if spec.head == "hsoftmax":
        head = HierarchicalSoftmaxHead(class_counts=zipf_counts(D), binning=variant, bias=False, sparse=sparse, **kw)
    elif spec.head == "adaptive":
        head = AdaptiveSoftmaxHead(cutoffs=[float(c) for c in spec.variant.split(",")], div_value=4.0, **kw)
    elif spec.head == "sampled":
        head = SampledSoftmaxHead(sampler=variant, bias=False, sparse=sparse, **kw)
    else:
        raise ValueError(f"unknown head {spec.head!r}")
    return head, head


def free_memory(device: torch.device, collect: bool = False) -> None:
    """Hand cached GPU memory back; ``collect``: first free what only cycles hold (0.1 s)."""
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def cycle(batches: list, fn: Callable) -> Callable[[], None]:
    """``fn(H, y)`` over the next of a few fixed batches, one per call."""
    state = {"i": 0}

    def step():
        H, y = batches[state["i"] % len(batches)]
        state["i"] += 1
        fn(H, y)
    return step


def make_step(module, loss_of, self_updating: bool, batches: list) -> Callable[[], None]:
    """One training step: loss, backward (self-updating heads update there), else an SGD step."""
    opt = None if self_updating else torch.optim.SGD(module.parameters(), lr=LR)

    def one(H, y):
        loss_of(H, y).backward()
        H.grad = None  # the body's gradient, made and dropped
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return cycle(batches, one)


def make_batches(D: int, d: int, m: int, dtype: torch.dtype, device: torch.device, n: int = 4) -> list:
    g = torch.Generator().manual_seed(D + d + m)
    return [(torch.randn(m, d, generator=g).to(device, dtype).requires_grad_(),
             zipf_targets(m, D, g).to(device)) for _ in range(n)]


# --- timing ---------------------------------------------------------------------------------

@dataclass
class TimingOptions:
    warmup: int
    budget_s: float      # timed seconds per head and size, about
    min_steps: int
    max_steps: int
    max_step_s: float    # a step slower than this is timed once and not repeated


def measure(steps: dict[str, Callable[[], None]], clock, opt: TimingOptions) -> dict[str, list[float]]:
    """Seconds of each timed step of each function, in alternation; a function whose first
    two steps exceed ``max_step_s`` keeps its second timing (the first call of a step may
    compile: Triton's autotuning in Liger-Kernel and cut-cross-entropy, a CUDA graph's capture)."""
    first = {k: clock(fn) for k, fn in steps.items()}
    first = {k: clock(steps[k]) if t > opt.max_step_s else t for k, t in first.items()}
    out = {k: [t] for k, t in first.items() if t > opt.max_step_s}
    live = {k: fn for k, fn in steps.items() if k not in out}
    if not live:
        return out
    # Steps over a second need no more warming up, and their first timing is estimate enough.
    warm = {k: fn for k, fn in live.items() if first[k] <= 1.0}
    for _ in range(opt.warmup - 1):
        for fn in warm.values():
            fn()
    est = {k: clock(fn) if k in warm else first[k] for k, fn in live.items()}
    n = {k: min(opt.max_steps, max(opt.min_steps, int(opt.budget_s / max(t, 1e-7) / len(live))))
         for k, t in est.items()}
    rounds = min(n.values())
    out.update(interleaved_times({k: (fn, max(1, n[k] // rounds)) for k, fn in live.items()}, rounds,
                                 warmup=0, clock=clock))
    return out


def peak_extra_mb(step: Callable[[], None], device: torch.device) -> float | None:
    """GPU memory one step takes beyond what was allocated before it (parameters, batches)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


# --- the run --------------------------------------------------------------------------------

def memory_limit(device: torch.device, max_gb: float | None) -> float:
    """Bytes a head may take now."""
    if device.type == "cuda":
        free_memory(device)
        free = 0.92 * torch.cuda.mem_get_info(device)[0]
        return free if max_gb is None else min(free, max_gb * 2**30)
    if max_gb is not None:
        return max_gb * 2**30
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable"):
                return 0.5 * int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


class Runner:
    def __init__(self, args, device: torch.device, console: Console):
        self.args, self.device, self.console = args, device, console
        self.cuda = device.type == "cuda"
        self.timing = TimingOptions(args.warmup, args.budget_s, args.min_steps, args.max_steps, args.max_step_s)
        self.rows: list[dict] = []
        self.t0 = time.perf_counter()
        self.common = dict(machine=machine_name(), torch=torch.__version__, threads=torch.get_num_threads())

    def timing_for(self, device: torch.device) -> tuple[Callable, TimingOptions]:
        """The clock and step counts for a head on ``device``: the naive head on the host in a
        GPU run (the paper's CPU figure) takes seconds a step, so a few steps do."""
        if device.type == "cuda":
            return cuda_clock, self.timing
        if self.cuda:
            return perf_clock, TimingOptions(warmup=1, budget_s=5.0, min_steps=2, max_steps=5, max_step_s=60.0)
        return perf_clock, self.timing

    def out_of_time(self) -> bool:
        return self.args.deadline_s is not None and time.perf_counter() - self.t0 > self.args.deadline_s

    def record(self, spec: HeadSpec, device: torch.device, dtype: str, D: int, d: int, m: int, status: str,
               times: list[float] | None = None, extra_mb: float | None = None, param_mb: float | None = None):
        ms = [1e3 * t for t in times or []]
        row = dict(self.common, device=device.type, head=spec.head, variant=spec.variant, dtype=dtype, D=D, d=d,
                   m=m, median_ms=round(statistics.median(ms), 5) if ms else "",
                   p10_ms=round(quantile(ms, 0.1), 5) if ms else "", p90_ms=round(quantile(ms, 0.9), 5) if ms else "",
                   steps=len(ms), peak_extra_mb="" if extra_mb is None else round(extra_mb, 2),
                   param_mb="" if param_mb is None else round(param_mb, 1), status=status)
        self.rows.append(row)
        shown = f"{row['median_ms']:.4g} ms" if ms else ""
        self.console.print(f"{device.type} {label(row):28s} D={D:>11,} d={d:4d} m={m:5d}  {shown:>12s}  {status}"
                           + (f"  +{row['peak_extra_mb']} MB" if extra_mb is not None else ""))
        return row

    def too_slow(self, spec: HeadSpec, device, D: int, d: int, m: int) -> str | None:
        """A reason to skip when this head, timed at a smaller D, would pass ``max_step_s`` here."""
        for r in reversed(self.rows):
            if ((r["head"], r["variant"], r["device"], r["d"], r["m"]) == (*spec.key, device.type, d, m)
                    and r["median_ms"] != "" and r["D"] < D):
                guess = r["median_ms"] / 1e3 * D / r["D"]
                # linear in D: the heads that score every class (the others' cost grows slower)
                if spec.head in LINEAR_IN_D and guess > self.args.max_step_s:
                    return (f"skipped: ~{guess:.3g} s/step (from {r['median_ms']:.4g} ms at D={r['D']:,}) "
                            f"> --max-step-s {self.args.max_step_s}")
                return None
        return None

    def run_head(self, spec: HeadSpec, D: int, d: int, ms: Iterable[int], device: torch.device,
                 dtype_name: str, partner=None) -> None:
        """Build one head at (D, d) and time it at each m, alongside ``partner`` (on CPU: the
        factored head, so that load falls on both alike)."""
        dtype = torch.float32 if spec.head in (*FACTORED, "naive") else DTYPES[dtype_name]
        dname = "fp32" if dtype == torch.float32 else dtype_name
        nbytes = torch.finfo(dtype).bits // 8
        ms = list(ms)

        def skip_all(status):
            for m in ms:
                self.record(spec, device, dname, D, d, m, status)

        if self.out_of_time():
            return skip_all(f"skipped: out of time (--deadline-s {self.args.deadline_s})")
        if spec.cuda_only and device.type != "cuda":
            return skip_all("skipped: CUDA only")
        params = param_bytes(spec, D, d, nbytes)
        limit = memory_limit(device, self.args.max_gb) - (partner["params"] if partner else 0)
        need = {m: params + step_bytes(spec, D, d, m, nbytes) for m in ms}
        if min(need.values()) > limit:
            return skip_all(f"skipped: needs ~{min(need.values()) / 2**30:.3g} GB > {limit / 2**30:.3g} GB available")
        if spec.key == ("softmax", "cce") and device.type == "cuda" and D * d > CCE_MAX_ELEMENTS:
            # the head refuses it at its first step (baselines/softmax.py): said here before building
            return skip_all(f"skipped: cut-cross-entropy takes at most 2^31 - 1 weight elements (D x d = {D * d:.3g})")
        slow = {m: self.too_slow(spec, device, D, d, m) for m in ms}
        if all(slow.values()):
            return skip_all(slow[ms[0]])
        head = None
        try:
            free_memory(device)
            head, make = build(spec, D, d, dtype, device)
            param_mb = sum(t.numel() * t.element_size() for t in [*head.parameters(), *head.buffers()]) / 2**20
            for m in ms:
                if slow[m]:
                    self.record(spec, device, dname, D, d, m, slow[m])
                    continue
                if self.out_of_time():
                    self.record(spec, device, dname, D, d, m, f"skipped: out of time (--deadline-s {self.args.deadline_s})")
                    continue
                need_m = params + step_bytes(spec, D, d, m, nbytes, head)
                if need_m > limit:
                    self.record(spec, device, dname, D, d, m,
                                f"skipped: needs ~{need_m / 2**30:.3g} GB > {limit / 2**30:.3g} GB available")
                    continue
                self.time_one(spec, make, D, d, m, dtype, dname, device, param_mb, partner)
        except ImportError as exc:
            skip_all(f"not installed: {str(exc).split(' (')[0]}")
        except torch.cuda.OutOfMemoryError as exc:
            skip_all(f"oom while building: {str(exc).splitlines()[0][:80]}")
        except (RuntimeError, ValueError, TypeError, AttributeError, NotImplementedError) as exc:
            skip_all(f"error while building: {type(exc).__name__}: {' '.join(str(exc).split())[:120]}")
        finally:
            del head
            free_memory(device, collect=device.type == "cuda")

    def time_one(self, spec, make, D, d, m, dtype, dname, device, param_mb, partner) -> None:
        batches = None
        try:
            batches = make_batches(D, d, m, dtype, device)
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            step = make(batches)
            # What the step keeps between calls (a CUDA graph's pool) counts as its memory too.
            kept_mb = (torch.cuda.memory_allocated(device) - before) / 2**20 if device.type == "cuda" else 0.0
            steps = {"this": step}
            if partner is not None:
                steps["partner"] = partner["steps"][m]
            clock, topt = self.timing_for(device)
            times = measure(steps, clock, topt)
            if partner is not None:
                partner["times"][m] += times["partner"]
            extra = peak_extra_mb(step, device) if len(times["this"]) > 1 else None
            extra = None if extra is None else extra + kept_mb
            status = "ok" if len(times["this"]) >= topt.min_steps else \
                f"slow: {len(times['this'])} step(s) > --max-step-s {topt.max_step_s}"
            self.record(spec, device, dname, D, d, m, status, times["this"], extra, param_mb)
        except torch.cuda.OutOfMemoryError as exc:
            self.record(spec, device, dname, D, d, m, f"oom: {str(exc).splitlines()[0][:80]}")
        except (RuntimeError, ValueError, TypeError, AttributeError, NotImplementedError) as exc:
            msg = " ".join(str(exc).split())[:120]
            self.record(spec, device, dname, D, d, m, f"error: {type(exc).__name__}: {msg}")
        finally:
            del batches
            free_memory(device)

    def run_size(self, D: int, d: int, ms: list[int], heads: list[HeadSpec]) -> None:
        """Every head at (D, d) and each m. On CPU each head is timed alongside the factored
        (zloss) head, whose row pools its timings from all pairings."""
        dev, bf = self.device, self.args.dtype
        ref_need = max(param_bytes(HEADS[0], D, d, 4) + step_bytes(HEADS[0], D, d, m, 4) for m in ms)
        if (self.cuda or not self.args.interleave or REFERENCE not in {s.key for s in heads}
                or ref_need > memory_limit(dev, self.args.max_gb)):
            for spec in heads:
                self.run_head(spec, D, d, ms, dev, bf)
            return
        ref = next(s for s in heads if s.key == REFERENCE)
        fac, make = build(ref, D, d, torch.float32, dev)
        partner = {"params": param_bytes(ref, D, d, 4), "times": {m: [] for m in ms},
                   "steps": {m: make(make_batches(D, d, m, torch.float32, dev)) for m in ms}}
        others = [s for s in heads if s.key != REFERENCE]
        for spec in others:
            self.run_head(spec, D, d, ms, dev, bf, partner)
        for m in ms:  # nothing timed beside it at this m: time it alone
            if not partner["times"][m]:
                partner["times"][m] = measure({"f": partner["steps"][m]}, *self.timing_for(dev))["f"]
        pmb = param_bytes(ref, D, d, 4) / 2**20
        for m in ms:
            self.record(ref, dev, "fp32", D, d, m, "ok", partner["times"][m], None, pmb)
        del fac, partner

    def paper_naive_cpu(self) -> None:
        """The naive head on the host at the paper's size, for its GPU-vs-CPU headline."""
        spec = next(s for s in HEADS if s.key == ("naive", "zloss"))
        self.run_head(spec, PAPER["D"], PAPER["d"], [PAPER["m"]], torch.device("cpu"), "fp32")


# --- ratios, target checks, reports ---------------------------------------------------------

def _ok(r: dict) -> bool:
    return r["median_ms"] not in ("", None) and str(r["status"]).split(":")[0] in ("ok", "slow")


def _find(rows, device=None, **want):
    for r in rows:
        if _ok(r) and (device is None or r["device"] == device) and all(r[k] == v for k, v in want.items()):
            return r
    return None


def speedups(rows: list[dict]) -> list[dict]:
    """How many times longer each other head's step takes than the factored (zloss) step,
    at the same device and size."""
    out = []
    for ref in (r for r in rows if _ok(r) and (r["head"], r["variant"]) == REFERENCE):
        for r in rows:
            if (_ok(r) and r is not ref and (r["device"], r["D"], r["d"], r["m"]) ==
                    (ref["device"], ref["D"], ref["d"], ref["m"])):
                out.append(dict(device=r["device"], D=r["D"], d=r["d"], m=r["m"], head=label(r),
                                ratio=float(r["median_ms"]) / float(ref["median_ms"])))
    return out


def fastest_factored(rows: list[dict], head: str | None = None, **at) -> dict | None:
    """The fastest measured GPU step of the factored head (zloss) at a size, over its paths
    (plain autograd, ``train_step`` without host reads, CUDA graph) or of one path."""
    found = [r for h in ((head,) if head else FACTORED) if (r := _find(rows, "cuda", head=h, variant="zloss", **at))]
    return min(found, key=lambda r: float(r["median_ms"])) if found else None


def target_checks(rows: list[dict]) -> list[dict]:
    """The issue's targets (on a GPU) and the paper's headline, each PASS / FAIL / UNMEASURED.
    The factored step is its fastest path at each size (named in the value)."""
    T, P = TARGET, PAPER
    at = dict(D=T["D"], d=T["d"], m=T["m"])
    fac = fastest_factored(rows, **at)
    path = f" ({fac['head']})" if fac else ""
    checks = []

    def add(name, ok, value):
        checks.append(dict(check=name, status="UNMEASURED" if ok is None else ("PASS" if ok else "FAIL"),
                           value=value))

    where = f"D={T['D']:,}, d={T['d']}, m={T['m']}"
    ms = float(fac["median_ms"]) if fac else None
    add(f"factored (zloss) step <= {T['max_ms']} ms on the GPU at {where}",
        None if ms is None else ms <= T["max_ms"], "" if ms is None else f"{ms:.4g} ms{path}")
    lce = _find(rows, "cuda", head="softmax", variant="torch", dtype="bf16", **at)
    ratio = float(lce["median_ms"]) / ms if lce and ms else None
    add(f">= {T['vs_lce_bf16']:g}x faster than F.linear_cross_entropy in bf16 at {where}",
        None if ratio is None else ratio >= T["vs_lce_bf16"], "" if ratio is None else f"{ratio:.1f}x{path}")
    fused = [r for v in ("liger", "cce") if (r := _find(rows, "cuda", head="softmax", variant=v, **at))]
    best = min(fused, key=lambda r: float(r["median_ms"])) if fused else None
    ratio = float(best["median_ms"]) / ms if best and ms else None
    add(f">= {T['vs_fused']:g}x faster than the faster of Liger-Kernel and cut-cross-entropy at {where}",
        None if ratio is None else ratio >= T["vs_fused"],
        "" if ratio is None else f"{ratio:.1f}x (vs {best['variant']} {best['dtype']}){path}")
    mb = fac["peak_extra_mb"] if fac else ""
    add(f"factored step takes <= {T['max_extra_mb']:g} MB beyond the parameters at {where}",
        None if mb in ("", None) else float(mb) <= T["max_extra_mb"],
        "" if mb in ("", None) else f"{float(mb):.1f} MB{path}")
    for d in sorted({r["d"] for r in rows}, reverse=True):
        for m in sorted({r["m"] for r in rows}, reverse=True):
            # One path at both ends: the fastest at the far end.
            hi = fastest_factored(rows, D=T["flat_hi"], d=d, m=m)
            lo = fastest_factored(rows, hi["head"], D=T["flat_lo"], d=d, m=m) if hi else None
            if (d, m) != (T["d"], T["m"]) and not (lo and hi):
                continue
            r = float(hi["median_ms"]) / float(lo["median_ms"]) if lo and hi else None
            add(f"flat in D: step at D={T['flat_hi']:,} within {T['flat_tol']:.0%} of D={T['flat_lo']:,} "
                f"(d={d}, m={m})", None if r is None else r <= 1 + T["flat_tol"],
                "" if r is None else f"{r:.3f}x ({hi['head']})")
    at = dict(D=P["D"], d=P["d"], m=P["m"])
    fac = fastest_factored(rows, **at)
    for dev, key in (("cpu", "vs_naive_cpu"), ("cuda", "vs_naive_gpu")):
        naive = _find(rows, dev, head="naive", variant="zloss", **at)
        r = float(naive["median_ms"]) / float(fac["median_ms"]) if fac and naive else None
        add(f"paper: GPU factored vs naive on {'CPU' if dev == 'cpu' else 'GPU'} at D={P['D']:,}, d={P['d']}, "
            f"m={P['m']} (paper {P[key]:g}x)", None if r is None else r >= P[key],
            "" if r is None else f"{r:.0f}x ({fac['head']})")
    return checks


def markdown(rows: list[dict], checks: list[dict], title: str) -> str:
    lines = [f"# {title}", "", "Median step (forward + backward + update), ms; '-' = not measured (see the CSV's "
             "status column).", ""]
    for dev, d, m in sorted({(r["device"], r["d"], r["m"]) for r in rows}, key=lambda k: (k[0], -k[1], -k[2])):
        sub = [r for r in rows if (r["device"], r["d"], r["m"]) == (dev, d, m)]
        Ds = {D: f"D={D:,}" for D in sorted({r["D"] for r in sub})}
        labs = sorted(dict.fromkeys(label(r) for r in sub), key=lambda lab: not lab.startswith("factored/zloss"))
        table, unmeasured = [], []
        for lab in labs:
            mine = [r for r in sub if label(r) == lab]
            if not any(_ok(r) for r in mine):  # listed below the table with its reason instead
                unmeasured.append(f"{lab} ({mine[0]['status']})")
                continue
            cells = {"head": lab}
            for D, col in Ds.items():
                r = next((r for r in mine if r["D"] == D), None)
                cells[col] = f"{float(r['median_ms']):.4g}" if r is not None and _ok(r) else "-"
            table.append(cells)
        lines += [f"## {dev}, d = {d}, m = {m}", "", markdown_table(table, ["head", *Ds.values()], Ds.values())]
        if unmeasured:
            lines += ["", "Not measured here: " + "; ".join(unmeasured) + "."]
        lines.append("")
    lines += ["## Targets", "", markdown_table([dict(c, result=c["status"]) for c in checks],
                                               ["check", "result", "value"])]
    sp = [dict(s, D=f"{s['D']:,}", ratio=f"{s['ratio']:.3g}x") for s in speedups(rows)]
    if sp:
        lines += ["", "## Step time of each head / the factored (zloss) step, same run", "",
                  markdown_table(sp, ["device", "D", "d", "m", "head", "ratio"], ["D", "d", "m", "ratio"])]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str) -> Path:
    main_dev = "cuda" if any(r["device"] == "cuda" for r in rows) else "cpu"
    good = [r for r in rows if _ok(r) and r["device"] == main_dev]
    panels = sorted({(r["d"], r["m"]) for r in rows if r["device"] == main_dev}, key=lambda k: (-k[0], -k[1]))
    width = 5.0 * max(1, len(panels)) + 3.2  # the legend takes 3.2 inches on the right
    fig, axes = pyplot().subplots(1, max(1, len(panels)), figsize=(width, 4.6), squeeze=False, sharey=True)
    for ax, (d, m) in zip(axes[0], panels):
        for lab in dict.fromkeys(label(r) for r in good):
            pts = sorted((r["D"], float(r["median_ms"])) for r in good if label(r) == lab and (r["d"], r["m"]) == (d, m))
            if pts:
                style = "-o" if lab.startswith("factored/zloss") else ("--" if lab.startswith("factored") else "-")
                ax.plot(*zip(*pts), style, label=lab, ms=4)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("classes D")
        ax.set_title(f"d = {d}, m = {m}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel(f"training step on {main_dev} (ms)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if handles:
        fig.legend(handles, labels, loc="center right", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1 - 3.2 / width, 1))
    return save_figure(fig, path, dpi=110)


def write_outputs(rows: list[dict], stem: Path, title: str, with_plot: bool = True, with_csv: bool = True
                  ) -> list[dict]:
    """The CSV, the markdown (tables, target checks, ratios) and the plot, at ``stem``.{csv,md,png}."""
    if with_csv:
        write_csv(stem.with_suffix(".csv"), rows, COLUMNS)
    checks = target_checks(rows)
    stem.with_suffix(".md").write_text(markdown(rows, checks, title))
    if with_plot:
        plot(rows, stem.with_suffix(".png"), title)
    return checks


def read_rows(path: Path) -> list[dict]:
    """A CSV written by this benchmark, sizes as ints (as the run holds them)."""
    with path.open(newline="") as fh:
        return [dict(r, D=int(r["D"]), d=int(r["d"]), m=int(r["m"])) for r in csv.DictReader(fh)]


def title_of(rows: list[dict]) -> str:
    r = rows[0]
    return (f"Output-head training step, {r['machine']} ({r['device']}), torch {r['torch']}, "
            f"{r['threads']} CPU threads")


def print_summary(rows: list[dict], checks: list[dict], console: Console) -> None:
    t = Table(title="Step time of each head / the factored (zloss) step, measured side by side in this run")
    for col in ("device", "D", "d", "m", "head", "ratio"):
        t.add_column(col, justify="left" if col in ("device", "head") else "right")
    for s in speedups(rows):
        t.add_row(s["device"], f"{s['D']:,}", str(s["d"]), str(s["m"]), s["head"], f"{s['ratio']:.3g}x")
    console.print(t)
    colour = {"PASS": "green", "FAIL": "red", "UNMEASURED": "yellow"}
    for c in checks:
        console.print(f"[{colour[c['status']]}]{c['status']:10s}[/] {c['check']}" + (f": {c['value']}" if c["value"] else ""))


def parse_ints(text: str) -> list[int]:
    try:
        out = [int(float(x)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def size_order(Ds: list[int], ds: list[int]) -> list[tuple[int, int]]:
    """(D, d) in the order they are timed: the targets' d first, every D of it (up to the
    flatness pair's 2 x 10^7), then the other d (the paper's 300) up to 2M, the paper's D
    first, their larger D last: a run cut short by --deadline-s still has the targets and
    the paper's headline."""
    first = TARGET["d"] if TARGET["d"] in ds else ds[0]
    return sorted(((D, d) for d in ds for D in Ds),
                  key=lambda k: (k[1] != first, k[0] > 2_000_000, ds.index(k[1]),
                                 k[1] != first and k[0] != PAPER["D"], k[0]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="every code path at tiny sizes in seconds (tests)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is there")
    p.add_argument("--sweep-d", action="store_true",
                   help="d = 512, 1024, 2048, 4096 (m = 1024, D = 10^5 and 10^6): the default factored step against "
                        "F.linear_cross_entropy and cut-cross-entropy in bf16")
    p.add_argument("--D", type=parse_ints, help="class counts, e.g. 10000,100000 (default: by device)")
    p.add_argument("--d", type=parse_ints, help="hidden sizes")
    p.add_argument("--m", type=parse_ints, help="batch sizes")
    p.add_argument("--heads", default=None,
                   help="comma-separated head or head/variant names (default: all): " +
                        ",".join(f"{s.head}/{s.variant}" for s in HEADS))
    p.add_argument("--all-losses-up-to", type=int, default=2_000_000,
                   help="the factored head's other losses only up to this D (their step differs from zloss's "
                        "only in m-sized work); zloss runs at every D")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="dtype of the softmax-family baselines (default: bf16 on a GPU, fp32 on CPU); "
                        "the spherical heads keep float32 state")
    p.add_argument("--max-gb", type=float, default=None,
                   help="memory a head may use (default: 92%% of free GPU memory; on CPU half of MemAvailable)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: 1 on CPU runs)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--budget-s", type=float, default=None, help="timed seconds per head and size")
    p.add_argument("--min-steps", type=int, default=None)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--max-step-s", type=float, default=None,
                   help="a step slower than this is timed once; larger D of that head are skipped")
    p.add_argument("--deadline-s", type=float, default=None, help="stop starting new heads after this long")
    p.add_argument("--no-interleave", dest="interleave", action="store_false",
                   help="on CPU, time heads alone rather than alongside the factored head")
    p.add_argument("--no-paper-cpu", dest="paper_cpu", action="store_false",
                   help="on a GPU, skip timing the naive head on the CPU at the paper's size")
    p.add_argument("--replot", type=existing_path, default=None, metavar="CSV",
                   help="measure nothing: remake the markdown and plot of a CSV of an earlier run (written "
                        "with a copy of the CSV into the output folder)")
    add_output_args(p)
    args = p.parse_args(argv)
    if args.replot is not None:
        rows = read_rows(args.replot)
        stem = output_dir(args, "bench_heads") / args.replot.stem
        if not stem.with_suffix(".csv").exists() or not stem.with_suffix(".csv").samefile(args.replot):
            shutil.copyfile(args.replot, stem.with_suffix(".csv"))
        checks = write_outputs(rows, stem, title_of(rows), with_csv=False)
        print_summary(rows, checks, Console(soft_wrap=True))
        wrote(*(stem.with_suffix(s) for s in (".csv", ".md", ".png")))
        return 0

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    sizes = (SWEEP["smoke" if args.smoke else "full"] if args.sweep_d
             else SIZES["smoke" if args.smoke else ("gpu" if cuda else "cpu")])
    Ds, ds, ms = args.D or sizes["D"], args.d or sizes["d"], args.m or sizes["m"]
    defaults = dict(dtype="bf16" if cuda else "fp32", threads=None if cuda else 1,
                    warmup=3 if cuda else 1, budget_s=0.25 if cuda else 2.0, min_steps=5 if cuda else 3,
                    max_steps=200 if cuda else 50, max_step_s=2.0 if cuda else 60.0)
    if args.smoke:
        defaults.update(warmup=1, budget_s=0.01, min_steps=2, max_steps=3)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.threads:
        torch.set_num_threads(args.threads)
    heads = HEADS
    if args.sweep_d and not args.heads:
        heads = [s for s in HEADS if f"{s.head}/{s.variant}" in SWEEP_HEADS]
        if cuda:  # on a GPU the default's step as lst-train runs it there: from its CUDA graph
            heads = [s for s in heads if s.key != ("factored", "sampled")]
    if args.heads:
        want = {h.strip() for h in args.heads.split(",") if h.strip()}
        unknown = want - {s.head for s in HEADS} - {f"{s.head}/{s.variant}" for s in HEADS}
        if unknown:
            p.error(f"unknown heads {sorted(unknown)}; choose from {[f'{s.head}/{s.variant}' for s in HEADS]}")
        heads = [s for s in HEADS if s.head in want or f"{s.head}/{s.variant}" in want]

    console = Console(soft_wrap=True)
    runner = Runner(args, device, console)
    machine = runner.common["machine"]
    kind = ("smoke_" if args.smoke else "") + ("dsweep_" if args.sweep_d else "")
    stem = output_dir(args, "bench_heads") / f"bench_heads_{kind}{machine}"
    title = title_of([dict(runner.common, machine=machine, device=device.type)])
    console.print(f"[bold]{title}[/bold]: D={Ds} d={ds} m={ms}, baselines in {args.dtype}")
    if cuda and args.paper_cpu and any(s.key == ("naive", "zloss") for s in heads):
        Dp = PAPER["D"] if not args.smoke else Ds[0]
        if args.smoke:
            spec = next(s for s in HEADS if s.key == ("naive", "zloss"))
            runner.run_head(spec, Dp, ds[0], [ms[0]], torch.device("cpu"), "fp32")
        else:
            runner.paper_naive_cpu()
    for D, d in size_order(Ds, ds):
        here = [s for s in heads if s.head not in FACTORED or s.variant == "zloss" or D <= args.all_losses_up_to]
        runner.run_size(D, d, ms, here)
        write_outputs(runner.rows, stem, title, with_plot=False)
    checks = write_outputs(runner.rows, stem, title)
    print_summary(runner.rows, checks, console)
    console.print(f"{time.perf_counter() - runner.t0:.0f} s")
    wrote(*(stem.with_suffix(s) for s in (".csv", ".md", ".png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
