"""The vocabulary (vocab.py): ids by frequency with <unk>, a round trip through its file, the tokenizer."""
import pytest
import torch

from lst_lightning.data import Vocabulary
from lst_lightning.data.vocab import BOS, MARK, UNK, tokenize


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
    assert tokenize("a <b> c", "whitespace") == ["a", "<b>", "c"]
    # spelled like the vocabulary's own <unk> and <s> (wikitext's literal <unk>): a class of its own, marked
    assert tokenize("a <unk> <s> b", "whitespace") == ["a", MARK + UNK, MARK + BOS, "b"]
    with pytest.raises(ValueError, match="tokenizer"):
        tokenize("x", "bpe")


def _reference(docs, max_size, min_count, extra):
    """The vocabulary's rule written out: the most frequent words (ties by word) seen at least
    min_count times, <unk> with the count of the rest, the specials with count 1, all
    sorted by decreasing count, ties kept in that order."""
    counts = {}
    for d in docs:
        for w in d:
            counts[w] = counts.get(w, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    keep = len(ranked) if max_size is None else max_size - 1 - len(extra)
    kept = [(w, c) for w, c in ranked[:keep] if c >= min_count]
    items = kept + [(UNK, max(sum(counts.values()) - sum(c for _, c in kept), 1))] + [(t, 1) for t in extra]
    items.sort(key=lambda kv: -kv[1])
    return [w for w, _ in items], [c for _, c in items]


@pytest.mark.parametrize("seed", range(6))
def test_vocab_follows_its_rule(seed):
    g = torch.Generator().manual_seed(seed)
    words = [f"w{i}" for i in range(40)]
    docs = [[words[int(i)] for i in torch.randint(0, 1 + int(torch.randint(1, 40, (1,), generator=g)), (30,),
                                                   generator=g)] for _ in range(5)]
    distinct = len({w for d in docs for w in d})
    for max_size in [None, 2, 5, distinct // 2 + 2, distinct + 1]:
        for min_count, extra in [(1, ()), (3, ()), (1, ("<s>",)), (5, ("<s>", "<pad>"))]:
            if max_size is not None and max_size < 2 + len(extra):
                continue
            v = Vocabulary.build(docs, max_size, min_count, extra)
            assert (v.words, v.counts.tolist()) == _reference(docs, max_size, min_count, extra)


@pytest.mark.parametrize("tokenizer", ["whitespace", "hf"])
def test_a_corpus_that_spells_unk_and_s_builds_its_vocabulary(tmp_path, monkeypatch, tokenizer):
    """wikitext holds the literal ``<unk>``; a tokenizer.json's special pieces (``<unk>``, ``<s>``)
    turn up in code and web text. Each was a second ``<unk>`` (or ``<s>``) beside the vocabulary's own,
    and the vocabulary refused to build ("words must be unique"): now a class of its own, marked."""
    from lst_lightning.data import TextDataModule

    monkeypatch.setenv("LST_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "c.txt"
    path.write_text("\n\n".join(f"the <unk> sat on <s> mat {i} today" for i in range(80)))
    if tokenizer == "hf":
        tokenizers = pytest.importorskip("tokenizers")
        tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
        trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>"])
        tok.train_from_iterator([path.read_text()], trainer)
        tok.save(str(tmp_path / "tokenizer.json"))
        tokenizer = str(tmp_path / "tokenizer.json")
    dm = TextDataModule("files", path=str(path), tokenizer=tokenizer, vocab_size=None, min_doc_tokens=1,
                        context_size=2, pad_start=True, batch_size=8)
    dm.setup()
    words = dm.vocab.words
    assert len(set(words)) == len(words) and {UNK, BOS, MARK + UNK, MARK + BOS} <= set(words)
