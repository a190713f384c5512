"""Contiguous sequences for the transformer: every position a target, padding at document
ends, and the data modules' sequence form against the documents written out."""
import torch

from lst_lightning.data.datamodule import SyntheticDataModule, _PaddedIds
from lst_lightning.data.sequences import TokenSequences
from lst_lightning.data.synthetic import SyntheticZipf


def _expected(docs, length, bos=None):
    """Chunks written out from the documents: (inputs, targets) per chunk, in order."""
    out = []
    for doc in docs:
        doc = ([bos] if bos is not None else []) + list(doc)
        for c in range(0, len(doc) - 1, length):
            x, y = doc[c : c + length], doc[c + 1 : c + length + 1]
            pad = length - len(y)
            out.append((x[: len(y)] + [0] * pad, y + [-1] * pad))
    return out


def test_chunks_pad_at_document_ends():
    docs = [[5, 6, 7, 8, 9, 10, 11], [3], [4, 4], [1, 2, 3, 4, 5, 6]]
    for length, bos in [(3, None), (4, 99), (1, None), (10, None)]:
        ds = TokenSequences(docs, length, bos)
        want = _expected(docs, length, bos)
        assert len(ds) == len(want)
        x, y = ds[torch.arange(len(ds))]
        assert x.shape == y.shape == (len(want), length)
        assert x.tolist() == [w[0] for w in want] and y.tolist() == [w[1] for w in want]
    # a document's last chunk: full when its targets fill it, else padded (never the next document)
    x, y = TokenSequences(docs, 3)[torch.tensor([1])]
    assert y.tolist() == [[9, 10, 11]]
    x, y = TokenSequences(docs, 4)[torch.tensor([1])]
    assert y.tolist() == [[10, 11, -1, -1]]


def test_every_real_target_once():
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 30, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (20,), generator=g)]
    ds = TokenSequences(docs, 5)
    _, y = ds[torch.randperm(len(ds), generator=g)]
    real = y[y >= 0]
    assert len(real) == sum(max(len(d) - 1, 0) for d in docs)
    assert sorted(real.tolist()) == sorted(t for d in docs for t in d[1:])


def test_synthetic_sequences_are_the_chains_shifted():
    chains = SyntheticZipf(num_classes=40, context_size=6, size=50, seed=3, sequences=True)
    windows = SyntheticZipf(num_classes=40, context_size=6, size=50, seed=3)
    ids = torch.tensor([0, 7, 7, 49])
    x, y = chains[ids]
    cx, cy = windows[ids]
    assert x.shape == y.shape == (4, 6)
    assert torch.equal(x, cx) and torch.equal(y[:, -1], cy) and torch.equal(y[:, :-1], x[:, 1:])


def test_datamodule_batches_count_tokens_and_pad_ranks():
    dm = SyntheticDataModule(num_classes=100, input_vocab_size=None, train_size=40, eval_size=10, batch_size=16,
                             eval_batch_size=24, sequences=True, sequence_length=8)
    dm.setup()
    assert dm.context_size == 8
    x, y = next(iter(dm._loader("train", True, 0, 1)))
    assert x.shape == y.shape == (2, 8)  # 16 tokens: two sequences of 8
    # 10 sequences over 3 ranks: 12 with two padding ids; rank 1 holds ids 1, 4, 7 and a padding one
    batches = list(dm.eval_dataloader("validation", rank=1, world_size=3))
    assert [b[0].shape for b in batches] == [(3, 8), (1, 8)]  # 24 tokens: three sequences a batch
    assert (batches[0][1] >= 0).all() and (batches[1][1] == -1).all()
    x, y = _PaddedIds(dm.splits["test"])[torch.tensor([2, -1])]
    assert (y[0] >= 0).all() and (y[1] == -1).all()


def test_world_batches_of_sequences_are_one_process_batches_when_batch_size_is_a_multiple_of_the_length():
    """The ranks' sequences of step t make up the one-process batch of step t with world x
    batch_size tokens when batch_size counts whole sequences; below one sequence each rank
    still takes one (at least one), so the world holds more sequences than one process."""
    def loader(batch_size, rank=0, world=1):
        dm = SyntheticDataModule(num_classes=100, input_vocab_size=None, train_size=40, eval_size=10,
                                 batch_size=batch_size, sequences=True, sequence_length=8)
        dm.setup()
        return [y for _, y in dm._loader("train", True, rank, world)]

    for per_rank in (8, 16):  # one and two sequences a rank
        ranks = [loader(per_rank, r, 2) for r in range(2)]
        one = loader(2 * per_rank)
        assert len(one) == len(ranks[0]) == len(ranks[1])
        for t, batch in enumerate(one):
            world = torch.cat([ranks[0][t], ranks[1][t]])
            assert sorted(map(tuple, world.tolist())) == sorted(map(tuple, batch.tolist()))
    ranks, one = [loader(4, r, 2) for r in range(2)], loader(8)  # 4 tokens: still one sequence of 8 a rank
    assert ranks[0][0].shape == one[0].shape == (1, 8)  # the world's step: two sequences, one process's: one


def test_text_datamodule_serves_each_document_as_padded_sequences(tmp_path):
    from lst_lightning.data.datamodule import TextDataModule  # noqa: PLC0415

    docs = [" ".join(f"w{(i * 7 + j) % 23}" for j in range(5 + i % 9)) for i in range(40)]
    path = tmp_path / "c.txt"
    path.write_text("\n\n".join(docs))
    dm = TextDataModule("files", path=str(path), vocab_size=None, min_doc_tokens=1, val_fraction=0.2,
                        test_fraction=0.2, batch_size=12, sequences=True, sequence_length=6, pad_start=True)
    dm.setup()
    assert dm.context_size == 6
    x, y = next(iter(dm._loader("train", True, 0, 1)))
    assert x.shape == y.shape == (2, 6)
    ds = dm.splits["test"]
    _, y = ds[torch.arange(len(ds))]
    # every token of every test document but its leading <s> is a target exactly once
    bos = dm.vocab.index["<s>"]
    documents = int((ds.tokens == bos).sum())
    assert documents > 0 and int((y >= 0).sum()) == len(ds.tokens) - (6 + 1) - documents  # less the trailing room
    assert (y == -1).any()  # some document ends inside a sequence
