"""The head's math in its own precision, whatever the caller's: its state dtype (autocast off)
and full float32 matrix products unless the head opts in to TensorFloat-32 (``tf32``)."""
from __future__ import annotations

import contextlib
import functools

import torch


@contextlib.contextmanager
def own_math(device_type: str, tf32: bool = False):
    """Autocast off (bf16/fp16 mixed precision) and float32 matrix products in full float32
    ("highest") unless ``tf32``: a loop's ``torch.set_float32_matmul_precision("high")``, common in
    LM training, would otherwise round every product of the exact step to 10 bits (TF32 on a GPU)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        # the meta device has no autocast: a head left there reaches its own refusal (base.prepare)
        with torch.autocast(device_type, enabled=False) if device_type != "meta" else contextlib.nullcontext():
            yield
    finally:
        torch.set_float32_matmul_precision(previous)


def own_precision(method):
    """Run a head method in the head's own math (``own_math``): its state dtype and its matrix
    products' precision, whatever the caller's autocast or float32 matmul precision."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with own_math(self.device.type, self.tf32):
            return method(self, *args, **kwargs)
    return wrapped
