"""One lst-train run at a time in a run directory (run_lock.py): a second run given a directory
another run holds is refused in one line before it writes anything; the lock ends with its run."""
import pytest

from lst_lightning.app.run_lock import global_rank_zero, holding
from lst_lightning.app.train import run

from app_configs import FAST, cfg_of

IN_USE = r"^{} is in use by another lst-train run .*another hydra\.run\.dir"


def test_a_second_run_in_a_held_directory_is_refused_before_it_writes(tmp_path):
    run_dir = tmp_path / "run"
    with holding(run_dir):  # as another process holds it: flock conflicts between two opens of the directory
        with pytest.raises(ValueError, match=IN_USE.format(run_dir)):
            run(cfg_of(*FAST), run_dir)
        with pytest.raises(ValueError, match=IN_USE.format(run_dir)):
            with holding(run_dir):
                pass
        assert list(run_dir.iterdir()) == []
    with holding(run_dir):  # released with its block
        pass
    with holding(run_dir), holding(tmp_path / "other"):  # another directory is another lock
        pass


@pytest.mark.parametrize("env,zero", [({}, True), ({"RANK": "0", "LOCAL_RANK": "0"}, True), ({"RANK": "1"}, False),
                                      ({"SLURM_PROCID": "3"}, False), ({"LOCAL_RANK": "1"}, False),
                                      ({"LOCAL_RANK": "0", "NODE_RANK": "1"}, False)])
def test_only_rank_zero_takes_the_lock(tmp_path, monkeypatch, env, zero):
    for name in ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert global_rank_zero() == zero
    with holding(tmp_path):
        with holding(tmp_path) if not zero else pytest.raises(ValueError, match="in use"):
            with holding(tmp_path):
                pass
