"""A command line that does not compose, in one line: Hydra's own exceptions (composed here,
in-process) turned into the line lst-train prints; Hydra raising them only while it composes."""
import os

import pytest
from hydra.errors import HydraException

from lst_lightning.app.composition import FULL_ERROR, composed, composition_message, raising
from lst_lightning.app.errors import bad_input_message

from app_configs import cfg_of, group


def message(*overrides) -> str:
    with pytest.raises(HydraException) as info:
        cfg_of(*overrides)
    text = bad_input_message(info.value)
    assert text is not None and "\n" not in text, text
    return text


def test_an_option_a_group_does_not_have_names_the_groups_choices():
    text = message("head=nosuch")
    assert text.startswith("head=nosuch: head has no option nosuch; the choices are ")
    assert text.endswith(", ".join(group("head")))
    assert "search path" not in text


def test_a_near_option_is_suggested():
    assert "did you mean trainer=gpu?" in message("trainer=gpux")


def test_an_experiment_that_does_not_exist_is_refused():
    """The experiment group is not optional: a misspelt experiment is no silent default run."""
    assert message("experiment=tinyy").startswith("experiment=tinyy: experiment has no option tinyy; "
                                                  "did you mean experiment=tiny?")


def test_a_key_the_config_does_not_have_names_the_nearest_and_how_to_add_it():
    assert message("data.batch_sise=3") == ("data.batch_sise=3: data has no key batch_sise; did you mean "
                                            "data.batch_size? (+data.batch_sise=3 adds it as a new key)")
    assert message("heads=naive").startswith("heads=naive: the config has no key heads; did you mean head?")


def test_a_key_with_no_near_one_lists_the_keys_there_are():
    text = message("head.zzzz=1")
    assert text.startswith("head.zzzz=1: head has no key zzzz; head has ") and "sync_every" in text


@pytest.mark.parametrize("override,match", [
    ("head.bias=abc", "head.bias=abc: Value 'abc' is not a valid bool"),
    ("data.batch_size=[1,", "data.batch_size=[1,: no viable alternative"),
    ("~data.nosuch", "'data.nosuch' does not exist"),
])
def test_hydras_other_refusals_are_one_line(override, match):
    assert match in message(override)


def test_other_errors_are_not_hydras_to_word():
    assert composition_message(ValueError("x")) is None


def test_hydra_raises_only_while_composing(monkeypatch):
    monkeypatch.delenv(FULL_ERROR, raising=False)
    with raising():
        assert os.environ[FULL_ERROR] == "1"
        composed()  # the task function's first call: its errors are Hydra's to report
        assert FULL_ERROR not in os.environ
    assert FULL_ERROR not in os.environ


@pytest.mark.parametrize("given", ["0", "1"])
def test_the_users_full_error_stands(monkeypatch, given):
    monkeypatch.setenv(FULL_ERROR, given)
    with raising():
        composed()
        assert os.environ[FULL_ERROR] == given
    assert os.environ[FULL_ERROR] == given
