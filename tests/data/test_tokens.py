"""The tokenised corpus cache (tokens.py): arrays on disk keyed by the files and the
settings, the same vocabulary and ids as tokenising in lists, the one-line summary, and a
vocabulary too large for the corpus refused from the cache before anything is encoded."""
import logging

import numpy as np
import pytest

from lst_lightning.data import TextDataModule, Vocabulary
from lst_lightning.data import tokens as tokens_module
from lst_lightning.data.corpus import SPLITS, load_corpus
from lst_lightning.data.sources import CorpusSource
from lst_lightning.data.tokens import kept, tokenise
from lst_lightning.data.vocab import BOS, tokenize

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LST_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokens"


def _corpus(tmp_path, paragraphs=60, seed=0):
    rng = np.random.default_rng(seed)
    text = "\n\n".join(" ".join(rng.choice(WORDS, size=int(rng.integers(3, 30)), p=_zipf(len(WORDS))))
                       for _ in range(paragraphs))
    path = tmp_path / "c.txt"
    path.write_text(text)
    return path


def _zipf(n):
    p = 1.0 / np.arange(1, n + 1)
    return p / p.sum()


def _args(path, **kw):
    return dict(source="files", path=str(path), name=None, subset=None, text_column="text", sample_by="paragraph",
                val_fraction=0.2, test_fraction=0.2, min_doc_tokens=1, seed=0) | kw


def test_the_cache_holds_the_lists_ids_as_arrays(tmp_path, cache):
    path = _corpus(tmp_path)
    tok = tokenise(CorpusSource(_args(path)), "words")
    corpus = load_corpus(**_args(path))
    docs = {s: [d for d in (tokenize(t) for t in corpus[s]["text"]) if d] for s in SPLITS}
    for extra, size in [((), 8), ((BOS,), 8), ((), None)]:
        want = Vocabulary.build(docs["train"], size, 1, extra)
        got = tok.vocabulary(size, 1, extra)
        assert got.words == want.words and got.counts.tolist() == want.counts.tolist()
        for s in SPLITS:
            flat = tok.encode(s, got, extra)
            assert flat.tokens.dtype == np.int32 and flat.offsets.dtype == np.int64
            assert flat.tokens.tolist() == [i for d in docs[s] for i in want.encode(d)]
            assert flat.lengths.tolist() == [len(d) for d in docs[s]]
            assert tok.unknown(s, got, extra) == sum(want.encode(d).count(want.unk_id) for d in docs[s])
    assert isinstance(tok.ids("train"), np.memmap)
    assert tok.meta["documents"] == {s: len(docs[s]) for s in SPLITS}
    assert tok.meta["types"] == len({w for s in SPLITS for d in docs[s] for w in d})
    assert [p.name for p in cache.iterdir()] == [tok.path.name]  # nothing left of the build


def test_a_second_run_reads_the_cache_and_a_changed_file_does_not(tmp_path, cache, monkeypatch):
    path = _corpus(tmp_path)
    first = tokenise(CorpusSource(_args(path)), "words")
    built = []
    real = tokens_module._build
    monkeypatch.setattr(tokens_module, "_build", lambda *a: built.append(a) or real(*a))
    again = tokenise(CorpusSource(_args(path)), "words")
    assert again.path == first.path and not built
    assert tokenise(CorpusSource(_args(path)), "whitespace").path != first.path  # the settings are in the key
    assert len(built) == 1
    _corpus(tmp_path, seed=1)  # the same file, new text
    assert tokenise(CorpusSource(_args(path)), "words").path != first.path and len(built) == 2


@pytest.mark.parametrize("damage", ["truncate train.ids.npy", "garble train.ids.npy", "truncate types.txt",
                                    "remove counts.npy", "truncate meta.json"])
def test_a_damaged_cache_is_tokenised_again_not_read(tmp_path, cache, caplog, damage):
    path = _corpus(tmp_path)
    whole = tokenise(CorpusSource(_args(path)), "words")
    want = whole.encode("train", whole.vocabulary(None)).tokens.tolist()
    how, name = damage.split()
    f = whole.path / name
    if how == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif how == "garble":  # the header kept, ids past the types
        data = bytearray(f.read_bytes())
        data[-8:] = b"\xff\xff\xff\x7f" * 2
        f.write_bytes(bytes(data))
    else:
        f.unlink()
    with caplog.at_level(logging.WARNING, logger="lst_lightning.data.tokens"):
        again = tokenise(CorpusSource(_args(path)), "words")
    assert again.built and again.path == whole.path
    assert again.encode("train", again.vocabulary(None)).tokens.tolist() == want
    [line] = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert str(whole.path) in line and "\n" not in line
    assert [p.name for p in cache.iterdir()] == [whole.path.name]


def test_the_summary_line(tmp_path, cache, caplog):
    path = str(_corpus(tmp_path))
    for built in (True, False):
        dm = TextDataModule("files", path=path, vocab_size=8, context_size=2, min_doc_tokens=1, val_fraction=0.2,
                            test_fraction=0.2)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lst_lightning.data"):
            dm.prepare_data()
            dm.setup()
        line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: files, words tokens:")]
        assert len(line) == 1
        m, v = dm.tokenised.meta, dm.vocab
        rate = sum(dm.tokenised.unknown(s, v) for s in SPLITS) / sum(m["tokens"].values())
        for part in [f"{sum(m['documents'].values())} documents", f"{sum(m['tokens'].values())} tokens",
                     f"{m['types']} types", "vocabulary 8 (7 types kept, <unk>)", f"unknown {100 * rate:.2f} %",
                     f"tokenised in {m['seconds']} s into {dm.tokenised.path}" if built
                     else f"cached in {dm.tokenised.path}"]:
            assert part in line[0]
        assert 0 < rate < 1 and kept(v) == 7
        assert any(r.getMessage().startswith("data: tokenising files") for r in caplog.records) == built


def test_a_vocabulary_too_large_is_refused_from_the_cache_before_encoding(tmp_path, cache, monkeypatch):
    path = str(_corpus(tmp_path))
    first = TextDataModule("files", path=path, vocab_size=None, min_doc_tokens=1)
    first.prepare_data()
    largest = len(first.vocab)  # every training type and <unk>
    monkeypatch.setattr(tokens_module, "_build", lambda *a: pytest.fail("tokenised again"))
    monkeypatch.setattr(tokens_module.Tokenised, "encode", lambda *a: pytest.fail("encoded"))
    with pytest.raises(ValueError, match=rf"vocab_size={largest + 1} is larger than the corpus allows: .* "
                                         rf"largest valid value is {largest} .*data\.tokenizer=whitespace"):
        TextDataModule("files", path=path, vocab_size=largest + 1, min_doc_tokens=1).prepare_data()
    TextDataModule("files", path=path, vocab_size=largest, min_doc_tokens=1).prepare_data()
    with pytest.raises(ValueError, match=rf"largest valid value is {largest + 1} "):  # <s> is one more
        TextDataModule("files", path=path, vocab_size=largest + 2, min_doc_tokens=1, pad_start=True).prepare_data()


def test_bad_settings_are_refused_in_one_line(tmp_path, cache):
    path = str(_corpus(tmp_path))
    with pytest.raises(ValueError, match="data.max_tokens caps"):
        TextDataModule("files", path=path, max_tokens=100)
    with pytest.raises(ValueError, match="data.source must be"):
        TextDataModule("web", path=path)
    with pytest.raises(ValueError, match="data.tokenizer must be one of words, whitespace, code"):
        TextDataModule("files", path=path, tokenizer="bpe")


def test_code_tokens():
    text = 'def f(x_1, y=0x1F):\n    return x_1 * 1.5e-3 + y  # naïve 10UL'
    assert tokenize(text, "code") == ["def", "f", "(", "x_1", ",", "y", "=", "0x1F", ")", ":", "return", "x_1",
                                      "*", "1.5e-3", "+", "y", "#", "naïve", "10UL"]


def _bpe(folder, vocab_size=60):
    """A byte-level BPE tokenizer.json trained on WORDS, as a model's checkpoint folder holds one."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([" ".join(WORDS)] * 20,
                            tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[UNK]", "</s>"]))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return tok


def test_a_tokenizer_json_gives_its_pieces_and_d_its_pieces_seen(tmp_path, cache):
    """``data.tokenizer=<a model's folder>``: its tokenizer.json's pieces, no special tokens added;
    D is the pieces of the training split, as with the other tokenizers."""
    tok = _bpe(tmp_path / "model")
    text = "alpha beta gammadelta"
    assert tokenize(text, str(tmp_path / "model")) == tok.encode(text, add_special_tokens=False).tokens
    assert tokenize(text, str(tmp_path / "model" / "tokenizer.json")) == tokenize(text, str(tmp_path / "model"))
    path = _corpus(tmp_path)
    dm = TextDataModule("files", path=str(path), tokenizer=str(tmp_path / "model"), vocab_size=None,
                        min_doc_tokens=1, val_fraction=0.2, test_fraction=0.2)
    dm.setup()
    corpus = load_corpus(**_args(path))
    pieces = {p for t in corpus["train"]["text"] for p in tok.encode(t, add_special_tokens=False).tokens}
    assert dm.num_classes == len(pieces) + 1 and "</s>" not in dm.vocab.index


def test_a_tokenizer_json_is_in_the_cache_key_by_its_content(tmp_path, cache):
    _bpe(tmp_path / "a")
    source = CorpusSource(_args(_corpus(tmp_path)))
    key = tokens_module.cache_key(source, str(tmp_path / "a"), None)
    assert key.startswith("files-hf-")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "tokenizer.json").write_bytes((tmp_path / "a" / "tokenizer.json").read_bytes())
    assert tokens_module.cache_key(source, str(tmp_path / "b" / "tokenizer.json"), None) == key  # moved: the same
    _bpe(tmp_path / "a", vocab_size=40)
    assert tokens_module.cache_key(source, str(tmp_path / "a"), None) != key  # another tokenizer


def test_a_file_that_is_no_tokenizer_is_refused_in_one_line(tmp_path, cache):
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match=r"^data\.tokenizer='.*': .*tokenizer\.json is not a Hugging Face "
                                         r"tokenizer\.json \([^\n]*\)$"):
        TextDataModule("files", path=str(_corpus(tmp_path)), tokenizer=str(tmp_path))


def test_pieces_holding_newlines_and_backslashes_round_trip_through_the_cache(tmp_path, cache):
    """A tokenizer.json whose pieces hold a newline or a backslash (SentencePiece vocabularies hold
    "\\n" pieces): types.txt keeps one type a line, and the vocabulary read back is the pieces seen."""
    tokenizers = pytest.importorskip("tokenizers")
    text = "\n\n".join(f"a\nb c\\d e\\nf{i % 3} g\\\\h" for i in range(60))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(" ", behavior="removed")
    tok.train_from_iterator([text], tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    path = tmp_path / "c.txt"
    path.write_text(text)
    first = tokenise(CorpusSource(_args(path)), str(tmp_path))
    again = tokenise(CorpusSource(_args(path)), str(tmp_path))  # read from the cache, its checks passed
    assert again.path == first.path
    assert set(again.types()) == {"a\nb", "c\\d", "e\\nf0", "e\\nf1", "e\\nf2", "g\\\\h"}
