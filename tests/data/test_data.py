"""Data: vocabulary order, n-gram windows against a slow loop, the epoch sampler,
the synthetic task, the embedded corpus split, and bad-input errors."""
import pytest
import torch

from lst_lightning.data import SyntheticDataModule, TextDataModule, Vocabulary
from lst_lightning.data.ngram import EpochBatchSampler, NgramWindows
from lst_lightning.data.synthetic import SyntheticZipf, zipf_counts
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


@pytest.mark.parametrize("bos", [None, 99])
def test_ngram_windows_match_a_loop(bos):
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 50, (int(n),), generator=g).tolist() for n in [7, 2, 0, 4, 12, 3]]
    n = 3
    w = NgramWindows(docs, n, bos)
    expect = []
    for doc in docs:
        doc = ([bos] * n if bos is not None else []) + doc
        expect += [(doc[t - n : t], doc[t]) for t in range(n, len(doc))]
    assert len(w) == len(expect)
    ids = torch.randperm(len(w), generator=g)
    ctx, tgt = w[ids]
    for i, j in enumerate(ids.tolist()):
        assert ctx[i].tolist() == expect[j][0] and tgt[i].item() == expect[j][1]
    assert w.longest_document == 12 + (n if bos is not None else 0)


def test_epoch_sampler_is_a_function_of_seed_and_epoch():
    s = EpochBatchSampler(103, 10, seed=3, drop_last=True)
    s.set_epoch(2)
    a = [b.clone() for b in s]
    s.set_epoch(0)
    list(s)
    s.set_epoch(2)
    assert all(torch.equal(x, y) for x, y in zip(a, s))
    assert len(a) == len(s) == 10
    s.set_epoch(3)
    assert not torch.equal(torch.cat(a), torch.cat(list(s)))
    # ranks partition the examples
    parts = [torch.cat(list(EpochBatchSampler(103, 7, seed=3, rank=r, world_size=2))) for r in range(2)]
    ids = torch.cat(parts)
    assert sorted(ids[ids >= 0].tolist()) == list(range(103))


def test_eval_sampler_limit_is_spread_and_ordered():
    s = EpochBatchSampler(1000, 64, shuffle=False, limit=100)
    ids = torch.cat(list(s))
    assert len(ids) == 100 and ids[0] == 0 and ids[-1] == 999 and (ids.diff() > 0).all()


def test_synthetic_is_deterministic_zipfian_and_learnable():
    ds = SyntheticZipf(num_classes=10_000, context_size=3, size=50_000, p_rule=0.6, seed=5)
    ids = torch.arange(20_000)
    ctx, tgt = ds[ids]
    ctx2, tgt2 = ds[ids.flip(0)]
    assert torch.equal(ctx, ctx2.flip(0)) and torch.equal(tgt, tgt2.flip(0))
    assert tgt.min() >= 0 and tgt.max() < 10_000
    counts = torch.bincount(tgt, minlength=10_000)
    assert counts[:10].sum() > counts[100:110].sum() > counts[5000:5010].sum()
    follows = (tgt == (ctx[:, -1] ^ 1)).float().mean()
    assert 0.55 < follows < 0.7  # the rule plus chance coincidences
    other = SyntheticZipf(num_classes=10_000, context_size=3, size=50_000, seed=6)[ids][1]
    assert not torch.equal(tgt, other)


def test_synthetic_scales_to_ten_million_classes():
    ds = SyntheticZipf(num_classes=10**7, context_size=4, size=10**9, input_vocab_size=1000)
    ctx, tgt = ds[torch.arange(10**9 - 512, 10**9)]
    assert ctx.max() < 1000 and tgt.max() < 10**7
    c = zipf_counts(10**7)
    assert len(c) == 10**7 and (c[:-1] >= c[1:]).all() and c.min() >= 1


def test_synthetic_datamodule_splits_differ():
    dm = SyntheticDataModule(num_classes=1000, train_size=100, eval_size=50, input_vocab_size=None)
    dm.setup()
    a = dm.splits["train"][torch.arange(50)][1]
    b = dm.splits["validation"][torch.arange(50)][1]
    assert not torch.equal(a, b) and dm.input_vocab_size == 1000


def test_embedded_corpus_split_by_article():
    dm = TextDataModule(vocab_size=2000, context_size=4)
    dm.setup()
    from lst_lightning.data.corpus import load_corpus

    c = load_corpus()
    titles = {s: set(c[s]["title"]) for s in ("train", "validation", "test")}
    assert not titles["train"] & titles["validation"] and not titles["train"] & titles["test"]
    n = {s: len(dm.splits[s]) for s in dm.splits}
    assert n["train"] > 300_000 and 5_000 < n["validation"] < 60_000 and 5_000 < n["test"] < 60_000
    assert dm.num_classes == 2000 and (dm.class_counts[:-1] >= dm.class_counts[1:]).all()
    assert dm.vocab.words[:3] == [UNK, "the", "of"]  # <unk> sorts by its count


def _write(tmp_path, text, name="c.txt"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_missing_and_empty_files_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        TextDataModule("files", path=str(tmp_path / "nope.txt")).setup()
    with pytest.raises(ValueError, match="empty"):
        TextDataModule("files", path=_write(tmp_path, "  \n")).setup()


def test_context_longer_than_any_document_is_an_error(tmp_path):
    text = "\n\n".join("the cat sat on a mat today" for _ in range(40))
    path = _write(tmp_path, text)
    with pytest.raises(ValueError, match="longer than every"):
        TextDataModule("files", path=path, vocab_size=None, context_size=7, min_doc_tokens=1,
                       val_fraction=0.2, test_fraction=0.2).setup()
    dm = TextDataModule("files", path=path, vocab_size=None, context_size=7, pad_start=True,
                        min_doc_tokens=1, val_fraction=0.2, test_fraction=0.2)
    dm.setup()
    assert len(dm.splits["train"]) > 0
