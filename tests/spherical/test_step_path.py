"""One step, one path: a training step of the factored head with a spherical loss (the
Z-loss) (``head(H, idx).backward()``, traced by scripts/trace_step.py after a warm-up step)
enters at most 8 project files and 39 functions: the input check, the loss, the head's shell
and its step (base.py, exact_step.py), its host driver with its device flags, compiled or eager
(driver.py), its precision (precision.py) and the kernel ops, called unchecked as the plan chose
them (``plan.kernels``: on the CPU torch_ops.py's and the references); not the head's class
(factored.py): the step reads the head's plan and settings as data.
Processes, pending rows and the repairs are not entered when they have nothing to do.

The step's device part (below driver.py's ``run``: ``forward`` and ``update``, ``device_step``'s
halves) branches on its plan, never on tensors' values: its write is masked by its device flags
on every device, eager or compiled; only the CPU's fold of the kernel ops reads its flag
(``fold_rows_``: on CUDA a Triton kernel reads it on the device)."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_FILES, MAX_FUNCTIONS = 8, 39
#: the device part's (functions, branches), the step's own (src/) and the kernel ops'
#: (triton_kernels/), as scripts/trace_step.py counts them, by loss
DEVICE_PART = {"zloss": ((16, 10), (8, 5)), "sampled": ((31, 15), (9, 6))}
EXACT_STEP = "src/lst_lightning/spherical/exact_step.py"
_traces: dict = {}


def trace_script():
    spec = importlib.util.spec_from_file_location("trace_step", ROOT / "scripts" / "trace_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def traced(loss: str = "zloss"):
    """(the step's path, its device part, the device part's branches), traced once a loss."""
    if loss not in _traces:
        script, device = trace_script(), {}
        path = script.default_step_path(loss=loss, device=device)
        _traces[loss] = path, device, script.device_branches(device)
    return _traces[loss]


@pytest.fixture(scope="module")
def path():
    return traced()[0]


def test_the_default_step_enters_at_most_8_files_and_39_functions(path):
    kernel_files = sorted(f for f in path if "/lst_kernels/" in f)
    assert kernel_files == ["triton_kernels/lst_kernels/reference.py", "triton_kernels/lst_kernels/torch_ops.py"]
    functions = sum(len(v) for v in path.values())
    assert len(path) <= MAX_FILES and functions <= MAX_FUNCTIONS, path


def test_the_head_side_of_the_default_step_is_its_shell_its_step_and_its_flags(path):
    """Outside the kernel ops (2 files: the CPU's, torch_ops.py and the references) and the loss
    and input check, the step enters four files of the head, in at most 39 - 7 functions."""
    head_side = {f: names for f, names in path.items() if "/lst_kernels/" not in f}
    spherical = sorted(f for f in head_side if "/spherical/" in f)
    assert spherical == [f"src/lst_lightning/spherical/{name}.py"
                         for name in ("base", "driver", "exact_step", "precision")], sorted(head_side)
    assert len(head_side) <= MAX_FILES - 2
    assert sum(len(v) for v in head_side.values()) <= MAX_FUNCTIONS - 7, head_side


def test_the_default_losss_step_enters_at_most_12_files_and_57_functions():
    """lst-train's default, loss=sampled: the spherical step above plus the draw (negatives.py,
    the sampler), the composite loss, the target slots and the right preconditioner (its step,
    the write of its moments)."""
    path = traced("sampled")[0]
    assert {"src/lst_lightning/spherical/negatives.py", "src/lst_lightning/losses/sampled_composite.py",
            "src/lst_lightning/heads/preconditioner.py"} <= set(path)
    assert len(path) <= 12 and sum(len(v) for v in path.values()) <= 57, path


@pytest.mark.parametrize("loss", ["zloss", "sampled"])
def test_the_device_part_enters_at_most_its_functions_and_branches(loss):
    _, device, branches = traced(loss)
    for part, (functions, most) in zip(("src/", "triton_kernels/"), DEVICE_PART[loss]):
        mine = [b for b in branches if b.file.startswith(part)]
        assert sum(1 for key in device["codes"] if key[0].startswith(part)) <= functions, sorted(device["codes"])
        assert len(mine) <= most, "\n".join(map(str, mine))
    assert not {key[1] for key in device["codes"]} & {"before_step", "run_device_part", "step_state"}  # the host's


@pytest.mark.parametrize("loss", ["zloss", "sampled"])
def test_the_device_part_branches_on_tensors_values_only_in_the_cpus_fold(loss):
    """The step itself branches on its plan alone, its write masked by its device flags eager as
    compiled; the kernel ops' fold on the CPU reads its flag (on CUDA a Triton kernel, compiled an
    opaque op)."""
    values = [(b.file, b.function, b.test) for b in traced(loss)[2] if b.on == "values"]
    assert values == [("triton_kernels/lst_kernels/torch_ops.py", "fold_rows_", "not bool(flag)")]


def test_a_branch_on_a_tensor_read_on_the_host_is_classed_by_its_test_or_by_the_trace(tmp_path):
    """A conversion in the test, or of a name the test reads, is on tensors' values; so is a test
    during which the trace saw a tensor read on the host (``reads``: its lines), an ``if x.any():``."""
    source = tmp_path / "step.py"
    source.write_text("def step(plan, x, grad=None):\n"
                      "    y = bool(x.any())\n"
                      "    if plan.flag:\n"
                      "        x = x + 1\n"
                      "    if y:\n"
                      "        x = x * 2\n"
                      "    z = x if grad is None else grad\n"
                      "    if x.any():\n"
                      "        z = [v for v in z if v.shape[0]]\n"
                      "    return z, plan.flag or grad\n")
    spec = importlib.util.spec_from_file_location("step", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    code = module.step.__code__
    device = {"codes": {("step.py", "step", 1): code}, "reads": {"step.py": {8}}}
    branches = trace_script().device_branches(device)
    assert [(b.line, b.kind, b.on) for b in branches] == [
        (3, "if", "plan"), (5, "if", "values"), (7, "if-else", "plan"), (8, "if", "values"), (10, "and/or", "plan")]
    assert branches[0].note == "plan/settings" and branches[2].note == "optional"


def test_the_script_traces_either_loss_from_its_command_line(capsys):
    trace_script().main(["--loss", "sampled", "-m", "4"])
    out = capsys.readouterr().out
    assert "src/lst_lightning/spherical/negatives.py" in out and out.split()[1] == "files,"
    assert "device part: " in out and f"{EXACT_STEP}:" in out
