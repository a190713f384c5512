"""The configuration checks that run before torch and Lightning are imported: each bad
value is refused with its key named, each good one passes (the defaults and every
trainer config among them)."""
import json

import pytest
import torch

from lst_lightning.app.checks import check_config, check_objective, check_overrides

from app_configs import cfg_of, group


@pytest.mark.parametrize("trainer", group("trainer"))
def test_every_trainer_config_passes(trainer):
    check_config(cfg_of(f"trainer={trainer}"))


@pytest.mark.parametrize("head", group("head"))
def test_every_head_config_passes(head):
    check_config(cfg_of(f"head={head}"))


@pytest.mark.parametrize("experiment", group("experiment"))
def test_every_experiment_passes(experiment):
    check_config(cfg_of(f"experiment={experiment}"))


@pytest.mark.parametrize("override,match", [
    ("trainer.max_steps=-5", "trainer.max_steps=-5: must be"),
    ("trainer.max_epochs=-2", "trainer.max_epochs"),
    ("trainer.limit_train_batches=1.5", "trainer.limit_train_batches"),
    ("trainer.limit_val_batches=-1", "trainer.limit_val_batches"),
    ("trainer.val_check_interval=0", "trainer.val_check_interval"),
    ("trainer.val_check_interval=00:00:00:00", "trainer.val_check_interval"),
    ("trainer.val_check_interval=00:00:30", "trainer.val_check_interval"),
    ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches"),
    ("trainer.log_every_n_steps=0", "trainer.log_every_n_steps"),
    ("trainer.gradient_clip_val=-1.0", "trainer.gradient_clip_val"),
    ("cpu_threads=0", "cpu_threads=0"),
    ("seed=abc", r"^seed='abc': must be a whole number in \[0, 4294967295\]$"),  # not data.seed, which ${seed} fills
    ("seed=-1", r"^seed=-1: must be"),
    ("seed=4294967296", r"^seed=4294967296: must be"),
    ("clock=gpu", "clock=.gpu.: must be wall or cpu"),
    ("head_checkpoint=wholee", r"^head_checkpoint='wholee': must be whole or per_rank$"),
    ("head_shards_keep=0", r"^head_shards_keep=0: must be a whole number >= 1$"),
    ("+loss.a=1", "loss.kwargs.a"),
    ("optimizer.lr=abc", "optimizer.lr='abc': must be a number > 0"),
    ("optimizer.lr=0", "optimizer.lr=0"),
    ("optimizer.momentum=1.5", "optimizer.momentum"),
    ("optimizer.weight_decay=true", "optimizer.weight_decay"),
    ("scheduler.warmup_steps=2.5", "scheduler.warmup_steps"),
    ("scheduler.min_factor=-0.1", "scheduler.min_factor"),
    ("metrics.topk=5", "metrics.topk=5: must be a list"),
    ("metrics.topk=[1,0]", "metrics.topk"),
    ("metrics.simlex=maybe", "metrics.simlex"),
    ("metrics.score_chunk_size=0", "metrics.score_chunk_size"),
    ("metrics.timing_every=-1", "metrics.timing_every"),
    # not finite: an lr of inf trained to nan and stopped with a traceback
    ("optimizer.lr=inf", r"^optimizer.lr=inf: must be a number > 0$"),
    ("optimizer.lr=nan", "optimizer.lr=nan: must be a number > 0"),
    ("optimizer.weight_decay=inf", "optimizer.weight_decay=inf"),
    ("scheduler.min_factor=nan", "scheduler.min_factor=nan"),
    ("optimizer.embedding_lr=-1", r"^optimizer.embedding_lr=-1: must be a number > 0, or null for optimizer.lr$"),
    ("optimizer.head_lr=inf", "optimizer.head_lr=inf"),
    # before the data is read, not after
    ("metrics.perplexity=maybe", r"^metrics.perplexity='maybe': must be auto, true or false$"),
    ("objective=top5_error", r"^objective='top5_error': must be <split>/<metric> of results.json with the split "
                             r"val or test, such as val/top5_error$"),  # it trained, then failed with a traceback
    ("objective=test/top5_error test=false", r"with the split val \(test=false\)"),
    # a metric the run does not write: refused before the data is read, not when the results are in
    ("objective=val/mrrr", r"^objective='val/mrrr': this run writes no val/mrrr; did you mean val/mrr\? the choices "
                           r"are val/loss, val/top1_error, .*val/mrr, val/perplexity, "
                           r"val/simlex_rho, val/simlex_pairs$"),
    ("objective=val/top3_error metrics.topk=[1,5]", r"the choices are val/loss, val/top1_error, val/top5_error, val/mrr,"),
    ("objective=test/perplexity metrics.perplexity=false", r"this run writes no test/perplexity; .* test/mrr, test/simlex"),
    # the head's own settings (spherical/settings.py's Setting): before the data is read, not when the head is built
    ("head.lr=-1", r"^head.lr=-1: lr must be finite and positive, got -1$"),
    ("head.clip_norm=-1", r"^head.clip_norm=-1: clip_norm must be finite and positive, or None or 0 for none"),
    ("head.reduction=meann", r"^head.reduction='meann': reduction must be one of \('mean', 'mean_real', 'sum'\)"),
    ("head=naive head.weight_decay=nan", r"^head.weight_decay=nan: weight_decay must be finite and >= 0"),
    # and its step's driving (spherical/driving.py's Driving): before the data is read, not when the head is built
    ("head.step=fusedd", r"^head: step must be one of \('autograd', 'fused', 'cuda_graph'\), not 'fusedd'$"),
    ("head.sync_every=0", r"^head: sync_every must be an int >= 1, got 0$"),
    ("head.compile_step=maybe", r"^head: compile must be one of \('auto', True, False\), got 'maybe'$"),
    ("head.batch_sizes=[0]", r"^head: batch_sizes must be 'pow2' or a non-empty sequence of positive ints"),
    ("head.parallel=nope", r"^head: parallel must be one of \('none', 'replicated', 'sharded'\), got 'nope'$"),
    ("head.step=cuda_graph head.sync_every=1", r"^head: step='cuda_graph' replays a step that reads nothing on the host"),
    # the optimiser's and the schedule's names: refused before the data is read, not after
    ("optimizer.name=adamm", r"^optimizer.name must be one of \['adam', 'adamw', 'sgd'\], not 'adamm'$"),
    ("optimizer.embedding=row_adamm", r"^optimizer.embedding must be one of \['row_adam', "),
    ("optimizer.head_rows=row_adamm", r"^optimizer.head_rows must be one of \['row_adam', "),
    ("scheduler.name=cosin", r"^scheduler.name must be constant, linear or cosine, not 'cosin'$"),
    ("compile=autoo", r"^compile must be auto, true, false or a torch.compile mode \(default, "),
    ("scheduler.over=budgett", r"^scheduler.over must be one of \('budget', 'steps'\), not 'budgett'$"),
    # Lightning's TypeError traceback (abc), or its line after the data was read (0)
    ("trainer=ddp_cpu trainer.devices=abc", r"^trainer.devices='abc': must be a number of devices"),
    ("trainer.devices=0", r"^trainer.devices=0: must be"),
    ("trainer.devices=-2", "trainer.devices=-2"),
    ("trainer.devices=[]", r"trainer.devices=\[\]"),
    ("+trainer.num_nodes=0", r"^trainer.num_nodes=0: must be a whole number >= 1$"),
])
def test_bad_values_are_refused_with_their_key(override, match):
    with pytest.raises(ValueError, match=match):
        check_config(cfg_of(*override.split()))


def test_an_interpolation_that_does_not_resolve_is_named_by_its_key():
    """``name=${nosuch}``: lst-train's line named no key (the key was read without one)."""
    from omegaconf.errors import InterpolationKeyError  # noqa: PLC0415

    from lst_lightning.app.errors import bad_input_message  # noqa: PLC0415

    with pytest.raises(InterpolationKeyError) as info:
        check_config(cfg_of("name=${nosuch}"))
    assert bad_input_message(info.value) == "name: Interpolation key 'nosuch' not found"


@pytest.mark.parametrize("override", ["trainer.max_steps=-1", "trainer.max_steps=0", "trainer.max_epochs=null",
                                      "trainer.limit_train_batches=0.25", "trainer.limit_val_batches=0",
                                      "trainer.val_check_interval=0.5", "trainer.val_check_interval=00:00:00:30",
                                      "trainer.gradient_clip_val=null", "optimizer.lr=1", "scheduler.min_factor=0",
                                      "metrics.topk=[1]", "metrics.timing_every=0", "clock=cpu", "seed=0", "head_checkpoint=per_rank",
                                      "seed=4294967295", "optimizer.head_lr=null", "optimizer.embedding_lr=0.1",
                                      "metrics.perplexity=true", "objective=val/mrr", "objective=test/top5_error",
                                      "trainer.devices=2", "trainer.devices=-1", "trainer.devices=auto",
                                      "trainer.devices=[0,1]", "trainer.devices='0,1'", "trainer.devices='-1'"])
def test_good_values_pass(override):
    check_config(cfg_of(override))


def test_missing_or_unreadable_checkpoint(tmp_path):
    """A missing file, and one torch.load cannot read (cut short, another kind of file: it failed in
    the workers, "pop from empty list"), each in one line before anything starts."""
    with pytest.raises(FileNotFoundError, match="ckpt_path="):
        check_config(cfg_of(f"ckpt_path={tmp_path}/last.ckpt"))
    torch.save({"global_step": 3}, tmp_path / "whole.ckpt")
    whole = (tmp_path / "whole.ckpt").read_bytes()
    for name, data in (("cut.ckpt", whole[:len(whole) // 2]), ("last.ckpt", b"x"), ("config.yaml", b"seed: 0\n")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=f"ckpt_path={tmp_path}/{name}: the file is not a checkpoint "
                                             "torch.load can read") as err:
            check_config(cfg_of(f"ckpt_path={tmp_path}/{name}"))
        assert "\n" not in str(err.value)
    check_config(cfg_of(f"ckpt_path={tmp_path}/whole.ckpt"))
    torch.save({"global_step": 3}, tmp_path / "legacy.ckpt", _use_new_zipfile_serialization=False)
    check_config(cfg_of(f"ckpt_path={tmp_path}/legacy.ckpt"))


@pytest.mark.parametrize("arg,match", [("loss.a=-1", "write loss.kwargs.a=-1"), ("+loss.eps=0.1", "loss.kwargs.eps"),
                                       ("loss.kwargs_a=1", "not a setting of the loss group")])
def test_loss_parameters_are_named_under_kwargs(arg, match):
    with pytest.raises(ValueError, match=match):
        check_overrides([arg])


def test_negatives_with_another_loss_are_refused_in_one_line():
    with pytest.raises(ValueError, match="head.negatives.num=8: .*loss=sampled.*with loss=zloss there are none"):
        check_overrides(["loss=zloss", "head.negatives.num=8"])
    check_overrides(["head.negatives.num=8"])                       # the default loss=sampled
    check_overrides(["loss=zloss", "loss=sampled", "head.negatives.num=8"])  # the last choice counts
    check_overrides(["-m", "loss=zloss,sampled", "head.negatives.num=8"])    # a sweep: the job decides


def test_preconditioner_settings_with_another_loss_are_refused_in_one_line():
    with pytest.raises(ValueError, match="head.preconditioner.beta=0.9: .*loss=sampled.*turn it on first: "
                                         "head/preconditioner=sampled"):
        check_overrides(["loss=zloss", "head.preconditioner.beta=0.9"])
    check_overrides(["head.preconditioner.beta=0.9"])                                   # the default loss
    check_overrides(["loss=zloss", "head/preconditioner=sampled", "head.preconditioner.beta=0.9"])


def test_loss_settings_and_other_overrides_pass():
    check_overrides(["loss.kwargs.a=-1", "loss=mse", "trainer.max_steps=3", "head.lr=3", "-m", "--cfg"])
    check_overrides(["head=factored,naive", "head.lr=3", "optimizer.head_lr=0.1"])


@pytest.mark.parametrize("args,match", [
    (["loss.head_lr=0.5"], "loss.head_lr is no longer a setting: .* write head.lr=0.5"),
    (["head=softmax", "head.lr=0.1"], r"head.lr=0.1: .* SoftmaxHead is trained by the optimizer, .*\(write "
                                      "optimizer.head_lr=0.1\\)"),
    (["head=factored,sampled", "head.lr=0.1"], "SampledSoftmaxHead .*write optimizer.head_lr=0.1"),
])
def test_an_old_lr_key_names_the_new_one(args, match):
    """head.lr is only a self-updating head's own SGD lr; an ordinary head's is optimizer.head_lr."""
    with pytest.raises(ValueError, match=match):
        check_overrides(args)


def test_every_metric_a_run_writes_is_an_objective(wandb_sweep):
    """The split metrics of a run's results.json (a job of the sweep wandb_sweep makes: experiment=tiny) are
    objectives ``check_config`` accepts: its list is the run's own names (run_keys.split_metrics)."""
    results = json.loads((wandb_sweep / "0" / "results.json").read_text())
    metrics = cfg_of("experiment=tiny").metrics
    for split in ("val", "test"):
        assert results[split]
        for metric in results[split]:
            check_objective(f"{split}/{metric}", True, metrics)


@pytest.mark.parametrize("override", ["optimizer.embedding=auto", "optimizer.embedding=row_adam optimizer.name=sgd",
                                      "optimizer.head_rows=sparse_sgd", "scheduler.name=constant scheduler.over=steps",
                                      "compile=max-autotune", "compile=false", "head.step=cuda_graph",
                                      "head.step=fused head.sync_every=1 head.compile_step=false"])
def test_the_optimisers_and_schedules_names_pass(override):
    check_config(cfg_of(*override.split()))
