"""The data modules (datamodule.py): the embedded corpus split by article, the synthetic
splits, and clear errors for missing, empty or too short text."""
import json
import random

import hydra
import pytest
import torch

from lst_lightning.data import SyntheticDataModule, TextDataModule
from lst_lightning.data.vocab import UNK

from app_configs import cfg_of


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


def test_text_files_take_every_type_of_their_training_split_by_default(tmp_path):
    """``data=text_files`` as lst-train composes it: D is the files' own, every type of the
    training split (and ``<unk>``), so a corpus of fewer types than the wiki's 10^4 trains as it is."""
    rng = random.Random(0)
    words = sorted({"".join(rng.choices("abcdefgh", k=6)) for _ in range(300)})
    path = _write(tmp_path, "\n\n".join(" ".join(rng.choices(words, k=40)) for _ in range(200)))
    dm = hydra.utils.instantiate(cfg_of("data=text_files", f"data.path={path}").data)
    dm.setup()
    assert dm.num_classes == len(dm.vocab.words) == len(words) + 1, (dm.num_classes, len(words))


def test_data_hub_trains_a_local_jsonl_file_with_its_own_types(tmp_path):
    """``data=hub data.name=json data.path=<file>`` as lst-train composes it: the file is read by
    ``datasets``' json builder, validation and test are carved from it, and D is its own."""
    rng = random.Random(0)
    words = sorted({"".join(rng.choices("abcdefgh", k=6)) for _ in range(300)})
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps({"text": " ".join(rng.choices(words, k=40))}) for _ in range(200)))
    dm = hydra.utils.instantiate(cfg_of("data=hub", "data.name=json", f"data.path={path}").data)
    dm.setup()
    assert dm.num_classes == len(words) + 1
    assert all(len(dm.splits[s]) > 0 for s in ("train", "validation", "test"))


def test_rows_without_text_are_empty_documents(tmp_path):
    """A JSONL whose rows hold null or empty text (a scrape's failures): those rows add no tokens,
    the others train as they would alone."""
    rows = [{"text": None if i % 7 == 0 else "" if i % 5 == 0 else f"w{i % 11} w{i % 3} w{i % 13} w{i % 4}"}
            for i in range(120)]
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    dm = TextDataModule("hub", name="json", path=str(path), vocab_size=None, min_doc_tokens=1, context_size=2,
                        pad_start=True)
    dm.setup()
    assert sum(len(dm.splits[s]) for s in dm.splits) == 4 * sum(1 for r in rows if r["text"])


def test_a_training_split_smaller_than_one_batch_is_refused(tmp_path):
    """The loader drops a last partial batch, so a training split of fewer examples than one batch
    trained no step and still reported its test metrics: refused at setup (one process) and at the
    training loader (the trainer's world), in one line, the splits left unset."""
    path = _write(tmp_path, "\n\n".join(f"the cat sat on mat number {i} today" for i in range(60)))
    kw = dict(vocab_size=None, context_size=2, min_doc_tokens=1, val_fraction=0.2, test_fraction=0.2)
    dm = TextDataModule("files", path=path, batch_size=512, **kw)
    with pytest.raises(ValueError, match=r"^the training split gives \d+ examples, fewer than one batch of 512 "
                                         r"\(data\.batch_size=512\), so no step would train: lower "
                                         r"data\.batch_size, or give more training data$"):
        dm.setup()
    assert dm.splits == {}
    dm = TextDataModule("files", path=path, batch_size=128, **kw)
    dm.setup()
    n = len(dm.splits["train"])
    assert 128 <= n < 256
    with pytest.raises(ValueError, match=rf"^the training split gives {n} examples, fewer than one batch of 256 "
                                         r"\(data\.batch_size=128 on each of 2 processes\)"):
        dm._loader("train", True, rank=0, world_size=2)
    seq = TextDataModule("files", path=path, batch_size=4096, sequences=True, sequence_length=8, **kw)
    with pytest.raises(ValueError, match=r"^the training split gives \d+ sequences of 8 tokens, fewer than one batch "
                                         r"of 512 \(data\.batch_size=4096\)"):
        seq.setup()


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


@pytest.mark.parametrize("key, value, message", [
    ("batch_size", 0, "batch_size must be >= 1, got 0"),
    ("eval_batch_size", 0, "eval_batch_size must be >= 1 or null, got 0"),  # it was taken as null
    ("max_eval_examples", 0, "max_eval_examples must be >= 1 or null, got 0"),
    ("num_workers", -1, "num_workers must be >= 0, got -1"),
])
def test_bad_batch_settings_are_refused_when_built(key, value, message):
    """At construction (lst-train's build: one line, before the run starts), not at the first batch."""
    for cls, kw in ((SyntheticDataModule, {"num_classes": 100, "input_vocab_size": None}), (TextDataModule, {})):
        with pytest.raises(ValueError, match=f"^{message}$"):
            cls(**kw, **{key: value})


@pytest.mark.parametrize("key", ["context_size", "train_size", "eval_size", "input_vocab_size"])
@pytest.mark.parametrize("value", [0, -3])
def test_bad_synthetic_sizes_are_refused_in_one_line(key, value):
    with pytest.raises(ValueError, match=rf"^data\.{key} must be >= 1.*got {value}$"):
        SyntheticDataModule(100, **{key: value})


@pytest.mark.parametrize("source", ["embedded", "python_code"])
@pytest.mark.parametrize("fractions", [(-0.1, 0.05), (0.05, -0.1), (0.6, 0.4), (1.5, 0.0)])
def test_bad_split_fractions_are_refused_when_built(source, fractions):
    with pytest.raises(ValueError, match=r"^data\.val_fraction=.* must each be >= 0, with a sum below 1 [^\n]*$"):
        TextDataModule(source, val_fraction=fractions[0], test_fraction=fractions[1])


@pytest.mark.parametrize("min_count", [0, -1])
def test_a_min_count_below_one_is_refused_when_built(min_count):
    """Every word occurs at least once: a min_count below 1 is no setting (it would keep what 1 keeps)."""
    with pytest.raises(ValueError, match=rf"^data\.min_count must be >= 1 \(1: every word\), got {min_count}$"):
        TextDataModule("embedded", min_count=min_count)
