"""The machine's name as runs and benchmark files give it: the GPU's name, or the CPU's
model and core count (``AMD-EPYC-2cores``). Torch and the standard library only, so the
benchmark scripts use it on a machine without the app's frameworks."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def machine_name(gpu: bool | None = None) -> str:
    """The GPU's name when ``gpu`` (default: whether CUDA is available), else the CPU's."""
    if gpu if gpu is not None else torch.cuda.is_available():
        return torch.cuda.get_device_name().replace(" ", "-")
    model = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model.replace(' ', '-')}-{os.cpu_count()}cores"
