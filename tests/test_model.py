"""GPT.generate on a tiny model: it samples in eval mode but hands the model back in the caller's mode
(a training loop that samples mid-run must keep training), and greedy decoding with the KV cache picks
what a full forward pass over the whole sequence picks."""

from __future__ import annotations

import torch

from ghostvis_core.plan.config import ModelConfig
from ghostvis_core.run.model.gpt import GPT

PROMPT = [1, 5, 9, 2]


def tiny_model() -> GPT:
    """Weights far larger than the 0.02 init, so greedy picks differ from step to step (with the init's
    near-uniform logits every step picks the same token, and a wrong KV cache would go unnoticed)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=32, max_seq_len=16)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(std=0.5)
    return model


def greedy_without_cache(model: GPT, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def test_generate_restores_training_mode():
    model = tiny_model().train()
    model.generate(PROMPT, 5)
    assert model.training and all(m.training for m in model.modules())


def test_generate_keeps_eval_mode():
    model = tiny_model().eval()
    model.generate(PROMPT, 5)
    assert not model.training


def test_greedy_output_is_unchanged_by_the_mode_and_matches_a_full_forward():
    model = tiny_model()
    from_training = model.train().generate(PROMPT, 8)
    from_eval = model.eval().generate(PROMPT, 8)
    assert from_training == from_eval == greedy_without_cache(model, PROMPT, 8)
    assert len(from_training) == 8


def test_the_rl_sampler_never_draws_a_padding_id_of_the_models_vocabulary():
    """Issue 45: a 20-token tokenizer under a vocabulary padded to 32 (as 531 -> 576). With the padding rows'
    logits the largest, unmasked sampling draws them (KeyError decoding them, in the rl stage); the rl sampler
    draws only ids the tokenizer has."""
    from ghostvis_core.plan.config import GRPOConfig
    from ghostvis_core.run.train.grpo import sample_group

    model = tiny_model()
    with torch.no_grad():
        model.lm_head.weight[20:] *= 50  # padding rows: never trained, here the likeliest
    cfg = GRPOConfig(group_size=2, max_new_tokens=6, temperature=1.0)
    unmasked = [t for g in range(8) for t in model.generate(PROMPT, 6, temperature=1.0, generator=gen(g))]
    assert max(unmasked) >= 20  # the bug: padding ids are drawn
    drawn = [t for c in sample_group(model, torch.tensor(PROMPT).numpy(), cfg, (), 0, range(8), 20) for t in c]
    assert len(drawn) == 48 and max(drawn) < 20
    assert max(model.generate(PROMPT, 6, vocab=20)) < 20  # greedy too


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
