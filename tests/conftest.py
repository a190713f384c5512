import os
from pathlib import Path

import pytest
import torch

# Triton kernels run in the interpreter on CPU; set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Tests use tiny tensors: one thread avoids OpenMP spin-waits that cost more than the work
# (35x on a loaded 2-core machine).
torch.set_num_threads(1)


#: the longest files of the default suite, longest first (--durations on a 2-core CPU): run first,
#: so that xdist's workers end together (pyproject's --no-loadscope-reorder keeps this order, where
#: xdist would otherwise start with the files of most tests)
FIRST = ("spherical/test_compiled.py", "app/test_ddp.py", "spherical/test_batch_shapes.py",
         "spherical/test_step_reference.py", "app/test_resume.py", "spherical/test_nearly_singular.py",
         "integrations/test_hf.py", "spherical/test_multi_process.py")

_missing = [f for f in FIRST if not (Path(__file__).parent / f).is_file()]
if _missing:
    raise pytest.UsageError(f"tests/conftest.py FIRST names files that are not there: {_missing}")


def _order(item) -> int:
    path = item.nodeid.split("::")[0].removeprefix("tests/")
    return FIRST.index(path) if path in FIRST else len(FIRST)


def pytest_collection_modifyitems(config, items):
    """The longest files first (``FIRST``), each file's tests in their order. ``@pytest.mark.gpu``
    marks every CUDA-only test (``-m gpu`` selects them all); without a CUDA device they are
    skipped here, with one reason, instead of each test skipping itself."""
    items.sort(key=_order)
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_gpu)


def pytest_runtest_logreport(report):
    """With ``LST_REPORT_AT_ONCE`` set (the GPU suite, scripts/gpu_session.py), a failure's reason is
    printed when it happens, not only in the summary at the end: a run killed at its time limit
    still says why its tests failed."""
    if report.failed and os.environ.get("LST_REPORT_AT_ONCE"):
        print(f"\n[failed] {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext[-4000:]}",
              flush=True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
