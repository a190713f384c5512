"""scripts/bench_routes.py: the arithmetic on the ranks' marks, the head's byte count at its
collectives, the table, where the outputs go (with a stand-in job that writes two ranks'
meters), and (slow) the smoke run of every route on two gloo processes."""
from __future__ import annotations

import csv
import json
import sys

import bench_routes as br
import pytest
import torch
from torch import nn

from lst_lightning.distributed import collectives
from lst_lightning.spherical.factored import FactoredSphericalHead


def meters(warmup=1, steps=2):
    """Two ranks' marks: rank 0's steps take 10, 20, 30 ms, rank 1's 10, 40, 50 ms; the
    counter grows by 1000 bytes a step, read 100 bytes apart by the two ranks; each rank's
    head sends 300 bytes a step (its count since the process started, one warm-up step of 700)."""
    t0 = [0.0, 0.010, 0.030, 0.060]
    t1 = [0.0, 0.010, 0.050, 0.100]
    head = [50, 750, 1050, 1350]
    return [{"rank": 0, "world": 2, "threads": 1, "t": t0, "lo": [5000 + 1000 * i for i in range(4)], "head": head,
             "body_param_bytes": 4000, "max_rss_mb": 10},
            {"rank": 1, "world": 2, "threads": 1, "t": t1, "lo": [5100 + 1000 * i for i in range(4)], "head": head,
             "body_param_bytes": 4000, "max_rss_mb": 12}]


def test_summary_takes_the_slower_rank_and_halves_the_loopback_bytes():
    s = br.summarise(meters(), warmup=1, steps=2)
    assert s["ms_per_step"] == 45.0  # rank 1's median of 40 and 50 ms; the warm-up step left out
    assert s["bytes_per_step"] == 500  # 2000 bytes over two steps, sent by two ranks
    assert s["head_bytes_per_step"] == 300  # per rank already: not halved
    assert s["body_allreduce_bytes"] == 4000  # 2 (P - 1) / P x 4000 at P = 2
    assert (s["timed_s"], s["max_rss_mb"], s["threads"]) == (0.09, 12, 1)


def test_a_head_not_counted_on_a_rank_gives_no_head_bytes():
    m = meters()
    m[1]["head"] = None
    assert br.summarise(m, warmup=1, steps=2)["head_bytes_per_step"] is None


def test_a_rank_with_too_few_steps_is_an_error():
    m = meters()
    m[1]["t"].pop()
    with pytest.raises(ValueError, match="rank 1 noted 2 steps, not 3"):
        br.summarise(m, warmup=1, steps=2)


def test_no_loopback_counter_gives_no_bytes():
    m = meters()
    for r in m:
        r["lo"] = [None] * 4
    assert br.summarise(m, warmup=1, steps=2)["bytes_per_step"] is None


def test_the_loopback_counter_is_read_on_linux():
    if sys.platform != "linux":
        pytest.skip("/proc/net/dev is Linux's")
    assert isinstance(br.loopback_bytes(), int)


class TwoRanks:
    """torch.distributed as seen by rank 0 of 2, in one process: every rank sends what this one does."""

    @staticmethod
    def all_gather(out, x, group=None):
        for o in out:
            o.copy_(x)

    @staticmethod
    def all_gather_object(out, obj, group=None):
        out[:] = [obj] * len(out)

    @staticmethod
    def all_gather_into_tensor(out, x, group=None):
        out.copy_(torch.cat([x, x]))

    @staticmethod
    def all_reduce(x, group=None):
        x.mul_(2)

    @staticmethod
    def broadcast(x, src, group=None):
        pass


def test_the_head_s_collectives_count_what_each_rank_sends(monkeypatch):
    monkeypatch.setattr(collectives, "dist", TwoRanks)
    monkeypatch.setattr(br.CountingProcessGroup, "sent", 0)
    pg = br.CountingProcessGroup(None, 0, 2)
    pg.all_reduce_(torch.ones(10))  # 40 bytes: a ring all-reduce on 2 ranks sends them once
    assert br.CountingProcessGroup.sent == 40
    pg.broadcast_(torch.ones(10))  # rank 0 sends 40 bytes, rank 1 none: 20 a rank
    assert br.CountingProcessGroup.sent == 60
    pg.all_gather_ints([1, 2, 3])  # 24 bytes to the other rank
    assert br.CountingProcessGroup.sent == 84
    (H, idx), rows = pg.gather_rows([torch.ones(3, 4), torch.arange(3)], [0.0, -1])
    assert H.shape == (6, 4) and rows == slice(0, 3)
    assert br.CountingProcessGroup.sent == 84 + 8 + 3 * (16 + 8)  # the counts, then 3 rows of 16 + 8 bytes
    assert pg.gather_fixed(torch.ones(3, 2)).shape == (6, 2)  # 24 bytes to the other rank
    assert br.CountingProcessGroup.sent == 188
    pg.all_gather_objects("x")
    alone = br.CountingProcessGroup()  # one process: nothing sent
    alone.all_reduce_(torch.ones(10))
    alone.all_gather_ints([1])
    assert br.CountingProcessGroup.sent == 188 + len(__import__("pickle").dumps("x"))


def test_every_collective_of_the_process_group_is_counted():
    """A method added to ProcessGroup must be counted (or said to send nothing itself)."""
    public = {n for n, v in vars(collectives.ProcessGroup).items()
              if not n.startswith("_") and callable(getattr(collectives.ProcessGroup, n))}
    counted = {n for n in vars(br.CountingProcessGroup) if not n.startswith("_")} - {"sent"}
    assert public == counted | set(br.NOT_COUNTED)


def test_a_head_that_joins_after_the_meter_is_made_gets_the_counting_group(monkeypatch):
    monkeypatch.setattr(br.factored, "ProcessGroup", br.factored.ProcessGroup)  # restored after the test
    br.count_head_collectives()
    head = FactoredSphericalHead(num_classes=20, hidden_dim=4, parallel="replicated")
    head.distribute()
    assert isinstance(head.processes.pg, br.CountingProcessGroup)


def test_the_body_s_dense_bytes_leave_out_row_sparse_and_frozen_parameters():
    model = nn.Sequential(nn.Embedding(100, 4, sparse=True), nn.Linear(4, 3), nn.Linear(3, 2))
    model[2].requires_grad_(False)
    assert br.dense_param_bytes(model) == (4 * 3 + 3) * 4


def test_smoke_sets_tiny_defaults_that_options_override():
    a = br.parse(["--smoke", "--D", "500"])
    assert (a.D, a.d, a.steps) == ([500], br.SMOKE["d"], br.SMOKE["steps"])
    assert br.parse([]).D == [10_000, 1_000_000]
    with pytest.raises(SystemExit):
        br.parse(["--world", "1"])


def test_every_lst_train_job_is_torchrun_with_the_meter(tmp_path):
    a = br.parse(["--smoke"])
    cmd = br.job_command("lst_ddp", "sharded", 300, a, tmp_path)
    assert cmd[0].endswith("torchrun") and "trainer.strategy=ddp" in cmd and "head.parallel=sharded" in cmd
    assert "+callbacks.route_meter._target_=bench_routes.LightningMeter" in cmd
    cmd = br.job_command("litgpt_fsdp2", "replicated", 300, a, tmp_path)
    assert cmd[-2:] == ["--worker", str(tmp_path / "worker.json")]
    assert json.loads((tmp_path / "worker.json").read_text())["worker"] == "litgpt_fsdp2"


FAKE_JOB = """
import json, os, pathlib
folder = pathlib.Path(os.environ["LST_ROUTE_METER"])
for r in range(2):
    (folder / f"meter_rank{r}.json").write_text(json.dumps({"rank": r, "world": 2, "threads": 1,
        "t": [0.001 * i for i in range(4)], "lo": [1000 * i for i in range(4)], "head": [100 * i for i in range(4)],
        "body_param_bytes": 4000, "max_rss_mb": 1}))
"""


def test_default_run_writes_its_run_directory_only(sandbox, monkeypatch):
    monkeypatch.setattr(br, "job_command", lambda *args: [sys.executable, "-c", FAKE_JOB])
    run_dir = sandbox.run_default(br.main, ["--smoke", "--routes", "lst_ddp", "hf_ddp", "--netns", "off"],
                                  "bench_routes")
    stem = run_dir / f"bench_routes_{br.machine_name()}"
    with stem.with_suffix(".csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["route"], r["head"], r["D"]) for r in rows] == [
        (route, head, str(D)) for route in ("lst_ddp", "hf_ddp") for head in br.HEADS for D in br.SMOKE["D"]]
    assert {(r["bytes_per_step"], r["head_bytes_per_step"], r["body_allreduce_bytes"], r["ms_per_step"],
             r["lo_scope"], r["status"]) for r in rows} == {("500", "100", "4000", "1.0", "machine", "ok")}
    line = "| lst_ddp | sharded | 0.5 | 0.5 | 0.1 | 0.1 | 4.0 | 4.0 | 1.0 | 1.0 |"  # wire, head, body, ms
    assert line in stem.with_suffix(".md").read_text()
    assert stem.with_suffix(".png").is_file() and (run_dir / "jobs" / "hf_ddp_sharded_D300" / "log.txt").is_file()


def test_update_results_writes_the_committed_files(sandbox, monkeypatch):
    monkeypatch.setattr(br, "job_command", lambda *args: [sys.executable, "-c", FAKE_JOB])
    name = f"bench_routes_{br.machine_name()}"
    changed = sandbox.run_update(br.main, ["--smoke", "--routes", "lst_fsdp2", "--heads", "sharded", "--netns", "off"])
    assert changed == {f"{name}.csv", f"{name}.md", f"{name}.png"}  # the jobs' folders are temporary


def test_a_failed_job_is_a_row_and_an_exit(sandbox, monkeypatch):
    monkeypatch.setattr(br, "job_command", lambda *args: [sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(SystemExit, match="2 job"):
        br.main(["--smoke", "--routes", "lst_ddp", "--heads", "sharded", "--netns", "off"])
    (run_dir,) = (sandbox.cwd / "outputs" / "bench" / "bench_routes").iterdir()
    with (run_dir / f"bench_routes_{br.machine_name()}.csv").open() as fh:
        assert all(r["status"].startswith("failed (3)") for r in csv.DictReader(fh))


@pytest.mark.slow  # ten torchrun jobs of two processes: 7 minutes on one loaded core of the 2-core machine
def test_smoke_runs_every_route_on_two_processes(sandbox):
    run_dir = sandbox.run_default(br.main, ["--smoke", "--heads", "sharded"], "bench_routes")
    with (run_dir / f"bench_routes_{br.machine_name()}.csv").open() as fh:
        rows = {(r["route"], int(r["D"])): r for r in csv.DictReader(fh)}
    assert {r["status"] for r in rows.values()} == {"ok"} and len(rows) == 2 * len(br.ROUTES)
    small, large = br.SMOKE["D"]
    for route in br.ROUTES:
        assert float(rows[route, small]["ms_per_step"]) > 0 and int(rows[route, small]["bytes_per_step"]) > 0
        # the head's own exchange, counted at its collectives: rows x d, not D (equal here;
        # 5% of room for sampled negatives, whose unique rows of V depend on the draws)
        head_small, head_large = (int(rows[route, D]["head_bytes_per_step"]) for D in (small, large))
        assert 0 < head_large <= 1.05 * head_small and head_small <= 1.05 * head_large, route
    for route in ("lst_ddp", "lst_fsdp2"):  # a sparse input embedding: nothing exchanged grows with D
        assert int(rows[route, large]["bytes_per_step"]) < 1.5 * int(rows[route, small]["bytes_per_step"])
