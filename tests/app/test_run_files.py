"""A run directory's results.json and config.yaml read back (run_files.py): a file that does not
parse, or holds no mapping, is refused in one line naming it."""
import pytest

from lst_lightning.app.run_files import read_config, read_results


@pytest.mark.parametrize("text,match", [
    ('{"name": ', r"results\.json does not parse: Expecting value"),  # cut short
    ("[1, 2]", r"results\.json holds a list, not a mapping"),
])
def test_a_results_file_that_is_no_mapping_is_named(tmp_path, text, match):
    (tmp_path / "results.json").write_text(text)
    with pytest.raises(ValueError, match=rf"^{tmp_path}/{match}[^\n]*$"):
        read_results(tmp_path / "results.json")


@pytest.mark.parametrize("data,match", [
    (b"a: [\n", r"config\.yaml does not parse: expected the node content.*: line 2, column 1$"),
    (b"\xff\xfe", r"config\.yaml does not parse: 'utf-8' codec"),
    (b"- 1\n", r"config\.yaml holds a list, not a mapping"),
])
def test_a_config_that_is_no_mapping_is_named(tmp_path, data, match):
    (tmp_path / "config.yaml").write_bytes(data)
    with pytest.raises(ValueError, match=rf"^{tmp_path}/{match}[^\n]*$"):
        read_config(tmp_path / "config.yaml")


def test_the_files_lst_train_writes_read_back(tmp_path):
    (tmp_path / "results.json").write_text('{"name": "r", "test": {"mrr": 0.5}}')
    (tmp_path / "config.yaml").write_text("")
    assert read_results(tmp_path / "results.json") == {"name": "r", "test": {"mrr": 0.5}}
    assert read_config(tmp_path / "config.yaml") == {}
