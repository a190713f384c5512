"""The training app: config composition, a fast run of every head and loss, exact
resume, bad input at start-up, and the console script."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from hydra.utils import get_class

from lst_lightning.app.train import make_head, run, run_name, unused_loss

from app_configs import CONF, FAST, TOY, TOY_SOFTMAX, cfg_of, cfgs_of, group


def config_heads():
    """Every conf/head entry and its class: a head whose import fails fails collection
    here, loudly, rather than dropping out of the runs below."""
    return [(name, get_class(cfg_of(f"head={name}").head._target_)) for name in group("head")]


def head_loss_cases():
    cases = []
    for name, cls in config_heads():
        if getattr(cls, "self_updating", False):
            cases += [(name, loss) for loss in group("loss")]
        else:
            cases.append((name, "zloss"))  # ordinary heads ignore the loss group
    return cases


def body_takes(model: str, experiment: str | None) -> bool:
    """Whether conf/model/<model>.yaml's body takes every model setting the experiment sets
    (its schema refuses the others: app/schemas.py)."""
    import lst_lightning.models  # noqa: PLC0415
    from lst_lightning.app.schemas import NOT_MODEL_SETTINGS, parameters  # noqa: PLC0415

    sets = yaml.safe_load((CONF / "experiment" / f"{experiment}.yaml").read_text()).get("model", {}) if experiment \
        else {}
    schema = yaml.safe_load((CONF / "model" / f"{model}.yaml").read_text())["defaults"][0]  # /schema/model/<Body>@..
    body = getattr(lst_lightning.models, schema.split("/")[-1].split("@")[0])
    return set(sets) <= set(parameters(body, NOT_MODEL_SETTINGS))


@pytest.mark.parametrize("experiment", [None, *(pytest.param(e, marks=pytest.mark.slow) for e in group("experiment"))])
def test_every_config_composes(experiment):
    # Every option of these groups on top of each experiment, one group at a time: their
    # full product (700 composes) took 14 min on a busy 2-core machine. The default suite composes
    # them on the defaults (each experiment alone: test_checks.py), -m slow on each experiment.
    base = [f"experiment={experiment}"] if experiment else []
    options = [(g, o) for g in ("trainer", "data", "model") for o in group(g)
               if g != "model" or body_takes(o, experiment)]
    for (g, o), cfg in zip(options, cfgs_of(*([f"{g}={o}", *base] for g, o in options))):
        assert cfg.trainer.accumulate_grad_batches == 1
        assert cfg.data._target_.startswith("lst_lightning.data.")
        assert cfg[g]._target_ if g != "trainer" else cfg.trainer.accelerator


def test_default_config():
    cfg = cfg_of()
    assert cfg.head._target_ == "lst_lightning.spherical.FactoredSphericalHead"
    assert cfg.head.loss == "sampled" and cfg.head.negatives.num is None
    assert cfg.head.loss_kwargs == {"mu": None, "spherical": "zloss", "spherical_kwargs": None, "gram": 0.0}
    assert cfg.data.source == "embedded" and cfg.trainer.accelerator == "cpu"
    assert cfg.logger.wandb.mode == "offline" and cfg.logger.csv
    assert run_name(cfg) == "FactoredSphericalHead-sampled"
    assert run_name(cfg_of("head._target_=toy_heads.ToySoftmaxHead")) == "ToySoftmaxHead"
    assert run_name(cfg_of("head=softmax")) == "SoftmaxHead"  # a head that takes no spherical loss
    assert run_name(cfg_of("head=naive", "loss=mse")) == "NaiveSphericalHead-mse"


def test_a_loss_given_to_a_head_that_takes_none_is_named_as_unused():
    """head=sampled loss=zloss (a sweep over both groups) runs the sampled softmax unchanged: one line
    says so, naming the overrides; a spherical head, or no loss override, gets none."""
    over = ["head=sampled", "loss=zloss", "loss.kwargs.b=3.0"]
    note = unused_loss(cfg_of(*over), over)
    assert note == ("loss=zloss loss.kwargs.b=3.0: SampledSoftmaxHead takes no spherical loss, so the setting is "
                    "not used (the factored and naive heads take one)")
    assert unused_loss(cfg_of("head=sampled"), ["head=sampled", "optimizer.head_lr=0.1"]) is None
    assert unused_loss(cfg_of("head=naive", "loss=mse"), ["head=naive", "loss=mse"]) is None
    assert unused_loss(cfg_of("loss.kwargs.mu=0.3"), ["loss.kwargs.mu=0.3"]) is None


def test_unigram_negatives_draw_from_the_datas_counts():
    """head.negatives.sampler=unigram: the app hands the data's class counts to the draw (the
    sampled softmax baseline's unigram sampler takes them the same way)."""
    counts = torch.arange(1.0, 41.0)
    head = make_head(cfg_of("head.negatives.sampler=unigram"), num_classes=40, hidden_dim=8, class_counts=counts)
    q = head.negatives.sampler.log_q.exp()
    assert torch.allclose(q.float(), counts ** 0.75 / (counts ** 0.75).sum())
    assert make_head(cfg_of(), num_classes=40, hidden_dim=8, class_counts=counts).negatives.settings.sampler == \
        "log_uniform"


def _results(path):
    return json.loads((Path(path) / "results.json").read_text())


@pytest.mark.parametrize("head,loss", [(TOY, "zloss"), (TOY_SOFTMAX, "zloss")])
def test_tiny_run_with_toy_heads(tmp_path, head, loss):
    res = run(cfg_of(*FAST, f"head._target_={head}", f"loss={loss}"), tmp_path)
    assert res == _results(tmp_path)
    for split in ("val", "test"):
        r = res[split]
        assert 0 <= r["top1_error"] <= r["top100_error"] * 0 + 1 and r["top1_error"] >= r["top100_error"]
        assert 0 < r["mrr"] <= 1 and "simlex_rho" in r
        assert ("perplexity" in r) == (head == TOY_SOFTMAX)
    assert res["tokens_per_s"] > 0 and 0 < res["head_share"] < 1
    assert res["train_steps"] == res["val_step"] == 20  # validated at the end of the epoch: not again
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file() and (tmp_path / "vocab.json").is_file()
    assert (tmp_path / "csv" / "metrics.csv").read_text().count("train/loss") == 1
    assert len(val_rows(tmp_path)) == 1


def val_rows(run_dir):
    with (Path(run_dir) / "csv" / "metrics.csv").open(newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("val/mrr")]


def test_val_is_the_final_models_when_the_last_validation_came_earlier(tmp_path):
    """trainer.val_check_interval=8 over 20 steps validates at steps 8 and 16: results.json's val is
    of the final weights (a validation after training), labelled with its step."""
    res = run(cfg_of(*FAST, f"head._target_={TOY_SOFTMAX}", "trainer.val_check_interval=8"), tmp_path)
    assert res["train_steps"] == res["val_step"] == 20
    rows = val_rows(tmp_path)
    assert len(rows) == 3 and res["val"]["mrr"] == pytest.approx(float(rows[-1]["val/mrr"]), rel=1e-6)
    assert res["val"]["mrr"] != pytest.approx(float(rows[-2]["val/mrr"]), rel=1e-6)  # not step 16's


@pytest.mark.parametrize("head,loss", head_loss_cases())
def test_tiny_run_every_head_and_loss(tmp_path, head, loss):
    res = run(cfg_of(*FAST, f"head={head}", f"loss={loss}"), tmp_path)
    for split in ("val", "test"):
        assert 0 < res[split]["mrr"] <= 1
        assert all(v == v for v in res[split].values())  # no NaN
    assert res["train_steps"] == 20
    spherical = head in ("factored", "naive")
    assert res["loss"] == (loss if spherical else None)  # no loss name on a head that takes none


@pytest.mark.parametrize("head,precision", [("factored", "bf16-mixed"), ("naive", "bf16-mixed"),
                                            ("sampled_quadratic", "bf16-mixed"), ("factored", "64-true"),
                                            ("factored", "bf16-true")])
def test_tiny_run_under_lightning_precisions(tmp_path, head, precision):
    res = run(cfg_of(*FAST, f"head={head}", f"trainer.precision={precision}"), tmp_path)
    assert res["train_steps"] == 20
    for split in ("val", "test"):
        assert 0 < res[split]["mrr"] <= 1 and all(v == v for v in res[split].values())


def test_tiny_run_with_mean_over_real_rows(tmp_path):
    """head.reduction=mean_real: the logged eval loss is still the mean over real rows."""
    over = [*FAST, "head=factored", "loss=mse"]
    mean = run(cfg_of(*over), tmp_path / "mean")
    real = run(cfg_of(*over, "head.reduction=mean_real"), tmp_path / "real")
    assert real["train_steps"] == 20
    assert abs(real["val"]["loss"] - mean["val"]["loss"]) <= 1e-3 * abs(mean["val"]["loss"])


def test_checkpoints_off_saves_nothing(tmp_path):
    """The checkpoint entry off (``enabled: false``, the large-D sweeps' setting, or
    ``~callbacks.checkpoint``): no checkpoint at all, not Lightning's own ModelCheckpoint in
    its place; on by default."""
    run(cfg_of(*FAST, "+callbacks.checkpoint.enabled=false"), tmp_path / "off")
    run(cfg_of(*FAST, "~callbacks.checkpoint"), tmp_path / "removed")
    run(cfg_of(*FAST), tmp_path / "on")
    assert not list((tmp_path / "off").rglob("*.ckpt")) and not list((tmp_path / "removed").rglob("*.ckpt"))
    assert list((tmp_path / "on").rglob("*.ckpt"))


def test_tiny_run_lstm_and_synthetic(tmp_path):
    res = run(cfg_of(*FAST, f"head._target_={TOY_SOFTMAX}", "model=lstm", "data=synthetic", "~data.vocab_size",
                     "data.num_classes=3000", "data.input_vocab_size=500", "data.context_size=3"), tmp_path)
    assert res["num_classes"] == 3000 and "simlex_rho" not in res["val"]
    assert (tmp_path / "vocab.json").exists() is False


@pytest.mark.parametrize("strategy", ["FSDPStrategy", "ModelParallelStrategy", "DDPStrategy", "fsdp2"])
def test_a_strategy_that_shards_the_parameters_is_refused(strategy):
    """Lightning's FSDP (which refuses CPU itself; on GPUs the app does, before any process
    starts) and tensor parallelism (ModelParallelStrategy's default) are refused in one line
    with the reason and the alternatives (DeepSpeed too, by the same rule: not installed here);
    DDP and the app's fsdp2 (FSDP2 data parallelism over every process) pass."""
    from types import SimpleNamespace  # noqa: PLC0415

    import lightning.pytorch.strategies as strategies  # noqa: PLC0415

    from lst_lightning.app.fsdp_body import fsdp2_strategy  # noqa: PLC0415
    from lst_lightning.app.train import check_strategy  # noqa: PLC0415

    made = fsdp2_strategy() if strategy == "fsdp2" else getattr(strategies, strategy)()
    trainer = SimpleNamespace(strategy=made)
    if strategy in ("DDPStrategy", "fsdp2"):
        check_strategy(trainer)
    elif strategy == "ModelParallelStrategy":
        with pytest.raises(ValueError, match=r"^tensor_parallel_size=auto: .*trainer.strategy=fsdp2"):
            check_strategy(trainer)
    else:
        with pytest.raises(ValueError, match=f"^{strategy} is not supported: .*fsdp2.*head.parallel=sharded"):
            check_strategy(trainer)


def test_no_validation_batches(tmp_path):
    """trainer.limit_val_batches=0: no validation, an empty val in the results, and the test split still runs."""
    res = run(cfg_of(*FAST, f"head._target_={TOY_SOFTMAX}", "trainer.limit_val_batches=0",
                     "trainer.max_steps=7"), tmp_path)  # max_steps mid-epoch: the case that validated at the end
    assert res["val"] == {} and res["val_step"] is None and res["train_steps"] == 7 and 0 < res["test"]["mrr"] <= 1


class _StopAfterFirstEpoch(pl.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        trainer.should_stop = True


def _state(path):
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def _same(x, y) -> bool:
    """Bit-identical tensors, equal values, through the heads' extra state (a dict that holds
    the negatives' generator state, a tensor)."""
    if torch.is_tensor(x):
        return torch.is_tensor(y) and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    return x == y


@pytest.mark.parametrize("head,embedding", [(TOY, "sparse_adam"), (TOY_SOFTMAX, "sparse_adam"),
                                            (TOY_SOFTMAX, "adagrad"),
                                            pytest.param(TOY_SOFTMAX, "dense", marks=pytest.mark.slow),
                                            ("factored", "sparse_adam"),
                                            pytest.param("sampled", "sparse_adam", marks=pytest.mark.slow),
                                            pytest.param("hsoftmax", "adagrad", marks=pytest.mark.slow),
                                            ("sampled", "row_adam")])
def test_resume_is_bit_identical(tmp_path, head, embedding):
    """The row-sparse optimiser's state (and the dense one's) travels with the checkpoint;
    the sampled and hierarchical softmax's row-sparse class rows (head.sparse=true) with it;
    with row_adam, their static rows."""
    pick = f"head={head}" if "." not in head else f"head._target_={head}"
    over = [*FAST, pick, "trainer.max_epochs=2", "trainer.limit_train_batches=6", "model.dropout=0.2",
            "test=false", f"optimizer.embedding={embedding}", f"model.sparse_embedding={embedding != 'dense'}"]
    full = run(cfg_of(*over), tmp_path / "full")
    run(cfg_of(*over), tmp_path / "part", extra_callbacks=[_StopAfterFirstEpoch()])
    assert _results(tmp_path / "part")["train_steps"] == 6
    ckpt = tmp_path / "part" / "checkpoints" / "last.ckpt"
    resumed = run(cfg_of(*over, f"ckpt_path={ckpt}"), tmp_path / "resumed")
    assert resumed["train_steps"] == full["train_steps"] == 12
    a, b = _state(tmp_path / "full/checkpoints/last.ckpt"), _state(tmp_path / "resumed/checkpoints/last.ckpt")
    assert a.keys() == b.keys()
    for k in a:  # tensors bit-identical; the heads' extra state (lr, loss, the negatives' generator) equal
        assert _same(a[k], b[k]), k
    assert resumed["val"] == full["val"]
    # and the interruption mattered: the first-epoch state differs
    p = _state(ckpt)
    assert any(not torch.equal(p[k], a[k]) for k in a if torch.is_tensor(p[k]) and p[k].is_floating_point())


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        (["trainer=gpu"], ValueError, "no CUDA device"),
        (["metrics.perplexity=true"], ValueError, "cannot give perplexity"),
        (["trainer.accumulate_grad_batches=2"], ValueError, "cannot wait for the optimizer's step"),
        (["ckpt_path=/nonexistent/last.ckpt"], FileNotFoundError, "ckpt_path"),
        (["data.vocab_size=10000000"], ValueError, "larger than the corpus"),
        (["data.context_size=100000"], ValueError, "longer than every"),
        (["data=text_files", "data.path=/nonexistent.txt"], FileNotFoundError, "not found"),
        (["head._target_=lst_lightning.heads.NoSuchHead"], ValueError, "cannot be imported"),
        (["optimizer.name=lbfgs"], ValueError, "optimizer.name"),
        (["optimizer.embedding=dense"], ValueError, "model.sparse_embedding=false"),
        (["optimizer.embedding=lazy_adam"], ValueError, "optimizer.embedding must be"),
        # a metric this head does not write (no probabilities: no perplexity): it trained, then failed
        (["objective=val/perplexity"], ValueError, r"^objective='val/perplexity': this run writes no val/perplexity; "
                                                   r"the choices are val/loss, val/top1_error"),
        # the Trainer's TypeError, with a traceback, after the data was read
        (["+trainer.max_step=5"], ValueError, r"^trainer.max_step: Lightning's Trainer takes no max_step; "
                                              r"did you mean trainer.max_steps\?$"),
        (["+trainer.logger=false"], ValueError, r"^trainer.logger is lst-train's to give the Trainer: set the logger"),
    ],
)
def test_bad_input_fails_before_training(tmp_path, overrides, error, match):
    if "trainer=gpu" in overrides and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(error, match=match):
        run(cfg_of(*FAST, f"head._target_={TOY}", *overrides), tmp_path)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "results.json").exists()


def test_a_graph_step_off_the_gpu_fails_before_training(tmp_path):
    with pytest.raises(ValueError, match="CUDA graph, but this run trains on cpu") as err:
        run(cfg_of(*FAST, "head=factored", "head.step=cuda_graph", "head.sync_every=4"), tmp_path)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "results.json").exists()


def test_a_callback_averaging_the_factored_heads_buffers_fails_before_training(tmp_path, monkeypatch):
    """``+callbacks.ema._target_=...EMAWeightAveraging`` (use_buffers: true, Lightning's default):
    refused when the run is built, in one line naming use_buffers=False (HeadSteps refuses it in a
    plain Lightning script: tests/app/callbacks/test_head_steps.py)."""
    pytest.importorskip("lightning.pytorch.callbacks").EMAWeightAveraging
    ema = "+callbacks.ema._target_=lightning.pytorch.callbacks.EMAWeightAveraging"
    monkeypatch.setattr(pl.Trainer, "fit", lambda *a, **k: pytest.fail("refused only inside fit: a traceback"))
    with pytest.raises(ValueError, match=r"^EMAWeightAveraging averages every buffer.*use_buffers=False\)") as err:
        run(cfg_of(*FAST, "head=factored", ema), tmp_path)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "results.json").exists()


def test_console_script_from_another_directory(tmp_path):
    exe = Path(sys.executable).parent / "lst-train"
    out = subprocess.run([str(exe), "--cfg", "job", "head=naive", "loss=mse"], cwd=tmp_path,
                         capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["head"]["_target_"].endswith("NaiveSphericalHead") and cfg["loss"]["name"] == "mse"


@pytest.mark.parametrize("step,sync_every", [("fused", 1), ("fused", 4)])
def test_fused_head_step_trains_like_autograd(tmp_path, step, sync_every):
    """head.train_step in the forward gives the body and the head the same bits as the
    update inside loss.backward() (and, with sync_every > 1, the sync-free step)."""
    over = [*FAST, "head=factored", "trainer.max_epochs=1", "trainer.limit_train_batches=6", "test=false",
            "model.dropout=0.0", f"head.sync_every={sync_every}"]
    run(cfg_of(*over, "head.step=autograd"), tmp_path / "autograd")
    run(cfg_of(*over, f"head.step={step}"), tmp_path / step)
    a = _state(tmp_path / "autograd/checkpoints/last.ckpt")
    b = _state(tmp_path / f"{step}/checkpoints/last.ckpt")
    for k in a:
        assert _same(a[k], b[k]), k
    assert int(a["head.steps"]) == 6


def test_cuda_graph_head_step_needs_a_sync_free_head_at_build(tmp_path):
    """Refused by the head's own check of its driving before the data is read (checks.check_head_settings),
    not at the first step."""
    over = [*FAST, "head=factored", "head.step=cuda_graph", "head.sync_every=1", "trainer.limit_train_batches=2",
            "test=false"]
    with pytest.raises(ValueError, match=r"^head: step='cuda_graph' replays .* needs sync_every > 1"):
        run(cfg_of(*over), tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def test_the_old_top_level_head_step_names_head_step():
    """The step mode is head.step alone: the old top-level key, on the command line or
    in a config, is refused in one line that says what to write."""
    from omegaconf import open_dict  # noqa: PLC0415

    from lst_lightning.app.checks import check_config, check_overrides  # noqa: PLC0415

    for arg in ("head_step=fused", "+head_step=fused"):
        with pytest.raises(ValueError, match=r"head_step is no longer a setting: .* write head.step=fused"):
            check_overrides([arg])
    cfg = cfg_of("head=factored")
    assert "head_step" not in cfg
    with open_dict(cfg):
        cfg.head_step = "fused"  # an old experiment's config
    with pytest.raises(ValueError, match=r"write head.step=fused"):
        check_config(cfg)


def test_sequence_rows_flatten_and_check_shapes():
    from lst_lightning.app.module import as_rows  # noqa: PLC0415

    h, y = torch.randn(2, 3, 4), torch.tensor([[1, 2, -1], [3, -1, -1]])
    rows, targets = as_rows(h, y)
    assert torch.equal(rows[4], h[1, 1]) and targets.tolist() == [1, 2, -1, 3, -1, -1]
    h2, y2 = torch.randn(5, 4), torch.randint(0, 9, (5, 2))  # an n-gram body with K = 2 targets
    assert as_rows(h2, y2)[1] is y2
    with pytest.raises(ValueError, match="targets of shape"):
        as_rows(h, y[:, :2])


def test_an_ordinary_heads_own_lr(tmp_path):
    """optimizer.head_lr of an ordinary head is its parameters' lr in the optimizer (the body
    keeps optimizer.lr) and is recorded as head_lr; a bad one is refused at start-up, and
    so is head.lr (a self-updating head's own SGD lr) on an ordinary head, or
    optimizer.head_lr on a self-updating one."""
    from lst_lightning.app.train import build  # noqa: PLC0415

    cfg = cfg_of(*FAST, "head=hsoftmax", "optimizer.head_lr=0.008", "optimizer.lr=0.002")
    _, module, _ = build(cfg, tmp_path)
    opt = module.configure_optimizers()["optimizer"]
    lr_of = {id(p): g["initial_lr"] for g in opt.param_groups for p in g["params"]}  # before the warm-up
    assert {lr_of[id(p)] for p in module.head.parameters()} == {0.008}
    assert {lr_of[id(p)] for p in module.body.parameters()} == {0.002}
    assert module.head.weight in module.head.sparse_parameters()  # head.sparse=true by default
    assert cfg_of("head=softmax").optimizer.head_lr == 0.128  # a baseline's config sets its tuned lr
    assert cfg_of("head=factored").optimizer.head_lr is None
    with pytest.raises(ValueError, match="optimizer.head_lr=-1: must be a number > 0"):
        run(cfg_of(*FAST, "head=sampled", "optimizer.head_lr=-1"), tmp_path / "bad")
    with pytest.raises(ValueError, match=r"head.lr=0.1: .*write optimizer.head_lr=0.1"):
        run(cfg_of(*FAST, "head=sampled", "+head.lr=0.1"), tmp_path / "bad")
    with pytest.raises(ValueError, match=r"optimizer.head_lr=0.1 .*write head.lr=0.1"):
        run(cfg_of(*FAST, "head=factored", "optimizer.head_lr=0.1"), tmp_path / "bad")


@pytest.mark.parametrize("limit", [2, 0.5, 1.0])
def test_the_unigram_baseline_scores_the_examples_the_models_test_saw(limit):
    """``unigram_test`` is over the examples Lightning's test loop ran (``limit_test_batches``),
    not the whole split; over every rank's shard, each example once."""
    from lst_lightning.app.metrics import unigram_ranks
    from lst_lightning.app.train import unigram_metrics
    from lst_lightning.data.datamodule import SyntheticDataModule

    dm = SyntheticDataModule(50, train_size=64, eval_size=100, input_vocab_size=50, eval_batch_size=16)
    dm.setup("test")

    class Seen(pl.LightningModule):
        targets = []

        def test_step(self, batch, batch_idx):
            self.targets.append(batch[1].reshape(-1))

    seen = Seen()
    trainer = pl.Trainer(limit_test_batches=limit, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu")
    trainer.test(seen, datamodule=dm, verbose=False)
    target = torch.cat(seen.targets)
    rank = unigram_ranks(dm.class_counts, target[target >= 0]).double()
    got = unigram_metrics(dm, [1, 5], trainer.limit_test_batches, trainer.world_size)
    assert got["mrr"] == pytest.approx(float((1 / rank).mean()), rel=1e-6)
    assert got["top5_error"] == pytest.approx(float((rank > 5).double().mean()), rel=1e-6)
    # two ranks, no limit: the whole split, each example once
    whole = torch.cat([t for _, t in dm.eval_dataloader("test")])
    rank = unigram_ranks(dm.class_counts, whole).double()
    assert unigram_metrics(dm, [1], 1.0, 2)["mrr"] == pytest.approx(float((1 / rank).mean()), rel=1e-6)


def test_the_summary_puts_the_runs_own_figures_under_no_split(capsys):
    """step_time_ms, tokens_per_s, head_share and wall_s are the run's: printed below the table,
    not in its first split's column (they stood under "val")."""
    from lst_lightning.app.train import print_summary

    print_summary({"name": "r", "num_classes": 10, "train_steps": 5, "run_dir": ".",
                   "val": {"mrr": 0.5}, "test": {"mrr": 0.4}, "step_time_ms": 2.5, "wall_s": 9.0})
    out = capsys.readouterr().out.splitlines()
    assert not any("step_time_ms" in line and "│" in line for line in out)
    assert "step_time_ms 2.5, wall_s 9" in out


@pytest.mark.parametrize("over,refusal", [
    (["trainer=ddp_cpu", "head.parallel=replicated", "data.train_size=300"],
     "300 examples, fewer than one batch of 512 \\(data\\.batch_size=256 on each of 2 processes\\)"),
    (["data.train_size=100"], "100 examples, fewer than one batch of 256 \\(data\\.batch_size=256\\)"),
], ids=["two processes", "synthetic"])
def test_a_training_split_that_fills_no_batch_of_the_world_is_refused_before_any_process_starts(tmp_path, over,
                                                                                               refusal):
    """The data module's setup checks one process's batch, and the training loader the world's, but
    there spawned workers (and Lightning's fit) raised it as a traceback: the built run checks it
    with the trainer's world, in one line, before the run writes or spawns anything."""
    with pytest.raises(ValueError, match=rf"^the training split gives {refusal}"):
        run(cfg_of("logger=csv", "callbacks=minimal", "data=synthetic", "data.num_classes=300", *over), tmp_path)
    assert not any(tmp_path.iterdir())
