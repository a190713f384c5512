"""Runs that survive: a run killed (SIGKILL), preempted (SIGTERM) or stopped by Ctrl-C mid-epoch, resumed
with the same command and ckpt_path=last ends exactly as the run that was never stopped;
ckpt_path=last/auto find the run directory's newest checkpoint (resume.py)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lst_lightning.app.resume import resolve_ckpt_path, run_checkpoints
from lst_lightning.app.train import run
from lst_lightning.spherical.shard_files import load_rows

from app_configs import FAST, cfg_of, run_of
from forked_ranks import in_fresh_process

HELPERS = Path(__file__).parents[1] / "helpers"
# Two epochs of 10 steps, validation every 4, dropout and the factored head (its counters,
# pending state and repairs), a checkpoint after every step; the stall callback (stall.py)
# holds the run at LST_STALL_AT when that is set.
RUN = [*FAST, "trainer.max_epochs=2", "trainer.limit_train_batches=10", "trainer.val_check_interval=4",
       "model.dropout=0.2", "callbacks.checkpoint.every_n_steps=1", "callbacks.checkpoint.every_minutes=null",
       "callbacks.checkpoint.max_overhead=null", "head.stabiliser.check_every=3", "+callbacks.stall._target_=stall.Stall"]
STOP_AT = 7  # mid-epoch 0, between validations: steps 0..6 done


def lst_train(run_dir, *extra, stall_at=None, hold_save_at=None, hold_shard_at=None):
    """lst-train in its own process group (with the ranks Lightning starts beside it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HELPERS), os.environ.get("PYTHONPATH", "")])}
    for name, value in (("LST_STALL_AT", stall_at), ("LST_HOLD_SAVE_AT", hold_save_at),
                        ("LST_HOLD_SHARD_AT", hold_shard_at)):
        env.pop(name, None)
        if value is not None:
            env[name] = str(value)
    return subprocess.Popen([sys.executable, "-m", "lst_lightning.app.train", *RUN, f"hydra.run.dir={run_dir}", *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finished(proc, code=0):
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == code, out[-3000:]
    return out


def stalled(proc, run_dir):
    """Wait for the run to reach the stall (steps before it done and checkpointed)."""
    while not (Path(run_dir) / "stalled").exists():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    (Path(run_dir) / "stalled").unlink()


def outcome(run_dir):
    """What must not depend on the interruption: the results but time, and the final weights."""
    res = json.loads((Path(run_dir) / "results.json").read_text())
    res = {k: v for k, v in res.items() if k not in ("wall_s", "run_dir", "step_time_ms", "tokens_per_s", "head_share",
                                                   "checkpoints")}  # timings: what the saves took
    state = torch.load(Path(run_dir) / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert state["global_step"] == res["train_steps"] == 20  # last.ckpt holds the final state
    return res, state["state_dict"], state["optimizer_states"]


def equal(a, b, where=""):
    """Bit-identical tensors, equal everything else, at every depth of dicts and lists."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def same(a, b):
    (ra, sa, oa), (rb, sb, ob) = a, b
    assert ra == rb  # validation, test and unigram metrics, steps, the head's counters
    equal(sa, sb, "state_dict")
    equal(oa, ob, "optimizer_states")  # the moments, step counts and lrs of every part


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    run(cfg_of(*RUN), run_dir)  # in this process: the killed runs' processes are the ones to stop
    return outcome(run_dir)


def test_a_killed_run_resumes_exactly(tmp_path, uninterrupted):
    """SIGKILL at step 7 (the checkpoint of step 6 written): the same command with
    ckpt_path=last ends bit-identical to the run never stopped: validation and test
    metrics, the head's counters, every weight and the optimiser's state."""
    proc = lst_train(tmp_path, stall_at=STOP_AT)
    stalled(proc, tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=900)
    assert proc.returncode == -signal.SIGKILL and not (tmp_path / "results.json").exists()
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == STOP_AT  # mid-epoch: step 7 of 10
    run(cfg_of(*RUN, "ckpt_path=last"), tmp_path)  # in this process, to save one start-up
    same(outcome(tmp_path), uninterrupted)


@pytest.mark.slow  # the default suite resumes after a SIGKILL and after SIGTERM's save
def test_a_run_killed_in_the_middle_of_a_background_save_resumes_exactly(tmp_path, uninterrupted):
    """The checkpoint of step 7 is half written in the background while training goes on to
    step 8 (whose save waits for it): SIGKILL then leaves last.ckpt at step 6, whole, and the
    half file under a temporary name only; resumed with ckpt_path=last, the run ends as the
    run never stopped."""
    proc = lst_train(tmp_path, "+callbacks.hold_save._target_=hold_save.HoldSave", hold_save_at=STOP_AT)
    while not ((tmp_path / "saving").exists() and (tmp_path / "trained").exists()
               and int((tmp_path / "trained").read_text() or 0) > STOP_AT):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=900)
    files = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert files == [".step7.ckpt.tmp" + str(proc.pid), "last.ckpt", "step6.ckpt"], files
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == STOP_AT - 1
    run(cfg_of(*RUN, "ckpt_path=last"), tmp_path)  # in this process, to save one start-up
    same(outcome(tmp_path), uninterrupted)


def test_a_preempted_run_saves_and_resumes_exactly(tmp_path, uninterrupted):
    """SIGTERM during step 7: the step finishes, last.ckpt holds it, the run exits with 143;
    resumed with the same configuration and ckpt_path=last it ends as the run never stopped."""
    proc = lst_train(tmp_path, "callbacks.checkpoint.every_n_steps=0", "callbacks.checkpoint.after_validation=false",
                     stall_at=STOP_AT)
    stalled(proc, tmp_path)
    assert not (tmp_path / "checkpoints").exists()  # no checkpoint but SIGTERM's
    proc.send_signal(signal.SIGTERM)
    out = finished(proc, code=143)
    assert "stopped by SIGTERM" in out
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == STOP_AT + 1  # the step it was in finished
    run(cfg_of(*RUN, "ckpt_path=last"), tmp_path)  # in this process, to save one start-up
    same(outcome(tmp_path), uninterrupted)


@pytest.mark.slow  # the default suite resumes after a SIGKILL and after SIGTERM's save
def test_a_first_ctrl_c_saves_after_the_batch_and_resumes_exactly(tmp_path, uninterrupted):
    """Ctrl-C (SIGINT to the run's process group, as a terminal sends it) during step 7: the step
    finishes, last.ckpt holds it, the run exits with 130 saying how to resume; resumed with
    ckpt_path=last it ends as the run never stopped. (Lightning's own Ctrl-C stopped wherever the
    step was and saved nothing: exit code 1, no checkpoint.)"""
    proc = lst_train(tmp_path, "callbacks.checkpoint.every_n_steps=0", "callbacks.checkpoint.after_validation=false",
                     stall_at=STOP_AT)
    stalled(proc, tmp_path)
    os.killpg(proc.pid, signal.SIGINT)
    out = finished(proc, code=130)
    assert "stopped by Ctrl-C" in out
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == STOP_AT + 1  # the step it was in finished
    run(cfg_of(*RUN, "ckpt_path=last"), tmp_path)
    same(outcome(tmp_path), uninterrupted)


def test_last_is_the_newest_checkpoint_of_the_run(tmp_path):
    ckpts = tmp_path / "checkpoints"
    with pytest.raises(FileNotFoundError, match="ckpt_path=last: no checkpoint to resume in"):
        resolve_ckpt_path("last", tmp_path)
    assert resolve_ckpt_path("auto", tmp_path) is None and resolve_ckpt_path(None, tmp_path) is None
    ckpts.mkdir()
    for name, t in [("step4.ckpt", 1), ("last.ckpt", 2), ("step8.ckpt", 2)]:  # last and step8: the same time
        torch.save({}, ckpts / name)
        os.utime(ckpts / name, ns=(10**9 * t, 10**9 * t))
    assert resolve_ckpt_path("last", tmp_path) == resolve_ckpt_path("auto", tmp_path) == str(ckpts / "last.ckpt")
    hpc = tmp_path / "hpc_ckpt_1.ckpt"  # Lightning's SLURM requeue checkpoint, when newer
    torch.save({}, hpc)
    assert run_checkpoints(tmp_path)[-1] == hpc and resolve_ckpt_path("last", tmp_path) == str(hpc)
    assert resolve_ckpt_path(str(ckpts / "step4.ckpt"), tmp_path) == str(ckpts / "step4.ckpt")
    with pytest.raises(FileNotFoundError, match="no such checkpoint file"):
        resolve_ckpt_path(str(ckpts / "step5.ckpt"), tmp_path)
    hpc.write_bytes(hpc.read_bytes()[:-1])  # the newest cut short: refused in one line, naming it
    with pytest.raises(ValueError, match=f"ckpt_path=last: {hpc} is not a checkpoint torch.load can read"):
        resolve_ckpt_path("last", tmp_path)


def files(run_dir):
    return {p: p.read_bytes() for p in Path(run_dir).rglob("*") if p.is_file()}


def test_a_fresh_start_among_an_earlier_runs_checkpoints_is_refused(tmp_path):
    """ckpt_path=null (or another directory's checkpoint) in a run directory that holds checkpoints: one
    line naming them and ckpt_path=last, every file left as it was; its own checkpoint resumes."""
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    for name in ("step20.ckpt", "last.ckpt"):
        torch.save({"global_step": 20}, ckpts / name)
    (tmp_path / "results.json").write_text('{"train_steps": 20}')
    before = files(tmp_path)
    with pytest.raises(ValueError, match=rf"^a fresh start in {tmp_path}, which holds an earlier run's checkpoints "
                                         r"\(checkpoints/.*\.ckpt, checkpoints/.*\.ckpt\): ckpt_path=last resumes"):
        run(cfg_of(*FAST), tmp_path)
    assert files(tmp_path) == before
    other = tmp_path.parent / f"{tmp_path.name}-other.ckpt"
    torch.save({}, other)
    with pytest.raises(ValueError, match=r"\(another directory's checkpoint\) in .*: ckpt_path=last resumes"):
        resolve_ckpt_path(str(other), tmp_path)
    assert resolve_ckpt_path(str(ckpts / "step20.ckpt"), tmp_path) == str(ckpts / "step20.ckpt")
    assert resolve_ckpt_path("auto", tmp_path) in (str(ckpts / "last.ckpt"), str(ckpts / "step20.ckpt"))
    assert resolve_ckpt_path(str(other), tmp_path / "empty") == str(other)  # no checkpoints there: a resume elsewhere


def test_two_ranks_resume_mid_epoch_exactly(tmp_path):
    """Two gloo ranks (ddp_fork), dropout and the replicated factored head: resumed from the
    checkpoint of step 3 of 6, they end as the run never stopped; the checkpoint holds each
    rank's random states."""
    over = [*FAST, "trainer=ddp_cpu", "trainer.strategy=ddp_fork", "head.parallel=replicated", "test=false",
            "trainer.limit_train_batches=6", "model.dropout=0.2", "callbacks.checkpoint.every_n_steps=1",
            "callbacks.checkpoint.max_overhead=null",
            "callbacks.checkpoint.keep=10", "callbacks.checkpoint.every_minutes=null"]
    full = in_fresh_process(run_of, over, tmp_path / "full")  # forked_ranks.py: ddp_fork's ranks
    saved = torch.load(tmp_path / "full" / "checkpoints" / "step3.ckpt", weights_only=True)
    assert len(saved["rng_states"]) == 2
    resumed = in_fresh_process(run_of, [*over, f"ckpt_path={tmp_path / 'full' / 'checkpoints' / 'step3.ckpt'}"],
                               tmp_path / "resumed")
    assert resumed["val"] == full["val"] and resumed["train_steps"] == full["train_steps"] == 6
    a, b = (torch.load(tmp_path / d / "checkpoints" / "last.ckpt", weights_only=True) for d in ("full", "resumed"))
    equal(a["state_dict"], b["state_dict"], "state_dict")


def test_accumulation_resumes_mid_epoch_exactly(tmp_path):
    """Two micro-batches per step (the factored head steps at the optimizer's step): saves
    fall at optimizer steps, and a resume from step 3 of 5 ends as the run never stopped."""
    over = [*FAST, "trainer.limit_train_batches=10", "trainer.accumulate_grad_batches=2", "model.dropout=0.2",
            "test=false", "callbacks.checkpoint.every_n_steps=1", "callbacks.checkpoint.keep=10",
            "callbacks.checkpoint.max_overhead=null",
            "callbacks.checkpoint.every_minutes=null"]
    full = run(cfg_of(*over), tmp_path / "full")
    step3 = tmp_path / "full" / "checkpoints" / "step3.ckpt"
    progress = torch.load(step3, weights_only=True)["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
    assert progress["processed"] == 6  # saved at the end of the 6th micro-batch, the one that stepped
    resumed = run(cfg_of(*over, f"ckpt_path={step3}"), tmp_path / "resumed")
    assert resumed["val"] == full["val"] and resumed["train_steps"] == full["train_steps"] == 5
    a, b = (torch.load(tmp_path / d / "checkpoints" / "last.ckpt", weights_only=True) for d in ("full", "resumed"))
    equal(a["state_dict"], b["state_dict"], "state_dict")
    equal(a["optimizer_states"], b["optimizer_states"], "optimizer_states")


def test_a_moved_run_directory_resumes_from_its_head_shards(tmp_path):
    """head_checkpoint=per_rank: a checkpoint names its head shards' directory as it was written. The
    run directory moved whole (its head_shards with it) resumes from its checkpoint of step 3 of 6,
    reading the shards beside that checkpoint, to the run's end (it failed: "no shard files")."""
    over = [*FAST, "head.parallel=sharded", "head_checkpoint=per_rank", "head_shards_keep=10", "test=false",
            "trainer.limit_train_batches=6", "callbacks.checkpoint.every_n_steps=1", "callbacks.checkpoint.keep=10",
            "callbacks.checkpoint.max_overhead=null", "callbacks.checkpoint.every_minutes=null"]
    full = run(cfg_of(*over), tmp_path / "full")
    moved = tmp_path / "moved"
    (tmp_path / "full").rename(moved)
    step3 = moved / "checkpoints" / "step3.ckpt"
    assert not Path(torch.load(step3, weights_only=True)["state_dict"]["head._extra_state"]["v_files"]).exists()
    resumed = run(cfg_of(*over, f"ckpt_path={step3}"), tmp_path / "resumed")
    assert resumed["val"] == full["val"] and resumed["train_steps"] == full["train_steps"] == 6
    a, b = (torch.load(d / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"] for d in (moved, tmp_path / "resumed"))
    assert torch.equal(load_rows(b["head._extra_state"]["v_files"]),
                       load_rows(moved / "checkpoints" / "head_shards" / "step6"))
    equal({k: v for k, v in a.items() if k != "head._extra_state"},
          {k: v for k, v in b.items() if k != "head._extra_state"}, "state_dict")


# Two ranks (Lightning starts the second), the factored head sharded, its V in one file per rank.
PER_RANK = ["trainer=ddp_cpu", "trainer.strategy=ddp", "head.parallel=sharded", "head_checkpoint=per_rank"]


def with_rows(result):
    """outcome() with the head's V read back from its files (the directories differ by run)."""
    res, state, optimizer = result
    extra = dict(state["head._extra_state"])
    assert state["head.V"].numel() == 0
    extra["v_files"] = load_rows(extra["v_files"])
    return res, {**state, "head._extra_state": extra}, optimizer


@pytest.mark.slow
def test_two_ranks_killed_while_a_head_shard_is_written_resume_exactly(tmp_path):
    """Rank 1's file of step 7 is half written in the background while both ranks train on
    to step 8 (whose save waits for it); rank 0's checkpoint of step 7 waits for that file.
    SIGKILL then leaves last.ckpt at step 6 with both of its files, step 7's directory without
    rank 1's file (its half under a temporary name); resumed with ckpt_path=last, the run ends
    as the run never stopped, V included."""
    proc = lst_train(tmp_path / "full", *PER_RANK)
    finished(proc)
    proc = lst_train(tmp_path / "killed", *PER_RANK, "+callbacks.hold_save._target_=hold_save.HoldSave",
                     hold_shard_at=STOP_AT)
    run_dir = tmp_path / "killed"
    try:
        while not ((run_dir / "saving").exists() and (run_dir / "trained").exists()
                   and int((run_dir / "trained").read_text() or 0) > STOP_AT):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # both ranks
    proc.communicate(timeout=900)
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == STOP_AT - 1
    files = Path(saved["state_dict"]["head._extra_state"]["v_files"])
    assert files == (run_dir / "checkpoints" / "head_shards" / f"step{STOP_AT - 1}").resolve()
    assert sorted(p.name for p in files.iterdir()) == ["rank00000.pt", "rank00001.pt"]
    held = sorted(p.name for p in files.with_name(f"step{STOP_AT}").iterdir())
    assert held[0].startswith(".rank00001.pt.tmp") and held[1:] == ["rank00000.pt"], held
    assert not (run_dir / "checkpoints" / f"step{STOP_AT}.ckpt").exists()
    finished(lst_train(run_dir, *PER_RANK, "ckpt_path=last"))
    same(with_rows(outcome(run_dir)), with_rows(outcome(tmp_path / "full")))
