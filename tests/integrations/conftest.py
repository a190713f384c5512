"""Tiny random-init models of the real transformers classes (nothing downloaded)."""
import pytest
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

VOCAB, HIDDEN = 48, 16
DECODER = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def tiny(family: str, **over):
    torch.manual_seed(0)
    if family == "gpt2":
        config = GPT2Config(**{**dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=1, n_head=2, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
                                      bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1), **over})
        model = GPT2LMHeadModel(config)
    else:
        cls, cfg = {"llama": (LlamaForCausalLM, LlamaConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config),
                    "mistral": (MistralForCausalLM, MistralConfig)}[family]
        model = cls(cfg(**{**DECODER, **over}))
    return model.float()


FAMILIES = ["llama", "qwen2", "gpt2", "mistral"]


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


def batch(m: int = 3, T: int = 10, seed: int = 1):
    """Input ids with repeated tokens, a right-padded attention mask and labels -100 on padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB // 4, (m, T), generator=g)  # a small range: tokens repeat
    lengths = torch.tensor([T, T - 3, T - 5])[:m]
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels
