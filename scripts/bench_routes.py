"""Every multi-process route on two gloo processes (CPU, one machine): bytes each rank
sends per training step and time per step, at each D.

    uv run --all-extras python scripts/bench_routes.py --D 10000 1000000

Routes (``--routes``), each with the factored head ``replicated`` and ``sharded``
(``--heads``), each job started by ``torchrun --standalone --nproc_per_node 2``:

- ``lst_ddp``: ``lst-train trainer=ddp_cpu trainer.strategy=ddp`` (``ddp_cpu``'s spawned
  workers refuse a sharded head), the n-gram MLP body on the synthetic task with D classes;
  its row-sparse input embedding averaged by app/sparse_exchange.py;
- ``lst_fsdp2``: ``lst-train trainer=fsdp2_cpu`` (the body sharded by FSDP2, app/fsdp_body.py);
- ``hf_ddp``: scripts/examples/hf_trainer_ddp.py's HF Trainer (a 2-layer Llama, vocabulary D);
- ``litgpt_ddp``, ``litgpt_fsdp2``: litgpt's GPT (2 layers, vocabulary D) in a Fabric loop of
  litgpt's shape, Fabric's DDP and its ModelParallelStrategy with each block an FSDP2 unit.

Every route's head sees ``--rows`` rows per rank per step (lst-train: the batch; HF and
litgpt: ``rows / --seq-len`` sequences), hidden size ``--d``. A meter in the job (a Lightning
callback, an HF TrainerCallback, a line of the Fabric loop) notes, at the start of training
and after every optimizer step, the wall clock and the loopback interface's byte counter
(``lo`` in /proc/net/dev: gloo on one machine talks TCP over loopback). After ``--warmup``
steps it takes ``--steps`` more: time per step is the median of those steps (the slower
rank's), bytes per rank per step the counter's growth over them / steps / 2 ranks: bytes
on the wire, TCP/IP framing included, torchrun's own store traffic too.

Two more columns say what the wire carries. ``head_bytes_per_step``: the factored head's
own exchange, counted exactly at its collectives (``CountingProcessGroup``, which the job
puts in the head's place of ``ProcessGroup``: the payload each rank sends, ideal algorithms;
it depends on the rows and d only, not on D). ``body_allreduce_bytes``: what a ring
all-reduce of the body's dense gradients sends per rank (DDP's exchange; the HF and litgpt
bodies' D x d input embedding is in it, lst-train's row-sparse one is not).

Each job runs in a network namespace of its own (``unshare -rn``), so that its ``lo``
counts only its own traffic (``--netns off``, or where unshare is refused: the machine's
``lo``, which other jobs' loopback traffic pollutes; then the counter is also read over an
idle interval as long as the timed steps after each job, ``idle_bytes_per_step``).

Writes bench_routes_<machine>.csv (one row per route x head x D), .md (the table) and .png
into a fresh run directory (``--out DIR``), each job's log and meter files under ``jobs/``
(``--update-results``: the three files into benchmarks/results/, the jobs' in a temporary
folder). ``--smoke``: tiny sizes; the processes' start-up dominates (~40 s a job on one loaded core).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# benchlib first: in a bare checkout it puts the package on the path.
from benchlib import (positive_int, add_output_args, machine_name, markdown_table, output_dir, pyplot, save_figure,
                      write_csv, wrote)

import lightning.pytorch as pl
from lst_lightning.app.optimizers import sparse_embedding_params
from lst_lightning.spherical import factored
from lst_lightning.distributed.collectives import ProcessGroup

ROUTES = ("lst_ddp", "lst_fsdp2", "hf_ddp", "litgpt_ddp", "litgpt_fsdp2")
HEADS = ("replicated", "sharded")
SCRIPTS = Path(__file__).resolve().parent
METER_ENV = "LST_ROUTE_METER"  # the job folder the meter writes into


# --- the meter, in the job ---------------------------------------------------------------

def loopback_bytes() -> int | None:
    """Bytes sent over the loopback interface so far (its transmit counter; on ``lo`` every
    byte sent is also received), or None where there is no /proc/net/dev."""
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[8])
    except OSError:
        pass
    return None


class CountingProcessGroup(ProcessGroup):
    """The factored head's process group, counting the bytes this rank sends at each of the
    head's collectives (distributed/collectives.py: every collective of the head's step, in
    multi_process.py, padded_rows.py and factored.py, is one of these methods): the payload only, no
    framing, as ideal algorithms on P ranks send it. An all-gather of n bytes per rank:
    (P - 1) n; a (ring) all-reduce of n bytes: 2 (P - 1) / P n; a broadcast of n bytes:
    (P - 1) / P n (the source's (P - 1) n, averaged over the ranks). So the count compares
    with the wire column (bytes sent per rank), and at P = 2 an all-reduce counts n.
    ``sent``: the total over every head of the process."""

    sent = 0

    @staticmethod
    def _add(n: int) -> None:
        CountingProcessGroup.sent += n  # the class's: the instances are frozen

    def all_reduce_(self, x):
        if self.world > 1:
            self._add(2 * (self.world - 1) * x.numel() * x.element_size() // self.world)
        return super().all_reduce_(x)

    def broadcast_(self, x, src: int = 0):
        if self.world > 1:
            self._add((self.world - 1) * x.numel() * x.element_size() // self.world)
        return super().broadcast_(x, src)

    def all_gather_ints(self, values, device=None):
        if self.world > 1:
            self._add((self.world - 1) * 8 * len(values))
        return super().all_gather_ints(values, device)

    def all_gather_objects(self, obj):
        if self.world > 1:  # this rank's pickle (the ranks' may differ; never on the hot path)
            self._add((self.world - 1) * len(pickle.dumps(obj)))
        return super().all_gather_objects(obj)

    def gather_fixed(self, x):
        if self.world > 1:
            self._add((self.world - 1) * x.numel() * x.element_size())
        return super().gather_fixed(x)

    def gather_ragged(self, tensors, fills):
        out, sizes = super().gather_ragged(tensors, fills)  # the counts: all_gather_ints above
        if self.world > 1:  # each tensor padded to the largest rank's rows
            row = sum(math.prod(t.shape[1:]) * t.element_size() for t in tensors)
            self._add((self.world - 1) * max(sizes) * row)
        return out, sizes


#: ProcessGroup's methods that send nothing themselves (they call the counted ones).
NOT_COUNTED = ("current", "gather_rows")


def count_head_collectives() -> None:
    """Every factored head that joins its processes from now on (``distribute()``, which makes
    its group with ``factored.ProcessGroup.current``) gets a ``CountingProcessGroup``: in the
    job, before the head is distributed."""
    factored.ProcessGroup = CountingProcessGroup


def dense_param_bytes(model) -> int:
    """Bytes of the model's trainable parameters that the body's strategy exchanges densely
    (global sizes, FSDP2's DTensors too): all but the row-sparse ones (a sparse input
    embedding: app/sparse_exchange.py sends the rows a step touched). The factored head has
    no parameters (its state is buffers)."""
    sparse = {id(p) for p in sparse_embedding_params(model)}
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and id(p) not in sparse)


class Marks:
    """The wall clock, the loopback counter and the head's count (``CountingProcessGroup.sent``)
    at the start of training and after each step, saved by every rank as
    ``meter_rank<r>.json`` in $LST_ROUTE_METER's folder with the body's dense parameter bytes."""

    def __init__(self):
        count_head_collectives()  # made before training: the head has not joined yet
        self.t: list[float] = []
        self.lo: list[int | None] = []
        self.head: list[int] = []

    def mark(self) -> None:
        self.t.append(time.perf_counter())
        self.lo.append(loopback_bytes())
        self.head.append(CountingProcessGroup.sent)

    def save(self, model, head) -> None:
        """``model``: the body and head (unwrapped); ``head``: the factored head."""
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        folder = Path(os.environ.get(METER_ENV, "."))
        counted = isinstance(head.processes.pg, CountingProcessGroup)  # not: joined before the meter was made
        (folder / f"meter_rank{rank}.json").write_text(json.dumps({
            "rank": rank, "world": world, "threads": torch.get_num_threads(), "t": self.t, "lo": self.lo,
            "head": self.head if counted else None, "body_param_bytes": dense_param_bytes(model),
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


class LightningMeter(pl.Callback):
    """``Marks`` for lst-train (``+callbacks.route_meter._target_=bench_routes.LightningMeter``)."""

    def __init__(self):
        self.marks = Marks()

    def on_train_start(self, trainer, pl_module):
        self.marks.mark()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.marks.mark()  # after the optimizer's step (one micro-batch per step here)

    def on_train_end(self, trainer, pl_module):
        self.marks.save(pl_module, pl_module.head)


# --- the workers the HF and litgpt routes run under torchrun -----------------------------

def hf_worker(a) -> None:
    """scripts/examples/hf_trainer_ddp.py's Trainer with the meter as one more callback."""
    sys.path.insert(0, str(SCRIPTS / "examples"))
    from hf_trainer_ddp import main as hf_main  # noqa: PLC0415
    from transformers import TrainerCallback  # noqa: PLC0415

    from lst_lightning.integrations import factored_head  # noqa: PLC0415

    class HFMeter(TrainerCallback):
        def __init__(self):
            self.marks = Marks()

        def on_train_begin(self, args, state, control, **kw):
            self.marks.mark()

        def on_step_end(self, args, state, control, **kw):
            self.marks.mark()

        def on_train_end(self, args, state, control, model=None, **kw):
            self.marks.save(model, factored_head(model))

    hf_main(["--out", a.job_dir, "--parallel", a.parallel, "--steps", str(a.total_steps), "--save-steps", "0",
             "--batch-size", str(max(1, a.rows // a.seq_len)), "--vocab", str(a.D), "--hidden", str(a.d),
             "--seq-len", str(a.seq_len)], callbacks=[HFMeter()])


def litgpt_worker(a) -> None:
    """litgpt's GPT (``a.D`` tokens, hidden ``a.d``, 2 layers) with the factored head, AdamW,
    ``a.total_steps`` steps of a Fabric loop of litgpt's shape (DDP, or FSDP2 per block)."""
    import lightning as L  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from litgpt import GPT, Config  # noqa: PLC0415

    from lst_lightning.integrations import factor_gpt_head, factored_head  # noqa: PLC0415

    torch.set_num_threads(a.threads)
    marks = Marks()  # before the head is made and joins the processes: its collectives counted
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.worker == "litgpt_fsdp2":
        from lightning.fabric.strategies import ModelParallelStrategy  # noqa: PLC0415

        def shard_blocks(model, device_mesh):
            from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

            for block in model.transformer.h:
                fully_shard(block, mesh=device_mesh)
            fully_shard(model, mesh=device_mesh)
            return model

        strategy = ModelParallelStrategy(shard_blocks, data_parallel_size=world, tensor_parallel_size=1)
    else:
        strategy = "ddp"
    fabric = L.Fabric(accelerator="cpu", devices=world, precision="32-true", strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    config = Config(name="bench", block_size=max(64, a.seq_len), vocab_size=a.D, padded_vocab_size=a.D, n_layer=2,
                    n_head=2, n_embd=a.d, rotary_percentage=1.0, parallel_residual=False, bias=False,
                    norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=2 * a.d)
    with fabric.init_module():
        model = factor_gpt_head(GPT(config), loss="zloss", lr=0.5, parallel=a.parallel)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    head = factored_head(getattr(model, "module", model))
    head.attach(optimizer)
    g = torch.Generator().manual_seed(1 + fabric.global_rank)
    seqs = max(1, a.rows // a.seq_len)
    marks.mark()
    for _ in range(a.total_steps):
        data = torch.randint(0, a.D, (seqs, a.seq_len + 1), generator=g)
        loss = model(data[:, :-1], targets=data[:, 1:])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        marks.mark()
    head.detach()
    marks.save(getattr(model, "module", model), head)


# --- the jobs, launched from here --------------------------------------------------------

def lst_train_args(route: str, head: str, D: int, a, job_dir: Path) -> list[str]:
    trainer = ["trainer=ddp_cpu", "trainer.strategy=ddp"] if route == "lst_ddp" else ["trainer=fsdp2_cpu"]
    return ["-m", "lst_lightning.app.train", "head=factored", f"head.parallel={head}", "model=ngram_mlp",
            f"model.hidden_dim={a.d}", f"model.embed_dim={a.embed_dim}", f"model.hidden_sizes=[{2 * a.d}]",
            "data=synthetic", f"data.num_classes={D}", f"data.batch_size={a.rows}",
            f"data.input_vocab_size={a.input_vocab}", f"data.train_size={4 * a.rows * (a.warmup + a.steps)}",
            *trainer, f"trainer.max_steps={a.warmup + a.steps}", "trainer.max_epochs=-1",
            "trainer.limit_train_batches=null", "trainer.limit_val_batches=0", "test=false",
            "callbacks=minimal", "~callbacks.checkpoint", "logger=csv",
            f"cpu_threads={a.threads}", "+callbacks.route_meter._target_=bench_routes.LightningMeter",
            f"hydra.run.dir={job_dir / 'run'}"]


def job_command(route: str, head: str, D: int, a, job_dir: Path) -> list[str]:
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", str(a.world)]
    if route.startswith("lst_"):
        return [*torchrun, *lst_train_args(route, head, D, a, job_dir)]
    # the worker's settings in a file: torchrun's parser would take --d for its own options' prefix
    worker = {"worker": route, "parallel": head, "D": D, "d": a.d, "rows": a.rows, "seq_len": a.seq_len,
              "threads": a.threads, "total_steps": a.warmup + a.steps, "job_dir": str(job_dir)}
    (job_dir / "worker.json").write_text(json.dumps(worker))
    return [*torchrun, str(Path(__file__).resolve()), "--worker", str(job_dir / "worker.json")]


NETNS = ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]


def netns_works() -> bool:
    """Whether a job can run in a network namespace of its own with its loopback up."""
    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    try:
        return subprocess.run([*NETNS, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_job(route: str, head: str, D: int, a, jobs: Path, netns: bool) -> dict:
    """Launches one job, reads its ranks' meters: the row of the table."""
    job_dir = jobs / f"{route}_{head}_D{D}"
    job_dir.mkdir(parents=True)
    env = {**os.environ, METER_ENV: str(job_dir), "OMP_NUM_THREADS": str(a.threads),
           "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    cmd = [*(NETNS if netns else []), *job_command(route, head, D, a, job_dir)]
    (job_dir / "command.txt").write_text(" ".join(cmd) + "\n")
    row = {"route": route, "head": head, "D": D, "d": a.d, "rows_per_rank": a.rows, "world": a.world,
           "threads": a.threads, "steps": a.steps, "warmup": a.warmup}
    print(f"{route} {head} D={D} ...", flush=True)
    t0 = time.perf_counter()
    with (job_dir / "log.txt").open("w") as log:
        try:
            rc = subprocess.run(cmd, cwd=job_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=a.job_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    row["job_s"] = round(time.perf_counter() - t0, 1)
    meters = [json.loads(p.read_text()) for p in sorted(job_dir.glob("meter_rank*.json"))]
    if rc != 0 or len(meters) != a.world:
        tail = (job_dir / "log.txt").read_text()[-3000:]
        print(f"  FAILED ({rc}); the log's end:\n{tail}", flush=True)
        return {**row, "status": f"failed ({rc}): {job_dir / 'log.txt'}"}
    row.update(summarise(meters, a.warmup, a.steps))
    row["lo_scope"] = "job's netns" if netns else "machine"
    if not netns and row["bytes_per_step"] is not None:  # what the rest of the machine sends meanwhile
        before = loopback_bytes()
        time.sleep(row["timed_s"])
        row["idle_bytes_per_step"] = round((loopback_bytes() - before) / a.steps / a.world)
    row["status"] = "ok"
    print(f"  bytes/step per rank: {row['bytes_per_step']} on the wire, {row['head_bytes_per_step']} the head's; "
          f"{row['ms_per_step']} ms/step ({row['job_s']} s)", flush=True)
    return row


def summarise(meters: list[dict], warmup: int, steps: int) -> dict:
    """From the ranks' marks (mark 0: the start of training; mark i: after step i): time per
    step (the slower rank's median over the timed steps); bytes per rank per step on the wire
    (the loopback counter's growth over the timed steps, every rank's reading averaged, / steps
    / ranks); the head's own bytes per rank per step (its count's growth, ranks averaged, /
    steps); what a ring all-reduce of the body's dense gradients sends per rank (DDP's exchange)."""
    world = len(meters)
    for m in meters:
        if len(m["t"]) < warmup + steps + 1:
            raise ValueError(f"rank {m['rank']} noted {len(m['t']) - 1} steps, not {warmup + steps}")
    a, b = warmup, warmup + steps
    ms = max(1e3 * statistics.median(m["t"][i + 1] - m["t"][i] for i in range(a, b)) for m in meters)
    got = [m["lo"][b] - m["lo"][a] for m in meters if m["lo"][a] is not None and m["lo"][b] is not None]
    head = [m["head"][b] - m["head"][a] for m in meters if m.get("head") is not None]
    body = meters[0].get("body_param_bytes")
    return {"bytes_per_step": round(statistics.fmean(got) / steps / world) if got else None,
            "head_bytes_per_step": round(statistics.fmean(head) / steps) if len(head) == world else None,
            "body_allreduce_bytes": None if body is None else round(2 * (world - 1) * body / world),
            "ms_per_step": round(ms, 2), "timed_s": round(max(m["t"][b] - m["t"][a] for m in meters), 2),
            "max_rss_mb": round(max(m["max_rss_mb"] for m in meters)), "threads": meters[0]["threads"]}


# --- outputs -----------------------------------------------------------------------------

COLUMNS = ["route", "head", "D", "d", "rows_per_rank", "world", "threads", "steps", "warmup", "bytes_per_step",
           "head_bytes_per_step", "body_allreduce_bytes", "idle_bytes_per_step", "ms_per_step", "timed_s",
           "max_rss_mb", "job_s", "lo_scope", "status"]


#: the table's columns for each D: (label, the row's field, scale)
TABLE = (("wire kB", "bytes_per_step", 1e-3), ("head kB", "head_bytes_per_step", 1e-3),
         ("body all-reduce kB", "body_allreduce_bytes", 1e-3), ("ms/step", "ms_per_step", 1))


def table(rows: list[dict], Ds: list[int]) -> str:
    """route x head; for each D the bytes per rank per step on the wire, the head's own (counted
    at its collectives), a ring all-reduce of the body's dense gradients, and ms per step."""
    by = {(r["route"], r["head"], r["D"]): r for r in rows}
    out = []
    for route, head in dict.fromkeys((r["route"], r["head"]) for r in rows):
        line = {"route": route, "head": head}
        for label, field, scale in TABLE:
            for D in Ds:
                v = by.get((route, head, D), {}).get(field)
                line[f"{label}, D={D:,}"] = None if v is None else f"{v * scale:,.1f}"
        out.append(line)
    cols = ["route", "head", *(f"{label}, D={D:,}" for label, _, _ in TABLE for D in Ds)]
    return markdown_table(out, cols, right=cols[2:])


def plot(rows: list[dict], path: Path) -> Path:
    """Against D: the bytes on the wire, the head's own bytes, the time per step."""
    plt = pyplot()
    panels = (("bytes_per_step", 1e-6, "MB sent per rank per step (loopback)"),
              ("head_bytes_per_step", 1e-6, "MB per rank per step, the head's collectives"),
              ("ms_per_step", 1, "ms per step (median)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4))
    for route, head in dict.fromkeys((r["route"], r["head"]) for r in rows):
        ok = sorted((r for r in rows if (r["route"], r["head"]) == (route, head) and r.get("status") == "ok"),
                    key=lambda r: r["D"])
        for ax, (field, scale, _) in zip(axes, panels):
            if ok and all(r.get(field) is not None for r in ok):
                ax.plot([r["D"] for r in ok], [r[field] * scale for r in ok], "-" if head == "replicated" else "--",
                        marker="o", label=f"{route} {head}")
    Ds = sorted({r["D"] for r in rows})
    for ax, (_, _, what) in zip(axes, panels):
        ys = [y for line in ax.get_lines() for y in line.get_ydata()]
        if ys:  # at least a decade either way: equal heights read as equal (set before the log scale's autoscale)
            ax.set_ylim(min(ys) / 4, max(ys) * 4)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(Ds, [f"{D:,}" for D in Ds])
        ax.minorticks_off()
        ax.set_xlabel("D (classes)")
        ax.set_title(what, fontsize=10)
        ax.grid(alpha=0.3, which="both")
    if axes[-1].get_legend_handles_labels()[0]:
        axes[-1].legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)


# --- the command line --------------------------------------------------------------------

SMOKE = {"D": [300, 3000], "d": 8, "rows": 16, "seq_len": 4, "embed_dim": 4, "input_vocab": 200, "steps": 2,
         "warmup": 1}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--routes", nargs="+", choices=ROUTES, default=list(ROUTES))
    p.add_argument("--heads", nargs="+", choices=HEADS, default=list(HEADS), help="the factored head's parallel mode")
    p.add_argument("--D", type=positive_int, nargs="+", default=[10_000, 1_000_000], help="classes (the vocabulary)")
    p.add_argument("--d", type=positive_int, default=128, help="the head's hidden size (the body's output)")
    p.add_argument("--rows", type=positive_int, default=256, help="the head's rows per rank per step")
    p.add_argument("--seq-len", type=positive_int, default=32, help="HF and litgpt: tokens per sequence")
    p.add_argument("--embed-dim", type=positive_int, default=64,
                   help="lst-train: the n-gram body's input embedding width")
    p.add_argument("--input-vocab", type=positive_int, default=100_000, help="lst-train: the body's input vocabulary")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=positive_int, default=20, help="timed steps")
    p.add_argument("--warmup", type=positive_int, default=3, help="steps before the timed ones (at least 1)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per process")
    p.add_argument("--netns", choices=["auto", "on", "off"], default="auto",
                   help="each job in a network namespace of its own (auto: where unshare allows it)")
    p.add_argument("--job-timeout", type=float, default=1800, help="seconds per job")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: " + json.dumps(SMOKE))
    add_output_args(p)
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # torchrun runs this file with a job's settings
    if p.parse_known_args(argv)[0].smoke:  # tiny defaults; options given still count
        p.set_defaults(**SMOKE)
    a = p.parse_args(argv)
    if a.warmup < 1:
        p.error("--warmup must be at least 1 (the first step's start is the start of training)")
    if a.world < 2:
        p.error("--world must be at least 2: one process exchanges nothing")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    if a.worker:
        w = argparse.Namespace(**json.loads(a.worker.read_text()))
        (hf_worker if w.worker == "hf_ddp" else litgpt_worker)(w)
        import torch.distributed as dist  # noqa: PLC0415
        if dist.is_initialized():  # the group closed before the interpreter exits (left to exit, gloo aborted it)
            dist.destroy_process_group()
        return
    netns = a.netns == "on" or (a.netns == "auto" and netns_works())
    if a.netns == "on" and not netns_works():
        sys.exit("--netns on: unshare -rn (with ip link set lo up) does not work here")
    out = output_dir(a, "bench_routes")
    print(f"{len(a.routes) * len(a.heads) * len(a.D)} jobs; loopback counted in "
          + ("each job's own network namespace" if netns else "the machine's lo (polluted by other traffic)"),
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        # the jobs' folders: the run directory's jobs/, or with --update-results a temporary one
        jobs = Path(tmp) if a.update_results else (out / "jobs").resolve()
        if jobs.exists() and not a.update_results:  # --out reused: this run's jobs only
            shutil.rmtree(jobs)
        rows = [run_job(route, head, D, a, jobs, netns) for route in a.routes for head in a.heads for D in a.D]
    machine = machine_name()
    stem = out / f"bench_routes_{machine}"
    md = (f"Bytes sent per rank and time per step, {a.world} gloo processes ({machine}, {a.threads} thread(s) "
          f"each), d = {a.d}, {a.rows} head rows per rank, {a.steps} timed steps after {a.warmup}. wire: the "
          "job's loopback counter / ranks (framing and torchrun's store included); head: the bytes the head's "
          "collectives send (payload, ideal algorithms); body all-reduce: 2 (P - 1) / P x the body's dense "
          "trainable parameter bytes, what DDP's ring all-reduce sends (FSDP2: its gathers and reduce-scatter, "
          "about 1 to 1.5 x that)\n\n" + table(rows, a.D) + "\n")
    stem.with_suffix(".md").write_text(md)
    print(md)
    wrote(write_csv(stem.with_suffix(".csv"), rows, COLUMNS, machine=machine), stem.with_suffix(".md"),
          plot(rows, stem.with_suffix(".png")))
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        sys.exit(f"{len(failed)} job(s) failed: " + "; ".join(r["status"] for r in failed))


if __name__ == "__main__":
    main()
