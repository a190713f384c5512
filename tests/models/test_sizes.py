"""The bodies' sizes and dropout refused in one line naming model.<key> when a body is built
(models/sizes.py): torch's errors named no setting (a zero num_heads: a ZeroDivisionError; a zero
width: a layer built with a warning only)."""
import pytest

from lst_lightning.models import GPT, LSTMBody, NgramMLP
from lst_lightning.models.sizes import check_sizes


@pytest.mark.parametrize("body,key,value,match", [
    (GPT, "num_heads", 0, r"^model\.num_heads=0: must be a whole number >= 1$"),
    (GPT, "mlp_ratio", -1, r"^model\.mlp_ratio=-1"),
    (NgramMLP, "hidden_dim", 0, r"^model\.hidden_dim=0: must be a whole number >= 1$"),
    (NgramMLP, "hidden_sizes", [64, 0], r"^model\.hidden_sizes=\[64, 0\]: must be a list of whole numbers >= 1$"),
    (NgramMLP, "embed_dim", 2.5, r"^model\.embed_dim=2\.5"),
    (LSTMBody, "num_layers", 0, r"^model\.num_layers=0"),
    (LSTMBody, "dropout", 1.0, r"^model\.dropout=1\.0: must be a number in \[0, 1\)$"),
    (NgramMLP, "dropout", float("nan"), r"^model\.dropout=nan"),
])
def test_a_bad_size_is_refused_naming_its_key(body, key, value, match):
    with pytest.raises(ValueError, match=match):
        body(vocab_size=10, context_size=3, **{key: value})


def test_good_sizes_pass():
    check_sizes(0.0, embed_dim=1, hidden_sizes=[], hidden_dim=8)  # no hidden layer: a list may be empty
    check_sizes(0.5, hidden_sizes=(4, 4))
