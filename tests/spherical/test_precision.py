"""The head's math in its own precision (precision.py): its step runs its float32 matrix
products in full float32 whatever the loop's ``torch.set_float32_matmul_precision`` (TF32 on a
GPU would round each to 10 bits), unless the head opts in (``tf32=True``); the loop's setting is
given back after each call."""
import pytest
import torch

from lst_lightning.spherical import FactoredSphericalHead, NaiveSphericalHead, exact_step


@pytest.mark.parametrize("tf32", [False, True])
def test_the_step_sets_its_own_matmul_precision_and_gives_the_loops_back(monkeypatch, tf32):
    seen = []
    hidden_grad = exact_step.hidden_grad

    def spy(*a, **k):
        seen.append(torch.get_float32_matmul_precision())
        return hidden_grad(*a, **k)

    monkeypatch.setattr(exact_step, "hidden_grad", spy)
    head = FactoredSphericalHead(50, 4, tf32=tf32)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # a loop's TF32, as LM training scripts set it
    try:
        head(torch.randn(3, 4, requires_grad=True), torch.tensor([1, 2, 3])).backward()
        head.step = "fused"
        head.train_step(torch.randn(3, 4), torch.tensor([1, 2, 3]))
        assert seen == ["high" if tf32 else "highest"] * 2
        assert torch.get_float32_matmul_precision() == "high"  # the loop's own, given back
    finally:
        torch.set_float32_matmul_precision(previous)


def test_tf32_is_a_bool_on_both_heads():
    for cls in (FactoredSphericalHead, NaiveSphericalHead):
        assert cls(50, 4).tf32 is False
        with pytest.raises(ValueError, match="tf32 must be a bool"):
            cls(50, 4, tf32="yes")
