"""``HostReads``: counts the reads of device values into Python that the project's own code
makes (on a GPU each is a host synchronisation: the host waits for every kernel queued).

Counted: a tensor turned into a Python value (``bool``, ``float``, ``int``, ``index``,
``item``, ``tolist``, ``numpy``, ``cpu``) where the frame that asks is a file of the package
(``src/lst_lightning``, ``triton_kernels/lst_kernels``), and an op whose output shape depends
on the data (``nonzero``, ``unique``, ``masked_select``: boolean indexing among them), asked
for from a frame of the package. Reads made by other libraries' code (Lightning's progress bar,
the HF Trainer's logging) are counted apart (``others``): the head is answerable for its own.
The data pipeline (``lst_lightning/data``) is left out: it reads the batch on the host, before
the batch moves to the device, where reading it costs no synchronisation.

On the CPU nothing waits, so a test counts what the same code would wait for on a GPU. So a
CPU kernel's own branch on a CPU value is not counted (``cpu_kernel``): the gated fold's
(``lst_kernels.torch_ops.fold_rows_``), whose CUDA kernel reads its flag on the device
(``fold_rows_kernel.py``; the gpu-marked tests run it under ``set_sync_debug_mode("error")``).
"""
from __future__ import annotations

import collections
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = (str(ROOT / "src" / "lst_lightning"), str(ROOT / "triton_kernels" / "lst_kernels"))
HOST_DATA = str(ROOT / "src" / "lst_lightning" / "data")
TORCH = str(Path(torch.__file__).parent)
CONVERSIONS = ("__bool__", "__float__", "__int__", "__index__", "item", "tolist", "numpy", "cpu")
DATA_SHAPED = ("aten::nonzero", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
               "aten::masked_select")


#: (file, function) of the CPU kernels that branch on a CPU value where their CUDA kernels read it on the device
CPU_KERNELS = {(str(ROOT / "triton_kernels" / "lst_kernels" / "torch_ops.py"), "fold_rows_")}


def cpu_kernel(t: torch.Tensor, frame) -> bool:
    """Whether ``frame`` reading ``t`` is a CPU kernel's branch on a CPU value (nothing waits)."""
    return (frame.f_code.co_filename, frame.f_code.co_name) in CPU_KERNELS and t.device.type == "cpu"


def by_file(sites: dict) -> collections.Counter:
    """``sites`` (``file:line`` -> reads, as ``HostReads.sites``) summed by file."""
    out: collections.Counter = collections.Counter()
    for site, n in sites.items():
        out[site.rsplit(":", 1)[0]] += n
    return out


def _ours(filename: str) -> bool:
    return filename.startswith(PACKAGE) and not filename.startswith(HOST_DATA)


class HostReads(TorchDispatchMode):
    """``with HostReads() as reads: ...``; then ``reads.count`` (the package's reads),
    ``reads.sites`` (a Counter of ``file:line`` for each) and ``reads.others``."""

    def __init__(self):
        super().__init__()
        self.count = self.others = 0
        self.sites: collections.Counter = collections.Counter()
        self._saved = {}

    def _note(self, filename: str, lineno: int) -> None:
        if _ours(filename):
            self.count += 1
            self.sites[f"{Path(filename).relative_to(ROOT)}:{lineno}"] += 1
        elif not filename.startswith(HOST_DATA):
            self.others += 1

    def __enter__(self):
        for name in CONVERSIONS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def counted(t, *args, _original=original, **kwargs):
                caller = sys._getframe(1)
                if caller.f_code.co_filename.startswith(TORCH):  # torch's own wrapper (Tensor.__format__...)
                    caller = caller.f_back
                if cpu_kernel(t, caller):
                    return _original(t, *args, **kwargs)
                self._note(caller.f_code.co_filename, caller.f_lineno)
                return _original(t, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in DATA_SHAPED:
            frame = next((f for f in reversed(traceback.extract_stack()) if not f.filename.startswith(TORCH)
                          and f.filename != __file__), None)
            if frame is not None:
                self._note(frame.filename, frame.lineno)
        return func(*args, **(kwargs or {}))
