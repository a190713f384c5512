"""The n-gram body's settings: a width that builds no working body is refused in one line."""
import pytest
import torch

from lst_lightning.models import NgramMLP


@pytest.mark.parametrize("setting, value, match", [
    ("embed_dim", 0, "embed_dim must be a positive int, got 0"),
    ("hidden_sizes", [256, 0], r"hidden_sizes must be a positive int each, got \[256, 0\]"),
    ("hidden_sizes", 256, "hidden_sizes must be a list of positive ints, got 256"),
    ("hidden_dim", 0, "hidden_dim must be a positive int"),
    ("dropout", -0.1, r"dropout must be a probability in \[0, 1\)"),
])
def test_a_setting_that_builds_no_working_body_is_refused_in_one_line(setting, value, match):
    """``hidden_sizes=[0]`` built a layer of width 0, whose output is its bias whatever the tokens,
    and lst-train trained it."""
    kw = dict(vocab_size=30, context_size=3, embed_dim=4, hidden_sizes=[8], hidden_dim=5)
    with pytest.raises(ValueError, match=match) as e:
        NgramMLP(**{**kw, setting: value})
    assert "\n" not in str(e.value)
    assert NgramMLP(**{**kw, "hidden_sizes": []})(torch.zeros(2, 3, dtype=torch.long)).shape == (2, 5)
