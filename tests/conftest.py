import os

import pytest
import torch

# Triton kernels run in the interpreter on CPU; set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Tests use tiny tensors: one thread avoids OpenMP spin-waits that cost more than the work
# (35x on a loaded 2-core machine).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
