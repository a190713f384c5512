"""The vocabulary (vocab.py): ids by frequency with <unk>, a round trip through its file, the tokenizer."""
import pytest
import torch

from lst_lightning.data import Vocabulary
from lst_lightning.data.vocab import UNK, tokenize


def test_vocab_sorted_by_frequency_with_unk():
    docs = [["b", "a", "a", "c", "a", "b", "d"], ["a", "e"]]
    v = Vocabulary.build(docs, max_size=3)
    # kept: a (4), b (2); everything else is <unk> (c, d, e: 3)
    assert v.words == ["a", UNK, "b"]
    assert v.counts.tolist() == [4, 3, 2]
    assert (v.counts[:-1] >= v.counts[1:]).all()
    assert v.encode(["a", "zzz", "b"]) == [0, 1, 2]



def test_vocab_min_count_and_round_trip(tmp_path):
    v = Vocabulary.build([["x"] * 3 + ["y"] * 2 + ["z"]], min_count=2)
    assert "z" not in v.index and v.counts[v.unk_id] == 1
    v.save(tmp_path / "v.json")
    w = Vocabulary.load(tmp_path / "v.json")
    assert w.words == v.words and torch.equal(w.counts, v.counts)



def test_vocab_larger_than_corpus_is_an_error():
    with pytest.raises(ValueError, match="larger than the corpus"):
        Vocabulary.build([["a", "b", "c"]], max_size=100)



def test_tokenizer():
    assert tokenize("The cat's 3 hats, isn't it?") == ["the", "cat's", "hats", "isn't", "it"]
    assert tokenize("a <unk> b", "whitespace") == ["a", "<unk>", "b"]
    with pytest.raises(ValueError, match="tokenizer"):
        tokenize("x", "bpe")
