"""DeBERTa-v3 inference on the CPU: aiayn's encoder with disentangled attention (loaded from the
model) vs transformers' ``DebertaV2ForSequenceClassification`` with its default attention (the
only one transformers has for DeBERTa-v2: eager).

DeBERTa-v3-base's block (d_model 768, 12 heads, d_ff 3072, 256 position buckets up to distance
512, shared key/query projections of LayerNorm'd relative embeddings, c2p and p2c terms, no
absolute positions), 4 of its 12 layers, vocabulary 128100, random weights (transformers builds the
model from its config; aiayn loads it through ``aiayn.interop.hf.from_transformers``); a padded
batch of 8 x 128 tokens (lengths 96..128) with its attention mask on both sides. float32, 2
threads, inference mode; medians of alternating rounds after a warm-up. The logits are checked to
agree first.

    python3 benchmarks/deberta_inference.py --out benchmarks/results/deberta_inference.json
"""

from __future__ import annotations

import sys

import torch

from common import alternate, encoder_inference_main, setup

LAYERS, LENGTH, BATCH = 4, 128, 8


def hf_deberta(layers: int):
    import transformers

    config = transformers.DebertaV2Config(
        vocab_size=128100, hidden_size=768, num_hidden_layers=layers, num_attention_heads=12,
        intermediate_size=3072, max_position_embeddings=512, relative_attention=True,
        position_buckets=256, max_relative_positions=-1, norm_rel_ebd="layer_norm",
        share_att_key=True, pos_att_type="p2c|c2p", position_biased_input=False,
        layer_norm_eps=1e-7, type_vocab_size=0, num_labels=3)
    torch.manual_seed(0)
    return transformers.DebertaV2ForSequenceClassification(config).eval()


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """ids (B, T) and the padding mask (B, T), True = real token."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 128_000, (BATCH, LENGTH), generator=generator)
    lengths = torch.randint(LENGTH * 3 // 4, LENGTH + 1, (BATCH,), generator=generator)
    lengths[0] = LENGTH * 3 // 4
    mask = torch.arange(LENGTH) < lengths[:, None]  # (B, T)
    return ids.masked_fill(~mask, 0), mask  # DeBERTa's pad id


def run(*, rounds: int, layers: int) -> list[dict]:
    from aiayn.interop.hf import from_transformers

    setup()
    hf = hf_deberta(layers)
    ours = from_transformers(hf).eval()
    ids, mask = inputs()

    def aiayn_call():
        with torch.inference_mode():
            return ours(ids, padding_mask=mask)

    def hf_call():
        with torch.inference_mode():
            return hf(input_ids=ids, attention_mask=mask.long()).logits

    sides = {"aiayn": aiayn_call, "hf": hf_call}
    difference = (aiayn_call() - hf_call()).abs().max().item()
    assert difference < 1e-3, f"aiayn and DeBERTa differ by {difference}"
    timing = alternate(sides, rounds=rounds, warmup=2)
    tokens = BATCH * LENGTH
    return [dict(benchmark="DeBERTa-v3 classifier inference (padded)",
                 shape=f"d768 L{layers} T{LENGTH} B{BATCH}", ours="aiayn",
                 peer="hf-deberta-v2-eager", metric="tokens/s",
                 ours_value=tokens / timing.median("aiayn"),
                 peer_value=tokens / timing.median("hf"),
                 ratio=timing.median("hf") / timing.median("aiayn"),
                 max_abs_difference=difference)]


def main(argv: list[str]) -> None:
    encoder_inference_main("deberta_inference.py", __doc__.splitlines()[0], run, LAYERS, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
