"""data.path's text files, checked with pathlib before any corpus is read."""
import pytest

from lst_lightning.data.files import text_files


def test_a_file_a_directory_a_list_and_splits(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    for name in ("a.txt", "d/b.txt", "d/sub/c.txt"):
        (tmp_path / name).write_text("some words\n")
    (tmp_path / "d" / "notes.md").write_text("not a corpus\n")
    a, b, c = (str(tmp_path / n) for n in ("a.txt", "d/b.txt", "d/sub/c.txt"))
    assert text_files(a) == {"train": [a]}
    assert text_files(str(tmp_path / "d")) == {"train": [b, c]}
    assert text_files([a, str(tmp_path / "d")]) == {"train": [a, b, c]}
    assert text_files({"train": [a, b], "validation": c, "test": c}) == {"train": [a, b], "validation": [c],
                                                                         "test": [c]}


def test_a_glob_takes_the_files_it_matches_in_order(tmp_path):
    """Files that are not .txt (a folder of Markdown) by a glob, ``**`` recursive, in a list or a split."""
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    for name in ("docs/b.md", "docs/a.md", "docs/sub/c.md", "docs/skip.txt"):
        (tmp_path / name).write_text("some words\n")
    a, b, c = (str(tmp_path / n) for n in ("docs/a.md", "docs/b.md", "docs/sub/c.md"))
    assert text_files(str(tmp_path / "docs" / "*.md")) == {"train": [a, b]}
    assert text_files(str(tmp_path / "docs" / "**" / "*.md")) == {"train": [a, b, c]}
    assert text_files({"train": str(tmp_path / "docs" / "*.md"), "test": c}) == {"train": [a, b], "test": [c]}
    with pytest.raises(FileNotFoundError, match=r"data.path: the pattern .*\*.rst matches no file"):
        text_files(str(tmp_path / "docs" / "*.rst"))


def test_bad_paths_name_data_path(tmp_path):
    (tmp_path / "blank.txt").write_text(" \n\n\t\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "ok.txt").write_text("words\n")
    with pytest.raises(FileNotFoundError, match=r"data.path: .*missing.txt not found"):
        text_files([str(tmp_path / "ok.txt"), str(tmp_path / "missing.txt")])
    with pytest.raises(ValueError, match=r"data.path: .*blank.txt is empty"):
        text_files(str(tmp_path / "blank.txt"))
    with pytest.raises(FileNotFoundError, match="holds no .txt files"):
        text_files(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="data.path.validation names no files"):
        text_files({"train": str(tmp_path / "ok.txt"), "validation": []})
    with pytest.raises(ValueError, match="data.path is not set"):
        text_files(None)
    for splits in ({"validation": str(tmp_path / "ok.txt")}, {"train": str(tmp_path / "ok.txt"), "dev": str(tmp_path / "ok.txt")}):
        with pytest.raises(ValueError, match=r"^data\.path's splits are train \(needed\), validation and test, got "):
            text_files(splits)


def test_text_after_a_megabyte_of_blanks_counts(tmp_path):
    f = tmp_path / "late.txt"
    f.write_text(" " * (1 << 20) + "\n" * 10 + "word\n")
    assert text_files(str(f)) == {"train": [str(f)]}
