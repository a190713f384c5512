"""One step, one path: a training step of the factored head with a spherical loss (the
Z-loss) (``head(H, idx).backward()``, traced by scripts/trace_step.py after a warm-up step)
enters at most 8 project files and 45 functions: the input check, the loss, the head's shell
and its step (base.py, exact_step.py), its host driver with its device flags, compiled or eager
(driver.py), its precision (precision.py) and the kernel ops; not the head's class
(factored.py): the step reads the head's plan and settings as data.
Processes, pending rows and the repairs are not entered when they have nothing to do."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_FILES, MAX_FUNCTIONS = 8, 45


def trace_script():
    spec = importlib.util.spec_from_file_location("trace_step", ROOT / "scripts" / "trace_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def path():
    return trace_script().default_step_path()


def test_the_default_step_enters_at_most_8_files_and_45_functions(path):
    kernel_files = sorted(f for f in path if "/lst_kernels/" in f)
    assert kernel_files == ["triton_kernels/lst_kernels/functional.py", "triton_kernels/lst_kernels/reference.py"]
    functions = sum(len(v) for v in path.values())
    assert len(path) <= MAX_FILES and functions <= MAX_FUNCTIONS, path


def test_the_head_side_of_the_default_step_is_its_shell_its_step_and_its_flags(path):
    """Outside the kernel ops (2 files: the ops and their reference on CPU) and the loss and
    input check, the step enters four files of the head, in at most 45 - 13 functions."""
    head_side = {f: names for f, names in path.items() if "/lst_kernels/" not in f}
    spherical = sorted(f for f in head_side if "/spherical/" in f)
    assert spherical == [f"src/lst_lightning/spherical/{name}.py"
                         for name in ("base", "driver", "exact_step", "precision")], sorted(head_side)
    assert len(head_side) <= MAX_FILES - 2
    assert sum(len(v) for v in head_side.values()) <= MAX_FUNCTIONS - 13, head_side


def test_the_default_losss_step_enters_at_most_12_files_and_61_functions():
    """lst-train's default, loss=sampled: the spherical step above plus the draw (negatives.py,
    the sampler), the composite loss, the target slots and the right preconditioner (its step,
    the write of its moments)."""
    path = trace_script().default_step_path(loss="sampled")
    assert {"src/lst_lightning/spherical/negatives.py", "src/lst_lightning/losses/sampled_composite.py",
            "src/lst_lightning/spherical/preconditioner.py"} <= set(path)
    assert len(path) <= 12 and sum(len(v) for v in path.values()) <= 61, path


def test_the_script_traces_either_loss_from_its_command_line(capsys):
    trace_script().main(["--loss", "sampled", "-m", "4"])
    out = capsys.readouterr().out
    assert "src/lst_lightning/spherical/negatives.py" in out and out.split()[1] == "files,"
