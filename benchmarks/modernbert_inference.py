"""ModernBERT inference on the CPU: aiayn's encoder (loaded from the checkpoint) vs transformers'
``ModernBertModel``, as its docs recommend on a CPU (``attn_implementation="sdpa"``).

ModernBERT-base's block (d_model 768, 12 heads, d_ff 1152, GeGLU, bias-free pre-norm, RoPE with
bases 160,000 / 10,000, every third layer global, the others a local window of 128 keys), 6 of its
22 layers, vocabulary 50368, random weights (transformers builds the model from its config; aiayn
loads it through ``aiayn.interop.hf.from_transformers``); batch 8 x 512 tokens by default, so the
local layers' band masks 3/4 of the keys; ``--length`` up to ModernBERT's 8,192 positions (its
long-document inputs, where aiayn's local layers attend block by block). Two inputs: full-length
rows (no mask) and a padded batch (lengths 3/4 of the length to all of it) with its attention mask
on both sides. float32, 2 threads, inference mode; medians of alternating rounds after a warm-up.
The outputs are checked to agree first.

    python3 benchmarks/modernbert_inference.py --out benchmarks/results/modernbert_inference.json
    python3 benchmarks/modernbert_inference.py --length 8192 --batch 1 --rounds 3
"""

from __future__ import annotations

import sys

import torch

from common import alternate, encoder_inference_main, setup

LAYERS, LENGTH, BATCH = 6, 512, 8  # the defaults


def hf_modernbert(layers: int):
    import transformers

    config = transformers.ModernBertConfig(num_hidden_layers=layers, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.ModernBertModel(config).eval()


def inputs(padded: bool, length: int, batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids (B, T) and the padding mask (B, T), True = real token (None: full rows)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 50_000, (batch, length), generator=generator)
    if not padded:
        return ids, None
    lengths = torch.randint(length * 3 // 4, length + 1, (batch,), generator=generator)
    lengths[0] = length * 3 // 4
    mask = torch.arange(length) < lengths[:, None]  # (B, T)
    return ids.masked_fill(~mask, 50283), mask  # ModernBERT's pad id


def build_sides(hf, padded: bool, length: int, batch: int) -> dict:
    from aiayn.interop.hf import from_transformers

    ours = from_transformers(hf).eval()
    ids, mask = inputs(padded, length, batch)
    hf_mask = None if mask is None else mask.long()

    def aiayn_call():
        with torch.inference_mode():
            return ours(ids, padding_mask=mask)

    def hf_call():
        with torch.inference_mode():
            return hf(input_ids=ids, attention_mask=hf_mask).last_hidden_state

    real = torch.ones(batch, length, dtype=torch.bool) if mask is None else mask
    return {"aiayn": aiayn_call, "hf": hf_call}, real


def run(*, rounds: int, layers: int, length: int = LENGTH, batch: int = BATCH) -> list[dict]:
    setup()
    hf = hf_modernbert(layers)
    rows = []
    for padded in (False, True):
        sides, real = build_sides(hf, padded, length, batch)
        difference = (sides["aiayn"]() - sides["hf"]())[real].abs().max().item()
        assert difference < 1e-3, f"aiayn and ModernBERT differ by {difference} at real positions"
        timing = alternate(sides, rounds=rounds, warmup=2)
        tokens = batch * length
        rows.append(dict(benchmark="ModernBERT inference" + (" (padded)" if padded else ""),
                         shape=f"d768 L{layers} T{length} B{batch}", ours="aiayn",
                         peer="hf-modernbert-sdpa", metric="tokens/s",
                         ours_value=tokens / timing.median("aiayn"),
                         peer_value=tokens / timing.median("hf"),
                         ratio=timing.median("hf") / timing.median("aiayn"),
                         max_abs_difference=difference))
    return rows


def main(argv: list[str]) -> None:
    encoder_inference_main("modernbert_inference.py", __doc__.splitlines()[0], run, LAYERS, argv,
                           length=LENGTH, batch=BATCH)


if __name__ == "__main__":
    main(sys.argv[1:])
