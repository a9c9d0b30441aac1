"""Shared helpers for the Hugging Face interop tests: random HF models, inputs, the greedy loop."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import pytest
import torch

try:
    TRANSFORMERS_MAJOR = int(version("transformers").split(".")[0])
except PackageNotFoundError:  # the HF tests skip themselves (pytest.importorskip)
    TRANSFORMERS_MAJOR = 0


def needs_transformers_5(why: str):
    """Skip a test under transformers 4, saying why (``aiayn[hf]`` accepts transformers >= 4.40)."""
    return pytest.mark.skipif(0 < TRANSFORMERS_MAJOR < 5, reason=f"transformers 4: {why}")


def needs_hf_sdpa(*classes: str):
    """Skip a benchmark test whose HF peers (transformers classes by name) have no SDPA attention in
    the installed transformers: the benchmarks run HF as its docs recommend, on SDPA."""
    try:
        import transformers
    except ImportError:
        return pytest.mark.skip(reason="transformers is not installed")
    missing = [name for name in classes
               if not getattr(getattr(transformers, name), "_supports_sdpa", False)]
    return pytest.mark.skipif(bool(missing), reason=f"transformers {transformers.__version__}: no "
                              f"SDPA attention for {', '.join(missing)}")


# transformers 4 sizes a separate-vocabulary Marian's decoder embedding by the source vocabulary
# (transformers 5: the target's), and ties its head to it, so that its own forward fails.
MARIAN_SEPARATE_VOCAB_4 = needs_transformers_5(
    "a separate-vocabulary Marian's decoder embedding has the source vocabulary's rows and "
    "its tied head fails in transformers' own forward")


def randomise(hf_model, *, std: float = 0.2, skip: tuple[str, ...] = ("embed_positions",)) -> None:
    """Every weight (LayerNorms and logits biases included) random, so no parameter hides as 1 or 0."""
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, tensor in list(hf_model.named_parameters()) + list(hf_model.named_buffers()):
            if any(part in name for part in skip) or not tensor.is_floating_point():
                continue
            if name.endswith("final_logits_bias") or "LayerNorm" in name or "layer_norm" in name \
                    or "layernorm" in name or name.split(".")[-2].startswith("ln_"):
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.3
                             + (1.0 if name.endswith("weight") else 0.0))
            else:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * std)


def padded_ids(vocab: int, lengths: list[int], *, pad: int, low: int = 3, seed: int = 0):
    """Right-padded random ids (B, T) avoiding special ids below ``low``, and the mask (True = real)."""
    generator = torch.Generator().manual_seed(seed)
    length = max(lengths)
    ids = torch.randint(low, vocab, (len(lengths), length), generator=generator)
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    ids = ids.masked_fill(~mask, pad)
    return ids, mask


def max_diff_where(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest |a - b| over the real positions (mask (B, T) True) of (B, T, ...) tensors."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs()[mask].max().item()


@torch.no_grad()
def greedy_causal_lm(model, prompt: torch.Tensor, steps: int, eos: int | None) -> torch.Tensor:
    """Greedy decoding with aiayn's static KV cache: prompt (1, P) -> (1, P + generated)."""
    cache = model.new_cache(batch=prompt.shape[0], max_length=prompt.shape[1] + steps)
    logits = model(prompt, cache=cache)
    out = [prompt]
    for _ in range(steps):
        token = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        out.append(token)
        if eos is not None and token.item() == eos:
            break
        logits = model(token, cache=cache)
    return torch.cat(out, dim=1)


@torch.no_grad()
def greedy_seq2seq(model, src: torch.Tensor, src_mask: torch.Tensor, steps: int,
                   eos: int | None) -> torch.Tensor:
    """Greedy decoding of a ``Transformer`` with its cache: src (1, S) -> (1, 1 + generated)."""
    memory = model.encode(src, src_mask)
    cache = model.new_cache(batch=1, max_length=steps + 1)
    token = torch.full((1, 1), model.config.decoder_start_id, dtype=torch.long)
    out = [token]
    logits = model.decode(token, memory, memory_padding_mask=src_mask, cache=cache)
    for _ in range(steps):
        token = logits[:, -1].argmax(-1, keepdim=True)
        out.append(token)
        if eos is not None and token.item() == eos:
            break
        logits = model.decode(token, None, memory_padding_mask=src_mask, cache=cache)
    return torch.cat(out, dim=1)


def left_padded(vocab: int, lengths: list[int], *, seed: int = 0):
    """Left-padded random ids (B, T) (pad 0, real ids from 3) and the mask (True = real)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=generator)
    mask = torch.arange(width)[None, :] >= width - torch.tensor(lengths)[:, None]
    return ids.masked_fill(~mask, 0), mask


@torch.no_grad()
def padded_logits(hf, model, vocab: int, lengths: list[int]):
    """A decoder-only HF model's logits and an aiayn model's on the same rows, padded on the right
    and on the left (explicit positions): [(got, want, mask) right, (got, want, mask) left]."""
    ids, left_mask = left_padded(vocab, lengths)
    right_mask = left_mask.flip(1)
    right_ids = torch.stack([torch.cat([row[mask], row[~mask]])  # the same rows, padded right
                             for row, mask in zip(ids, left_mask)])
    positions = (left_mask.long().cumsum(1) - 1).clamp(min=0)
    return [(model(right_ids, padding_mask=right_mask),
             hf(right_ids, attention_mask=right_mask.long()).logits, right_mask),
            (model(ids, padding_mask=left_mask, positions=positions),
             hf(ids, attention_mask=left_mask.long(), position_ids=positions).logits, left_mask)]


def greedy_tokens_and_hf_generate(hf, model, vocab: int, *, new_tokens: int = 50):
    """50 greedy tokens of three left-padded prompts (9, 3 and 6 ids) from an aiayn decoder
    (``aiayn.decoding.generation.generate``) and from the HF model's ``generate`` with no early
    stop: (ours, theirs), each a list of three token lists."""
    from aiayn.decoding.generation import generate

    ids, mask = left_padded(vocab, [9, 3, 6], seed=5)
    prompts = [row[row_mask].tolist() for row, row_mask in zip(ids, mask)]
    got = generate(model, prompts, max_new_tokens=new_tokens, greedy=True).tokens
    hf.generation_config.eos_token_id = None  # every token generated, no early stop
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask.long(), do_sample=False, num_beams=1,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    return got, out[:, ids.shape[1]:].tolist()


def assert_round_trip(hf, ours, again, ids: torch.Tensor, *, path) -> None:
    """``again`` (transformers, loaded from ``ours`` written to ``path``) is ``hf``: the same
    logits on ``ids`` and every tensor bit for bit; ``ours`` gives the logits too, and reads
    ``path`` back to its own config."""
    import aiayn

    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(ours(ids), want, rtol=0, atol=1e-4)
    assert aiayn.from_pretrained(path).config == ours.config
    hf_state, again_state = hf.state_dict(), again.state_dict()
    assert hf_state.keys() == again_state.keys()
    for name in hf_state:
        torch.testing.assert_close(again_state[name], hf_state[name], rtol=0, atol=0, msg=name)
