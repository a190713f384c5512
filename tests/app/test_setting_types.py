"""app/setting_types.py: a data setting of the wrong type is refused in one line naming its key."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from lst_lightning.app.setting_types import check_setting_types
from lst_lightning.data import TextDataModule


@pytest.mark.parametrize("key,value,want", [
    ("vocab_size", "abc", "data.vocab_size='abc': must be an int or null"),
    ("pad_start", 3, "data.pad_start=3: must be true or false"),
    ("context_size", True, "data.context_size=True: must be an int"),
    ("val_fraction", "x", "data.val_fraction='x': must be a number"),
])
def test_a_value_of_the_wrong_type_names_its_key(key, value, want):
    section = OmegaConf.create({"_target_": "x", "vocab_size": 100, "val_fraction": 0.1, key: value})
    with pytest.raises(ValueError) as err:
        check_setting_types(section, TextDataModule, "data")
    assert str(err.value) == want


def test_values_of_the_right_type_pass():
    section = OmegaConf.create({"_target_": "x", "vocab_size": None, "val_fraction": 1, "path": ["a.txt"],
                                "pad_start": False, "tokenizer": "words"})
    check_setting_types(section, TextDataModule, "data")
