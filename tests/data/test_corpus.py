"""The split of a corpus without split files: whole documents, each part about its share of the words."""
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
