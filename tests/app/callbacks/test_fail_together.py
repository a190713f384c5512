"""Ranks fail together (fail_together.py): in a two-process gloo run, rank 1 raises while
rank 0 waits in the gradient all-reduce; both stop within seconds (the group's timeout is
600 s), each with rank 1's message."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HELPER = Path(__file__).parents[2] / "helpers" / "fail_one_rank.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_ranks_error_stops_every_rank_with_its_message(tmp_path):
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
               "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0"}
        procs.append(subprocess.Popen([sys.executable, str(HELPER), str(tmp_path)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    ended = {}
    while len(ended) < 2:
        for rank, p in enumerate(procs):
            if rank not in ended and p.poll() is not None:
                ended[rank] = time.time()
        time.sleep(0.1)
        assert time.time() - min(ended.values(), default=time.time()) < 300, "a rank waits for the timeout"
    outs = [p.communicate()[0] for p in procs]
    failed_at = float((tmp_path / "failed_at").read_text())
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode != 0, out[-2000:]
        assert "non-finite loss on rank 1 at step 3" in out, (rank, out[-3000:])
        assert ended[rank] - failed_at < 60, (rank, ended[rank] - failed_at)  # not the 600 s timeout
    assert "[rank 0] stopping: rank 1 failed: FloatingPointError" in outs[0]


def test_the_callback_pickles_before_and_after_a_stage():
    """trainer=ddp_cpu (ddp_spawn) pickles the trainer, callbacks included, for the workers of
    each trainer call: no Event or store is held outside a stage."""
    import pickle  # noqa: PLC0415

    from lst_lightning.app.callbacks.fail_together import FailTogether  # noqa: PLC0415

    cb = FailTogether()
    pickle.dumps(cb)
    cb.teardown(None, None, "fit")
    assert cb._stop is None and cb._store is None
    pickle.dumps(cb)
