"""A resume whose settings change the model is refused in one line, before the run writes
anything (checkpoint_fit.py): the run directory's config.yaml and vocab.json stay the
checkpoint's run's."""
from pathlib import Path

import pytest
import torch

from lst_lightning.app.checkpoint_fit import mismatches
from lst_lightning.app.train import run

from app_configs import FAST, cfg_of


def files(run_dir):
    return {p: p.read_bytes() for p in Path(run_dir).rglob("*") if p.is_file() and p.name != "train.log"}


def test_a_resume_with_another_model_is_refused_and_writes_nothing(tmp_path):
    run(cfg_of(*FAST, "test=false"), tmp_path)
    before = files(tmp_path)
    with pytest.raises(ValueError, match=r"^ckpt_path=last: .*last\.ckpt does not fit the model of these settings: "
                                         r"body\.\S+ is \(16, \d+\) there, \(32, \d+\) here.*the settings that differ "
                                         r"from the run that saved it: model\.hidden_dim=16 \(here 32\)"):
        run(cfg_of(*FAST, "test=false", "ckpt_path=last", "model.hidden_dim=32"), tmp_path)
    with pytest.raises(ValueError, match=r"head\.W missing there; head\.V not in this model.*head\._target_="):
        run(cfg_of(*FAST, "test=false", "ckpt_path=last", "head=naive"), tmp_path)
    assert files(tmp_path) == before


def test_mismatches_name_keys_and_shapes_and_skip_a_sharded_heads_shapes():
    here = {"body.w": torch.zeros(2, 3), "head.V": torch.zeros(4, 3), "head.n": torch.zeros(())}
    saved = {"body.w": torch.zeros(2, 3), "head.V": torch.zeros(0, 3), "head.x": torch.zeros(1)}
    assert mismatches(saved, here) == ["head.n missing there", "head.x not in this model",
                                       "head.V is (0, 3) there, (4, 3) here"]
    assert mismatches(saved, here, skip="head.") == ["head.n missing there", "head.x not in this model"]
    assert mismatches(here, here) == []


def test_a_resume_on_a_changed_corpus_is_refused_even_where_the_shapes_fit(tmp_path):
    """The corpus edited between a run and its resume: with ``data.vocab_size`` capping D the shapes
    still fit, but the ids name other words (the checkpoint's rows would train as other classes).
    Refused in one line naming the saved vocab.json, before the run writes anything."""
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(words[(i * 7 + j * j) % 8] for j in range(30)) for i in range(200)))
    args = (*FAST, "test=false", "data=text_files", f"data.path={corpus}", "data.vocab_size=5", "data.min_doc_tokens=1")
    out = tmp_path / "run"
    run(cfg_of(*args), out)
    before = files(out)
    corpus.write_text(corpus.read_text() + "\n\n" + "\n\n".join(" ".join(["theta"] * 30) for _ in range(300)))
    with pytest.raises(ValueError, match=r"^ckpt_path=last: the data's vocabulary is not the one .*vocab\.json holds "
                                         r"\(5 words there, 5 here; id \d+ is '\S+' there, 'theta' here\): resume on "
                                         r"the data of the run that saved .*last\.ckpt$"):
        run(cfg_of(*args, "ckpt_path=last"), out)
    assert files(out) == before


@pytest.mark.parametrize("data", [(), ("data=synthetic", "~data.vocab_size", "data.num_classes=300",
                                         "data.train_size=2000", "data.eval_size=256")], ids=["wiki", "synthetic"])
def test_a_resume_with_another_data_seed_is_refused_and_one_with_another_seed_alone_is_not(tmp_path, data):
    """``seed=1`` on resume moves ``data.seed`` with it: the synthetic task's examples (and a corpus's
    splits) are drawn anew, while every shape still fits and the task has no vocabulary to compare.
    Refused in one line saying which seed to keep, before the run writes anything; ``data.seed``
    pinned, another ``seed`` resumes."""
    args = (*FAST, *data, "test=false", "trainer.max_steps=2")
    run(cfg_of(*args), tmp_path)
    before = files(tmp_path)
    with pytest.raises(ValueError, match=r"^ckpt_path=last: data\.seed=1 draws other examples than the checkpoint's "
                                         r"run's data\.seed=0 .*set data\.seed=0 to keep them .*: resume on the data "
                                         r"of the run that saved .*last\.ckpt$"):
        run(cfg_of(*args, "ckpt_path=last", "seed=1"), tmp_path)
    assert files(tmp_path) == before
    run(cfg_of(*args[:-1], "trainer.max_steps=4", "ckpt_path=last", "seed=1", "data.seed=0"), tmp_path)
