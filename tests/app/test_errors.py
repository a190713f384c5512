"""Bad input through the console script: one line naming the setting, exit code 2, no
traceback; the configuration's errors come before Lightning and ``datasets`` are imported
(``-X importtime`` lists every module the process imported; torch is, for the heads'
signatures: app/schemas.py), and HYDRA_FULL_ERROR=1 shows the whole trace."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

LST_TRAIN = Path(sys.executable).parent / "lst-train"
HEAVY = ("lightning", "datasets")


def lst_train(*args, cwd, env=()):
    """stdout, the stderr lines that are not import times, the modules imported, the exit code."""
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPROFILEIMPORTTIME": "1", **dict(env)}
    proc = subprocess.run([str(LST_TRAIN), *args, f"hydra.run.dir={cwd}/run"], cwd=cwd, capture_output=True,
                          text=True, env=env)
    lines = proc.stderr.splitlines()
    modules = {ln.rsplit("|", 1)[1].strip() for ln in lines if ln.startswith("import time:") and "|" in ln}
    rest = [ln for ln in lines if not ln.startswith("import time:")]
    return proc.stdout, rest, modules, proc.returncode


def assert_one_line(rest, code, match):
    assert code == 2, rest
    assert len(rest) == 1 and rest[0].startswith("lst-train: error: "), rest
    assert match in rest[0], rest[0]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "empty.txt").write_text("\n  \n")
    return tmp_path


# one process each (the app's imports): a refusal of the config and of the data in the fast suite;
# the others' checks are tested in process (tests/app/test_checks.py, the command line's in
# test_composition.py) and here with -m slow
SLOW = pytest.mark.slow


@pytest.mark.parametrize("args,match", [
    (["trainer.max_steps=-5"], "trainer.max_steps=-5"),
    pytest.param(["loss.a=-1"], "write loss.kwargs.a=-1", marks=SLOW),
    pytest.param(["head_step=fused"], "head_step is no longer a setting: the step mode is the head's own setting: "
                 "write head.step=fused", marks=SLOW),
    pytest.param(["ckpt_path=/nonexistent/last.ckpt"], "ckpt_path=/nonexistent/last.ckpt", marks=SLOW),
    pytest.param(["ckpt_path=last", "hydra.run.dir=fresh"], "ckpt_path=last: no checkpoint to resume in", marks=SLOW),
    (["data=text_files", "data.path=/nonexistent.txt"], "data.path: /nonexistent.txt not found"),
    pytest.param(["data=text_files", "data.path=empty.txt"], "is empty", marks=SLOW),
    pytest.param(["head=nosuch"], "head=nosuch: head has no option nosuch; the choices are adaptive, ",
                 marks=SLOW),  # Hydra's: composition.py; in process: test_composition.py
    pytest.param(["data.batch_sise=3"], "did you mean data.batch_size? (+data.batch_sise=3 adds it", marks=SLOW),
    pytest.param(["-m", "head=factored,nosuch"], "head=nosuch: head has no option nosuch", marks=SLOW),
])
def test_config_errors_answer_in_one_line_before_the_heavy_imports(files, args, match):
    out, rest, modules, code = lst_train(*args, cwd=files)
    assert_one_line(rest, code, match)
    assert "Traceback" not in out and not any(m.split(".")[0] in HEAVY for m in modules)
    assert "lst_lightning.app.train" in modules  # the listing works: the app itself is in it


@SLOW
@pytest.mark.parametrize("arg,last", [
    ("trainer.max_steps=-5", "trainer.max_steps=-5"),
    pytest.param("head=nosuch", "provider=schema, path=structured://", marks=SLOW),  # Hydra's own message
])
def test_full_error_shows_the_traceback(tmp_path, arg, last):
    _, rest, _, code = lst_train(arg, cwd=tmp_path, env={"HYDRA_FULL_ERROR": "1"})
    assert code != 0 and any("Traceback" in ln for ln in rest) and last in rest[-1]


def test_a_run_directory_that_is_a_file_is_one_line():
    """hydra.run.dir=<a file>: Hydra's mkdir fails before the app runs (a FileExistsError traceback)."""
    from lst_lightning.app.errors import bad_input_message  # noqa: PLC0415

    assert bad_input_message(FileExistsError(17, "File exists", "/x/run")) == "[Errno 17] File exists: '/x/run'"


@SLOW
def test_a_run_directory_that_is_a_file_through_the_console_script(tmp_path):
    (tmp_path / "run").write_text("")  # lst_train's hydra.run.dir
    _, rest, _, code = lst_train("trainer.max_steps=1", cwd=tmp_path)
    assert_one_line(rest, code, f"File exists: '{tmp_path}/run'")


def test_help_says_what_the_app_is_and_where_the_docs_are(tmp_path):
    out, rest, modules, code = lst_train("--help", cwd=tmp_path)
    assert code == 0, rest
    assert out.startswith("lst-train: trains a language model") and "docs/app.md" in out
    assert "loss: mse, sampled, spherical_softmax, taylor_softmax, zloss" in out  # the groups, from conf/
    assert not any(m.split(".")[0] in HEAVY for m in modules)


@pytest.mark.slow  # minutes on a loaded machine: lst-train's heavy imports, then datasets' offline lookups
def test_offline_hub_dataset_is_one_line(tmp_path):
    """An error found after the heavy imports (loading the data) is one line too."""
    out, rest, _, code = lst_train("data=wikitext103", cwd=tmp_path,
                                   env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                                        "LST_CACHE_DIR": str(tmp_path / "cache")})
    assert_one_line(rest, code, "data.name='wikitext' (data.source=hub) is not cached")
    assert "Traceback" not in out


def test_the_other_scripts_errors_are_one_line_too(capsys):
    """lst-compare and lst-dashboard (argparse): an unknown flag, a missing argument and the script's own
    refusal, each one line without argparse's usage lines."""
    from lst_lightning.app import compare, dashboard  # noqa: PLC0415

    for main, prog, argv, match in [(compare.main, "lst-compare", ["--nosuch", "x"], "unrecognized arguments: --nosuch"),
                                    (compare.main, "lst-compare", [], "the following arguments are required: dirs"),
                                    (compare.main, "lst-compare", ["/nonexistent"], "no such run or sweep directory"),
                                    (dashboard.main, "lst-dashboard", ["/nonexistent", "--dry-run"],
                                     "no such sweep directory: /nonexistent")]:
        with pytest.raises(SystemExit) as info:
            main(argv)
        err = capsys.readouterr().err.splitlines()
        assert info.value.code == 2 and len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
        assert match in err[0]
