"""The factored head under a PEFT adapter (LoRA on the attention's projections): the head steps with
the adapter's training, the frozen body stays frozen, and merging the adapter then exporting the head
gives the logits the adapted model gave; under the HF Trainer, whose checkpoints of a PEFT model hold
the adapter alone, head_follows_trainer saves the head beside it and a resumed run continues bit for
bit. peft is not in uv.lock (it would change the python_code
corpus, made of the lock's packages): ``uv run --with peft pytest tests/integrations/test_peft.py``."""
import pickle

import pytest
import torch

from lst_lightning.integrations import export_dense_head, factor_lm_head, factored_head, head_follows_trainer
from lst_lightning.integrations.trainer import HEAD_FILE

from .conftest import batch, tiny
from .test_trainer import Rows

peft = pytest.importorskip("peft")


def test_lora_on_a_factored_model_trains_the_adapter_and_the_head_and_merges_to_the_same_logits():
    model = factor_lm_head(tiny("llama"), loss="zloss", lr=0.5)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()}
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    head = factored_head(model)
    assert head is model.base_model.model.lm_head  # found through the adapter's wrappers
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    start = {n: p.detach().clone() for n, p in adapters.items()}
    opt = torch.optim.AdamW(adapters.values(), lr=1e-2)
    ids, mask, labels = batch()
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert int(head.steps) == 4 and losses[-1] < losses[0]
    assert all(not torch.equal(p, start[n]) for n, p in adapters.items())  # the adapter trained
    for name, p in model.base_model.model.named_parameters():
        if name in frozen:  # the body's own weights: frozen by the adapter
            assert torch.equal(p, frozen[name]), name
    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids, attention_mask=mask).logits
    merged = export_dense_head(model.merge_and_unload())
    assert isinstance(merged.lm_head, torch.nn.Linear)
    with torch.no_grad():
        plain = merged(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(plain, adapted, rtol=1e-5, atol=1e-5)


def adapted():
    model = factor_lm_head(tiny("llama"), loss="zloss", lr=0.5)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def run(out, resume=None):
    """Six optimizer steps of two micro-batches, a checkpoint every three; the model's whole state."""
    from transformers import Trainer, TrainingArguments

    model = adapted()
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=6, learning_rate=1e-2, lr_scheduler_type="linear", report_to=[], use_cpu=True,
                             save_strategy="steps", save_steps=3, disable_tqdm=True, seed=0)
    Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[head_follows_trainer()]).train(
        resume_from_checkpoint=resume)
    assert "load_adapter" not in vars(model)  # the Trainer's folder noted, the model as it was
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_peft_models_trainer_checkpoint_holds_the_head_and_resumes_exactly(tmp_path):
    whole = run(tmp_path / "a")
    assert (tmp_path / "a" / "checkpoint-3" / HEAD_FILE).is_file()
    assert int(whole["base_model.model.lm_head.steps"]) == 6
    for resume, out in ((str(tmp_path / "a" / "checkpoint-3"), tmp_path / "b"), (True, tmp_path / "a")):
        resumed = run(out, resume=resume)  # from another run's folder, and the latest in output_dir
        assert whole.keys() == resumed.keys()
        assert all(torch.equal(whole[k], resumed[k]) for k in whole)  # bit for bit, the head's state and the adapter's


def test_a_peft_model_given_to_a_trainer_that_never_trains_still_pickles(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = adapted()
    Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True),
            callbacks=[head_follows_trainer()])
    again = pickle.loads(pickle.dumps(model))
    assert torch.equal(factored_head(again).V, factored_head(model).V)


def test_resuming_a_peft_checkpoint_without_the_heads_file_is_refused(tmp_path):
    run(tmp_path / "a")
    (tmp_path / "a" / "checkpoint-3" / HEAD_FILE).unlink()
    with pytest.raises(ValueError, match="resuming a PEFT model at step 3: the checkpoint holds the PEFT adapter "
                                         "alone.*not at"):
        run(tmp_path / "b", resume=str(tmp_path / "a" / "checkpoint-3"))


def test_the_best_model_loaded_at_the_end_has_the_best_checkpoints_head(tmp_path):
    """``load_best_model_at_end``: the Trainer loads the best checkpoint's adapter alone (a PEFT
    model's); head_follows_trainer loads that checkpoint's head with it. It was left at the last
    step's head, beside the best step's adapter. (The best is the highest eval loss here: an
    earlier checkpoint than the last.)"""
    from safetensors.torch import load_file
    from transformers import Trainer, TrainingArguments

    model = adapted()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=6, report_to=[],
                             use_cpu=True, disable_tqdm=True, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                             save_steps=2, load_best_model_at_end=True, metric_for_best_model="loss",
                             greater_is_better=True)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(), eval_dataset=Rows(4),
                      callbacks=[head_follows_trainer()])
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and not best.endswith("checkpoint-6")
    saved, head = load_file(f"{best}/{HEAD_FILE}"), factored_head(model).state_dict()
    assert saved.keys() <= head.keys() and all(torch.equal(saved[k], head[k]) for k in saved)


def test_lm_head_in_modules_to_save_is_refused_in_one_line():
    """PEFT's modules_to_save would copy the head (its D x d state twice) and train the copy."""
    model = factor_lm_head(tiny("llama"), loss="zloss", lr=0.5)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                       modules_to_save=["lm_head"]))
    with pytest.raises(ValueError, match="modules_to_save.*leave it out"):
        factored_head(model)
