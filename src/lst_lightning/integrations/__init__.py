"""The factored head in the LM stacks people already use (docs/integrations.md):
Hugging Face transformers (``factor_lm_head``), trained by the Trainer
(``head_follows_trainer``) or any loop; litgpt's ``GPT`` (``factor_gpt_head``), trained by
Fabric or Lightning; and back to an ordinary model (``export_dense_head``). transformers is
imported inside the functions only, litgpt never."""
from .export import SphericalSampling, export_dense_head, sampling_logits
from .hf import factor_lm_head, factored_head, gather_head_for_checkpoint, untie_lm_head
from .litgpt import factor_gpt_head
from .trainer import head_follows_trainer, scheduled_lr

__all__ = ["SphericalSampling", "export_dense_head", "factor_gpt_head", "factor_lm_head", "factored_head",
           "gather_head_for_checkpoint", "head_follows_trainer", "sampling_logits", "scheduled_lr", "untie_lm_head"]
