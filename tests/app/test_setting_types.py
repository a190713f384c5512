"""app/setting_types.py: a data setting of the wrong type is refused in one line naming its key."""
from __future__ import annotations

import inspect

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


def test_the_data_settings_the_docs_name_are_keys_of_the_text_corpora():
    """docs/app.md's ``data.source=hub data.name=... data.subset=...`` and corpora.md's
    ``data.min_doc_tokens`` compose without a ``+``, at the data module's defaults."""
    from app_configs import cfg_of  # noqa: PLC0415

    cfg = cfg_of("data.source=hub", "data.name=wikitext", "data.subset=wikitext-103-raw-v1",
                 "data.text_column=text", "data.min_doc_tokens=5")
    assert (cfg.data.name, cfg.data.subset, cfg.data.min_doc_tokens) == ("wikitext", "wikitext-103-raw-v1", 5)
    check_setting_types(cfg.data, TextDataModule, "data")
    defaults, code = cfg_of().data, inspect.signature(TextDataModule).parameters
    for key in ("name", "subset", "text_column", "min_doc_tokens"):
        assert defaults[key] == code[key].default, key
