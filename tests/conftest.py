import os

import pytest
import torch

# Triton kernels run in the interpreter on CPU; set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Tests use tiny tensors: one thread avoids OpenMP spin-waits that cost more than the work
# (35x on a loaded 2-core machine).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` marks every CUDA-only test (``-m gpu`` selects them all); without a
    CUDA device they are skipped here, with one reason, instead of each test skipping itself."""
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
