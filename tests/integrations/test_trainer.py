import gc

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from lst_lightning.integrations import export_dense_head, factor_lm_head, head_follows_trainer, scheduled_lr

from round_trips import COPIES

from .conftest import VOCAB, batch, tiny


class Rows(torch.utils.data.Dataset):
    def __init__(self, n=12):
        ids, mask, labels = zip(*(tuple(t[0] for t in batch(m=1, seed=s)) for s in range(n)))
        self.rows = [dict(input_ids=i, attention_mask=m, labels=y) for i, m, y in zip(ids, mask, labels)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class HeadLrs(TrainerCallback):
    """The head's lr at each optimizer step (read after the head's callback has set it)."""

    def __init__(self, head):
        self.head, self.seen = head, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.seen.append(self.head.lr)


def test_trainer_steps_the_head_once_per_optimizer_step_following_the_schedule(tmp_path):
    model = factor_lm_head(tiny("llama"), loss="zloss", lr=0.5)
    head = model.lm_head
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=6, learning_rate=1e-2, lr_scheduler_type="linear", report_to=[], use_cpu=True,
                             save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0)
    lrs = HeadLrs(head)
    counts = []  # the Trainer passes num_items_in_batch: the loss is a sum over the accumulated tokens
    model.register_forward_pre_hook(lambda m, a, kw: counts.append(kw.get("num_items_in_batch")), with_kwargs=True)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[head_follows_trainer(), lrs])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert int(head.steps) == 6  # one exact step per optimizer step, not one per micro-batch
    assert len(counts) == 12 and all(c is not None and int(c) > 0 for c in counts)
    assert lrs.seen[0] == pytest.approx(0.5) and lrs.seen == sorted(lrs.seen, reverse=True) and lrs.seen[-1] < 0.2
    assert not head.attached and head.lr == 0.5


def test_the_trainer_without_head_follows_trainer_is_refused_before_anything_changes(tmp_path):
    """Without the callback the head would step at every micro-batch's backward (12 head steps for
    6 optimizer steps here) at its own lr, whatever the Trainer's schedule: refused in one line at
    the first training forward, the model as it was."""
    model = factor_lm_head(tiny("llama"), loss="zloss", lr=0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=6, learning_rate=1e-2, lr_scheduler_type="linear", report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True, seed=0)
    with pytest.raises(ValueError, match=r"without head_follows_trainer\(\).*callbacks=\[head_follows_trainer") as e:
        Trainer(model=model, args=args, train_dataset=Rows()).train()
    assert "\n" not in str(e.value)
    assert int(model.lm_head.steps) == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_with_an_optimizer_of_its_own_the_head_follows_its_schedule_not_args_learning_rate(tmp_path):
    """``Trainer(optimizers=(opt, None))`` with opt's lr 1e-3 and ``args.learning_rate`` at its
    default (5e-5): the head's lr is its own scaled by the schedule's fraction of opt's lr
    (0.5, then down the linear decay), not by lr / args.learning_rate (20 times its own)."""
    model = factor_lm_head(tiny("llama"), loss="zloss", lr=0.5)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=4,
                             lr_scheduler_type="linear", report_to=[], use_cpu=True, save_strategy="no",
                             disable_tqdm=True, seed=0)
    lrs = HeadLrs(model.lm_head)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    Trainer(model=model, args=args, train_dataset=Rows(), optimizers=(opt, None),
            callbacks=[head_follows_trainer(), lrs]).train()
    assert args.learning_rate == 5e-5 and lrs.seen == pytest.approx([0.5, 0.375, 0.25, 0.125])


def test_label_smoothing_is_refused_when_the_trainer_is_built(tmp_path):
    """The Trainer's label smoother pops the labels and computes the loss from logits, which the
    head does not make in training: refused in one line when the Trainer is built (it failed at
    the first backward: "element 0 of tensors does not require grad")."""
    model = factor_lm_head(tiny("llama"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = TrainingArguments(output_dir=str(tmp_path), label_smoothing_factor=0.1, max_steps=1, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True)
    with pytest.raises(ValueError, match="label_smoothing_factor=0.1 cannot train the factored head") as e:
        Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[head_follows_trainer()])
    assert "\n" not in str(e.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_several_gpus_in_one_process_are_refused_when_the_trainer_is_built(tmp_path, monkeypatch):
    """One process that sees several GPUs: the Trainer wraps the model in nn.DataParallel, whose
    copies of the head would each lose their step (the head refuses to train as a copy:
    tests/spherical/test_base.py). Refused in one line when the Trainer is built, naming torchrun.
    (The Trainer's GPU count is set to 2 here: this machine may have none.)"""
    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))
    model = factor_lm_head(tiny("llama"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                             disable_tqdm=True)
    with pytest.raises(ValueError, match=r"sees 2 GPUs in one process .*torchrun --nproc_per_node 2") as e:
        Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[head_follows_trainer()])
    assert "\n" not in str(e.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_compute_loss_func_is_refused_at_the_first_training_forward(tmp_path):
    """``Trainer(compute_loss_func=...)`` pops the labels and computes the loss from the logits,
    which carry no gradient (the head trains through its own loss): refused in one line at the
    first training forward, before any step (the callback cannot see the Trainer's argument). It
    failed at the first backward ("element 0 of tensors does not require grad")."""
    model = factor_lm_head(tiny("llama"), loss="zloss", lr=0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    called = []
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[head_follows_trainer()],
                      compute_loss_func=lambda outputs, labels, num_items_in_batch=None: called.append(1))
    with pytest.raises(ValueError, match="needs labels.*compute_loss_func") as e:
        trainer.train()
    assert "\n" not in str(e.value) and not called and trainer.state.global_step == 0
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert model.lm_head.attached and model.lm_head.pending_rows == 0  # the Trainer has no exception hook
    Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[head_follows_trainer()]).train()
    assert int(model.lm_head.steps) == 2 and not model.lm_head.attached  # a Trainer without it trains as usual


def test_a_model_trained_under_bf16_pickles_with_its_patched_forward(tmp_path):
    """accelerate wraps the forward in autocast under ``bf16=True``, a local function that cannot
    be pickled: after training the patched model has its own forward back, and ``torch.save`` /
    ``torch.load`` (and ``copy.deepcopy``) give a model whose loss is the model's."""
    model = factor_lm_head(tiny("llama"), loss="zloss", lr=0.5)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, bf16=True,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[head_follows_trainer()]).train()
    ids, mask, labels = batch()
    model.eval()
    for twin in (make(model) for make in COPIES):
        assert twin.forward.model is twin
        with torch.no_grad():
            assert torch.equal(twin(input_ids=ids, attention_mask=mask, labels=labels).loss,
                               model(input_ids=ids, attention_mask=mask, labels=labels).loss)


def run(out, resume=None, max_steps=6):
    model = factor_lm_head(tiny("llama"), loss="zloss", lr=0.5)
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=max_steps, learning_rate=1e-2, lr_scheduler_type="linear", report_to=[],
                             use_cpu=True, save_strategy="steps", save_steps=3, disable_tqdm=True, seed=0)
    Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[head_follows_trainer()]).train(
        resume_from_checkpoint=resume)
    return {k: v for k, v in model.state_dict().items()}


def test_a_trainer_checkpoint_resumes_exactly(tmp_path):
    whole = run(tmp_path / "a")
    resumed = run(tmp_path / "b", resume=str(tmp_path / "a" / "checkpoint-3"))
    assert int(whole["lm_head.steps"]) == 6 and whole.keys() == resumed.keys()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)  # bit for bit


def trained_with(out, batch_size, accumulate):
    model = factor_lm_head(tiny("llama"), loss="zloss", lr=0.5, dtype=torch.float64).double()
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=batch_size,
                             gradient_accumulation_steps=accumulate, max_steps=3, learning_rate=1e-2, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0, max_grad_norm=0.0)
    Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[head_follows_trainer()]).train()
    return model.state_dict()


def test_gradient_accumulation_under_the_trainer_is_exact(tmp_path):
    """Two micro-batches of 2 per step give the model that batches of 4 give: the body's
    gradients (num_items_in_batch) and the head's one step on the union of their rows."""
    whole, halves = trained_with(tmp_path / "a", 4, 1), trained_with(tmp_path / "b", 2, 2)
    assert int(halves["lm_head.steps"]) == 3
    assert not torch.allclose(whole["lm_head.V"], tiny("llama").lm_head.weight.double())
    # the repair at the end of training (the read of the flags) brings U's singular values into
    # their band along power iterations' vectors, which nearly equal singular values leave
    # ill-determined: (V, U) is one of many factorisations of W, which is compared
    W = {k: s["lm_head.V"] @ s["lm_head.U"] + s["lm_head.omega"] for k, s in (("whole", whole), ("halves", halves))}
    assert torch.allclose(W["whole"], W["halves"], rtol=1e-9, atol=1e-10)
    assert all(torch.allclose(whole[k], halves[k], rtol=1e-9, atol=1e-10) for k in whole if
               not k.startswith("lm_head.") or k.endswith(("Q", "wbar", "omega")))


def accelerate_loop(batch_size, accumulate, mixed_precision="no"):
    """A loop of your own under accelerate: ``Accelerator(gradient_accumulation_steps=...)``, its
    ``accumulate`` context and ``backward``, and the head attached to the optimizer it returns
    (an ``AcceleratedOptimizer``, which steps the torch optimizer at a window's end only)."""
    from accelerate import Accelerator  # noqa: PLC0415
    from accelerate.state import AcceleratorState, GradientState  # noqa: PLC0415

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    model = factor_lm_head(tiny("llama"), loss="zloss", lr=0.5, dtype=torch.float64).double()
    accelerator = Accelerator(gradient_accumulation_steps=accumulate, mixed_precision=mixed_precision, cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model.lm_head.attach(optimizer)
    ids = torch.randint(0, VOCAB, (12, 10), generator=torch.Generator().manual_seed(2))  # no padding: equal tokens
    for rows in ids.split(batch_size):
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=rows, labels=rows).loss)
            optimizer.step()
            optimizer.zero_grad()
    return model, model.state_dict()


def test_gradient_accumulation_in_an_accelerate_loop_is_exact():
    """``head.attach(accelerated_optimizer)``: the wrapper's torch optimizer is attached, so the head
    steps once a window, at the torch optimizer's step; two micro-batches of 2 a step give the model
    that batches of 4 give (the wrapper itself has no step hooks: attaching it raised AttributeError)."""
    (_, whole), (model, halves) = accelerate_loop(4, 1), accelerate_loop(2, 2)
    assert int(halves["lm_head.steps"]) == 3 and model.lm_head.attached
    assert all(torch.allclose(whole[k], halves[k], rtol=1e-9, atol=1e-10) for k in whole)


def test_a_model_accelerate_unwraps_from_mixed_precision_keeps_its_forward_and_pickles(tmp_path):
    """``unwrap_model(model, keep_fp32_wrapper=False)`` binds the forward accelerate wrapped in autocast
    to the model, as a class's function: the patched forward was then called with the model as its
    input ids (TypeError). It gives the exported model's logits, and the model pickles."""
    from accelerate import Accelerator  # noqa: PLC0415

    model, _ = accelerate_loop(2, 2, mixed_precision="bf16")
    plain = Accelerator().unwrap_model(model, keep_fp32_wrapper=False).eval()
    with pytest.raises(AttributeError, match=r"^LlamaForCausalLM's patched forward, bound to the model by "
                                             r"accelerate's unwrap_model.*: call the model once first"):
        torch.save(plain, tmp_path / "bound.pt")  # before its first call: refused with the fix
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = plain(input_ids=ids).logits
        assert torch.equal(plain(ids).logits, logits)
    torch.save(plain, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, logits)
        assert torch.allclose(export_dense_head(loaded)(input_ids=ids).logits, logits, rtol=1e-9, atol=1e-9)


def test_scheduled_lr_scales_the_heads_lr_and_stays_positive():
    assert scheduled_lr(0.5, 5e-3, 1e-2) == pytest.approx(0.25)
    assert 0 < scheduled_lr(0.5, 0.0, 1e-2) < 1e-20


def failing_trainer(model, out):
    """A Trainer whose train() raises at the 2nd micro-batch of its first window: a bad label."""
    calls = []

    def bad_second_label(module, args, kwargs):
        calls.append(1)
        if len(calls) == 2:
            kwargs["labels"] = kwargs["labels"].clone().fill_(10 ** 6)  # no such class
        return args, kwargs

    model.register_forward_pre_hook(bad_second_label, with_kwargs=True)
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=2, learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no",
                             disable_tqdm=True, seed=0)
    return Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[head_follows_trainer()])


def test_a_trainer_that_raised_mid_window_leaves_no_head_silently_attached(tmp_path):
    """A bad label in the 2nd micro-batch makes train() raise with one micro-batch's rows kept
    for an optimizer step that never comes. Plain loss.backward() afterwards does not grow
    them forever without a step: the next window's forward raises with the fix, and after
    head.detach() the head steps in each backward again. (Checks read at once, sync_every=1: the
    label raises in its micro-batch; device flags: the next test.)"""
    model = factor_lm_head(tiny("llama"), loss="zloss", lr=0.5, sync_every=1)
    head = model.lm_head
    trainer = failing_trainer(model, tmp_path)
    with pytest.raises(ValueError, match="outside"):
        trainer.train()  # the Trainer (and its optimizer) stays alive: the case the issue found
    assert head.attached and head.pending_rows > 0 and int(head.steps) == 0
    ids, mask, labels = batch(m=2)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()  # completes the dead window
    with pytest.raises(RuntimeError, match=r"head\.detach\(\)"):
        model(input_ids=ids, attention_mask=mask, labels=labels)
    head.detach()
    for _ in range(2):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert not head.attached and head.pending_rows == 0 and int(head.steps) == 2
    assert trainer.optimizer is not None


def test_under_device_flags_a_bad_label_voids_its_window_and_train_raises_at_its_end(tmp_path):
    """Device flags (the default): the window with the bad label is not stepped, training goes on
    to its end, where the read of the flags raises naming the step; the head is detached."""
    model = factor_lm_head(tiny("llama"), loss="zloss", lr=0.5)
    head = model.lm_head
    with pytest.raises(ValueError, match=r"the batch of step 1 had target ids outside"):
        failing_trainer(model, tmp_path).train()
    assert not head.attached and int(head.steps) == 1 and int(head.skipped_nonfinite) == 1


def test_a_head_whose_trainer_is_gone_drops_its_rows_with_a_warning(tmp_path):
    """The same failure with the Trainer dropped: its optimizer is gone, so the next training
    forward drops the kept rows with a warning and the head steps in each backward again."""
    model = factor_lm_head(tiny("llama"), loss="zloss", lr=0.5, sync_every=1)
    head = model.lm_head
    try:
        failing_trainer(model, tmp_path).train()
    except ValueError:
        pass
    gc.collect()
    ids, mask, labels = batch(m=2)
    with pytest.warns(UserWarning, match="optimizer it was attached to is gone"):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    assert not head.attached and head.pending_rows == 0 and int(head.steps) == 1


def test_the_trainer_route_reads_the_host_at_most_once_in_ten_optimizer_steps(tmp_path):
    """The HF Trainer with accumulation 2, 64 optimizer steps: the head's device flags are read
    every 64 steps and at the end of training (with the repairs then due): at most 0.1 host reads
    of the package's a step, counted from the third step (the first ones build the proposal
    tables and compile nothing on the CPU, but set up)."""
    from transformers import TrainerCallback  # noqa: PLC0415

    from host_reads import HostReads  # noqa: PLC0415

    class Count(TrainerCallback):
        reads = HostReads()

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:
                self.reads.__enter__()

        def on_train_end(self, args, state, control, **kwargs):
            self.reads.__exit__(None, None, None)

    model = factor_lm_head(tiny("llama"), loss="zloss", lr=0.5)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=66, learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no",
                             disable_tqdm=True, seed=0)
    count = Count()
    Trainer(model=model, args=args, train_dataset=Rows(n=264), callbacks=[head_follows_trainer(), count]).train()
    assert int(model.lm_head.steps) == 66
    assert count.reads.count / 64 <= 0.1, count.reads.sites
    assert count.reads.count >= 1  # the read at the end of training, at least


class Texts(torch.utils.data.Dataset):
    """Texts of random lengths (3 to 20 tokens), as a tokenizer gives them: unpadded."""

    def __init__(self, n=24, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.rows = [torch.randint(0, 12, (int(torch.randint(3, 21, (), generator=g)),), generator=g) for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}


def pad_to_longest(rows):
    """``DataCollatorWithPadding`` with causal-LM labels: each batch padded to its longest text, the
    padding masked and labelled -100, so that every batch has another number of rows."""
    T = max(r["input_ids"].numel() for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :r["input_ids"].numel()], mask[i, :r["input_ids"].numel()] = r["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_the_trainer_with_dynamic_padding_trains_the_compiled_head_with_a_graph_a_batch_size(tmp_path, monkeypatch):
    """Batches padded to their longest text (a new number of rows nearly every step), gradient
    accumulation 2, lst-train's default head compiled (``compile_step=True``; Dynamo and AOTAutograd
    without Inductor's code generation: the same graphs): it trains, one exact step an optimizer
    step, with at most a graph per batch size of the forward (batch_shapes.py: 16, 32, 64 rows)
    and of the records' step (up to 128 rows)."""
    from torch._dynamo.utils import counters  # noqa: PLC0415

    from lst_lightning.spherical import driver  # noqa: PLC0415

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="aot_eager", **kw))
    monkeypatch.setattr(driver, "_compiled", {})
    torch._dynamo.reset()
    counters.clear()
    model = factor_lm_head(tiny("llama"), loss="sampled", negatives=dict(num=8), preconditioner={}, lr=0.5,
                           compile_step=True)
    head = model.lm_head
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=6, learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no",
                             logging_steps=1, disable_tqdm=True, seed=0)
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].numel()), with_kwargs=True)
    trainer = Trainer(model=model, args=args, train_dataset=Texts(), data_collator=pad_to_longest,
                      callbacks=[head_follows_trainer()])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    try:
        assert head.compiles and int(head.steps) == 6 and int(head.skipped_nonfinite) == 0
        assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
        assert len(set(seen)) >= 5  # the batches' rows kept changing
        assert counters["stats"]["unique_graphs"] <= 3 + 4, counters["stats"]  # forward's sizes + the records'
    finally:
        torch._dynamo.reset()
