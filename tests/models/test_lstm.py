"""The recurrent body's settings: each refused in one line naming its setting, not torch's name."""
import pytest

from lst_lightning.models import LSTMBody


@pytest.mark.parametrize("setting, value, match", [
    ("lstm_size", 0, "lstm_size must be a positive int, got 0"),  # torch: "hidden_size must be greater than zero"
    ("num_layers", 0, "num_layers must be a positive int"),
    ("embed_dim", 0, "embed_dim must be a positive int"),
    ("dropout", 2, r"dropout must be a probability in \[0, 1\)"),
])
def test_a_bad_setting_is_refused_in_one_line_naming_it(setting, value, match):
    with pytest.raises(ValueError, match=match) as e:
        LSTMBody(**{**dict(vocab_size=30, context_size=3, embed_dim=4, lstm_size=6, hidden_dim=5), setting: value})
    assert "\n" not in str(e.value)
