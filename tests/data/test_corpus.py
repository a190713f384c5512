"""The split of a corpus without split files: whole documents, each part about its share of the words."""
import json

import pytest

from lst_lightning.data.corpus import load_corpus


def _words(ds) -> int:
    return sum(len(t.split()) for t in ds["text"])


def _split(tmp_path, paragraphs: list[str], seed: int):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(paragraphs))
    return load_corpus("files", path=str(path), sample_by="paragraph", seed=seed)


@pytest.mark.parametrize("seed", range(20))
def test_one_long_document_does_not_swell_a_held_out_part(tmp_path, seed):
    """200 paragraphs of 10 words and one of 4 000 (a long table among prose): the long one would
    take validation or test to half the corpus; it stays in training, and each part keeps about 5 %."""
    paragraphs = [" ".join(f"w{i}_{j}" for j in range(10)) for i in range(200)]
    paragraphs.insert(77, " ".join(f"cell{j}" for j in range(4000)))
    dd = _split(tmp_path, paragraphs, seed)
    total = sum(_words(dd[s]) for s in dd)
    assert total == 6000
    assert sum(len(dd[s]) for s in dd) == 201  # every document once
    assert any(len(t.split()) == 4000 for t in dd["train"]["text"])
    for part in ("validation", "test"):
        assert 0.05 * total <= _words(dd[part]) <= 0.05 * total + 10  # its share, overshot by one paragraph


def test_documents_all_longer_than_a_share_give_each_part_the_smallest(tmp_path):
    """Four documents, none within twice the 5 % share: validation and test each get one whole
    document (the smallest left), training the rest; no part is empty."""
    paragraphs = [" ".join(f"d{i}_{j}" for j in range(n)) for i, n in enumerate((300, 100, 200, 400))]
    dd = _split(tmp_path, paragraphs, seed=0)
    sizes = {s: sorted(len(t.split()) for t in dd[s]["text"]) for s in dd}
    assert sizes == {"validation": [100], "test": [200], "train": [300, 400]}


def _jsonl(path, n: int, column: str = "text"):
    path.write_text("\n".join(json.dumps({column: " ".join(f"w{i}_{j}" for j in range(20)), "id": i})
                              for i in range(n)))
    return str(path)


def test_a_local_jsonl_file_is_split_as_the_files_are(tmp_path):
    """``data=hub data.name=json data.path=corpus.jsonl``: one file is one train split; validation
    and test are carved from it by document, about 5 % of the words each, every document once."""
    dd = load_corpus("hub", name="json", path=_jsonl(tmp_path / "corpus.jsonl", 400), seed=0)
    assert {s: len(dd[s]) for s in dd} == {"train": 360, "validation": 20, "test": 20}
    assert dd["train"].column_names == ["text"]
    assert len({t for s in dd for t in dd[s]["text"]}) == 400


def test_a_split_the_dataset_gives_is_kept_and_the_missing_one_carved(tmp_path):
    given = {"train": _jsonl(tmp_path / "train.jsonl", 200), "test": _jsonl(tmp_path / "test.jsonl", 7)}
    dd = load_corpus("hub", name="json", path=given, seed=0)
    assert {s: len(dd[s]) for s in dd} == {"train": 190, "validation": 10, "test": 7}


def test_a_text_column_the_dataset_lacks_names_the_columns(tmp_path):
    path = _jsonl(tmp_path / "corpus.jsonl", 10, column="content")
    with pytest.raises(ValueError, match=r"^data\.text_column='text' is not a column of 'json': name one of "
                                         r"\['content', 'id'\]$"):
        load_corpus("hub", name="json", path=path)
    assert load_corpus("hub", name="json", path=path, text_column="content")["train"].column_names == ["text"]


def test_a_text_column_of_numbers_is_refused_naming_the_text_columns(tmp_path):
    path = _jsonl(tmp_path / "corpus.jsonl", 10)
    with pytest.raises(ValueError, match=r"^data\.text_column='id' of 'json' holds int64 values, not text: name one "
                                         r"of \['text'\]$"):
        load_corpus("hub", name="json", path=path, text_column="id")


@pytest.mark.parametrize("documents", [1, 2])
def test_too_few_documents_to_split_name_the_fixes(tmp_path, documents):
    """A file of one paragraph (one sentence a line, no blank line) cannot give three splits of
    whole documents: one line naming ``data.sample_by=line`` and split files, not an empty split."""
    with pytest.raises(ValueError, match=rf"^{documents} document\(s\) cannot be split .*data\.sample_by=line .*\}}\)$"):
        _split(tmp_path, [" ".join(f"w{i}_{j}" for j in range(50)) for i in range(documents)], seed=0)


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    (tmp_path / "a.txt").write_text("the cat sat on the mat\n\n" * 10)
    (tmp_path / "b.txt").write_bytes("caf\xe9 na\xefve\n\n".encode("latin-1") * 10)
    with pytest.raises(ValueError, match=r"^data\.path: .*b\.txt is not UTF-8 text \(.*\): convert it, e\.g\. iconv"):
        load_corpus("files", path=str(tmp_path))


def test_a_split_given_is_kept_and_only_the_missing_one_carved(tmp_path):
    """``data.path={train: .., validation: ..}``: the validation file is validation, whole, and test
    is carved from train (the given validation was dropped and both carved from train)."""
    (tmp_path / "train.txt").write_text("\n\n".join(" ".join(f"t{i}_{j}" for j in range(20)) for i in range(100)))
    (tmp_path / "val.txt").write_text("\n\n".join(" ".join(f"v{i}_{j}" for j in range(20)) for i in range(7)))
    dd = load_corpus("files", path={"train": str(tmp_path / "train.txt"), "validation": str(tmp_path / "val.txt")})
    assert {s: len(dd[s]) for s in dd} == {"train": 95, "validation": 7, "test": 5}
    assert all(t.startswith("v") for t in dd["validation"]["text"])
    assert all(t.startswith("t") for s in ("train", "test") for t in dd[s]["text"])


def test_the_split_rule_is_in_the_token_caches_key(tmp_path, monkeypatch):
    """A corpus tokenised under another rule of the split is not read back under this one."""
    from lst_lightning.data import sources
    from lst_lightning.data.tokens import cache_key

    (tmp_path / "c.txt").write_text("some words here\n\nand more words there\n")
    source = sources.CorpusSource({"source": "files", "path": str(tmp_path / "c.txt")})
    key = cache_key(source, "words", None)
    monkeypatch.setattr(sources, "SPLIT_RULE", sources.SPLIT_RULE + 1)
    assert cache_key(source, "words", None) != key


def test_data_files_that_do_not_exist_name_data_path(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match=r"^data\.path='.*nope\.jsonl' \(the data files of data\.name='json'\): "):
        load_corpus("hub", name="json", path=missing)


def test_a_malformed_data_file_is_refused_in_one_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a b c"}\n{"text": "d e\n')
    with pytest.raises(ValueError, match=r"^data\.name='json' data\.path='.*bad\.jsonl': datasets could not read it "
                                         r"\(JSON parse error: [^\n]*\)$"):
        load_corpus("hub", name="json", path=str(path))
