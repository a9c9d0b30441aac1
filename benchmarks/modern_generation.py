"""Greedy generation with today's small checkpoints' shapes: aiayn vs Hugging Face ``generate``.

Random weights at the published shapes (hub downloads are out of reach here), float32, batch 1,
a 16-token prompt (``--prompt``: longer ones, where the prefill and the sliding layers' window
count) and ``--new`` new tokens, greedy, no end token:

- Qwen2.5-0.5B: D 896, 24 layers, 14 query / 2 key-value heads, SwiGLU F 4864, biases on q, k, v,
  vocabulary 151,936 tied, RoPE base 1e6 (``Qwen2ForCausalLM``);
- Gemma-3-1B: D 1152, 26 layers, 4 query heads of width 256 / 1 key-value head, GEGLU F 6912,
  sandwich norms, QK-norm, vocabulary 262,144 tied, 5 of 6 layers sliding with a window of 512
  (``Gemma3ForCausalLM``);
- on request (``--shapes gemma-2-2b``), Gemma-2-2B: D 2304, 26 layers, 8 query / 4 key-value heads
  of width 256, GEGLU F 9216, sandwich norms, every other layer sliding (4096), scores and logits
  soft-capped (50, 30), vocabulary 256,000 tied (``Gemma2ForCausalLM``). In float32 it needs
  10 GB a side: ``--layers N`` keeps the first N layers at the published widths. transformers
  soft-caps only in its eager attention (SDPA would drop the cap), so that side runs eager, as
  its docs say for Gemma 2; aiayn's soft-capping kernel is the reference one (eq. 1 written out).

The aiayn side is ``aiayn.from_pretrained``'s model (``from_transformers``: the same weights) and
``aiayn.decoding.generation.generate``; HF runs ``generate`` on SDPA attention, as its docs
recommend. Both sides must produce the same tokens. Medians over alternating rounds; the ratio is
aiayn's tokens/s over HF's. On a CPU both are bound by reading the weights once a token
(2 GB for Qwen, 4 GB for Gemma in float32). ``kv_cache_mb``: the keys and values each side's cache
holds at the end of the generation (aiayn's static cache, sliding layers a ring of W slots; HF's
``DynamicCache``, sliding layers W - 1 positions), from the untimed call that checks the tokens.

    python3 benchmarks/modern_generation.py --out benchmarks/results/modern_generation.json
    python3 benchmarks/modern_generation.py --shapes gemma-2-2b --layers 8 \
        --out benchmarks/results/modern_generation_gemma2.json
    python3 benchmarks/modern_generation.py --shapes gemma-3-1b --layers 6 --prompt 4096 --new 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from common import alternate, cpu_name, save_results, setup

PROMPT = 16
SHAPES = {
    "qwen2.5-0.5b": dict(config="Qwen2Config", model="Qwen2ForCausalLM", fields=dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        tie_word_embeddings=True, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # transformers runs Gemma 2's soft-capped scores only in its eager attention (SDPA drops the
    # cap), as its docs say to; aiayn in its reference kernel, the one that soft-caps
    "gemma-2-2b": dict(config="Gemma2Config", model="Gemma2ForCausalLM", attention="eager",
                       fields=dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=4096, max_position_embeddings=8192, tie_word_embeddings=True,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    "gemma-3-1b": dict(config="Gemma3TextConfig", model="Gemma3ForCausalLM", fields=dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=512, max_position_embeddings=32768, tie_word_embeddings=True)),
}


DEFAULT_SHAPES = ["qwen2.5-0.5b", "gemma-3-1b"]  # Gemma 2 on request: 10 GB a side in float32


def build(shape: str, scale: float, layers: int | None = None):
    """The HF model of ``shape`` (``scale`` < 1 shrinks widths and depth, for the tests; ``layers``
    keeps the first ``layers`` layers, the widths as published)."""
    import transformers

    spec = SHAPES[shape]
    fields = dict(spec["fields"])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    if scale < 1:
        for name in ("hidden_size", "intermediate_size", "vocab_size"):
            fields[name] = max(64, int(fields[name] * scale) // 64 * 64)
        fields["num_hidden_layers"] = max(2, int(fields["num_hidden_layers"] * scale))
        if "head_dim" in fields:
            fields["head_dim"] = fields["query_pre_attn_scalar"] = 32
        else:
            fields["hidden_size"] = fields["num_attention_heads"] * 32
    config = getattr(transformers, spec["config"])(**fields, bos_token_id=0, eos_token_id=0,
                                                   pad_token_id=0)
    torch.manual_seed(0)
    model = getattr(transformers, spec["model"])._from_config(
        config, attn_implementation=spec.get("attention", "sdpa"))
    return model.eval()


def cache_megabytes(layers) -> float:
    """MB of keys and values held by ``layers``: objects with ``keys`` and ``values`` tensors, or
    (keys, values) pairs (transformers' legacy cache)."""
    pairs = [(layer.keys, layer.values) if hasattr(layer, "keys") else layer for layer in layers]
    return sum(keys.nbytes + values.nbytes for keys, values in pairs) / 1e6


def run(shapes: list[str], *, new: int, rounds: int, scale: float,
        layers: int | None = None, prompt_length: int = PROMPT) -> list[dict]:
    from aiayn.decoding.generation import Steps, generate
    from aiayn.interop.hf import from_transformers

    class Keeping(Steps):
        """Plain steps that keep the last cache they made (to weigh it)."""

        def new_cache(self, model, batch, capacity):
            self.cache = super().new_cache(model, batch, capacity)
            return self.cache

    rows = []
    for shape in shapes:
        hf = build(shape, scale, layers)
        ours = from_transformers(hf)
        prompt = torch.randint(1, hf.config.vocab_size, (1, prompt_length),
                               generator=torch.Generator().manual_seed(0))

        def aiayn_side(steps=None):
            with torch.inference_mode():
                return torch.tensor(generate(ours, prompt, max_new_tokens=new, greedy=True,
                                             steps=steps).tokens)

        def hf_side(**options):
            with torch.inference_mode():
                return hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                   num_beams=1, max_new_tokens=new, min_new_tokens=new,
                                   pad_token_id=0, eos_token_id=None, **options)

        keeping = Keeping()
        ours_tokens = aiayn_side(keeping)
        hf_out = hf_side(return_dict_in_generate=True)
        same = torch.equal(ours_tokens, hf_out.sequences[:, prompt_length:])
        hf_cache = getattr(hf_out, "cache", None) or hf_out.past_key_values
        kv_mb = dict(aiayn=cache_megabytes(keeping.cache.self_attention),
                     hf=cache_megabytes(getattr(hf_cache, "layers", hf_cache)))
        keeping = hf_out = hf_cache = None
        began = time.perf_counter()
        timing = alternate({"aiayn": aiayn_side, "hf": hf_side}, rounds=rounds, warmup=0)
        parameters = sum(p.numel() for p in hf.parameters())
        row = dict(shape=shape, layers=hf.config.num_hidden_layers, parameters=parameters,
                   prompt_tokens=prompt_length, new_tokens=new, same_tokens=same,
                   kv_cache_mb=kv_mb,
                   aiayn_tokens_per_s=new / timing.median("aiayn"),
                   hf_tokens_per_s=new / timing.median("hf"),
                   ratio=timing.median("hf") / timing.median("aiayn"),
                   seconds=timing.seconds, wall_s=time.perf_counter() - began)
        print(f"{shape}: {parameters / 1e6:.0f}M parameters, aiayn "
              f"{row['aiayn_tokens_per_s']:.2f} tok/s, HF {row['hf_tokens_per_s']:.2f} tok/s, "
              f"ratio {row['ratio']:.3f}, same tokens: {same}, KV cache MB aiayn "
              f"{kv_mb['aiayn']:.1f} HF {kv_mb['hf']:.1f}", flush=True)
        rows.append(row)
        hf = ours = None  # free both before the next shape is built
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=DEFAULT_SHAPES)
    parser.add_argument("--new", type=int, default=32, help="new tokens per generation")
    parser.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="shrink the shapes (tests); 1: the published sizes")
    parser.add_argument("--layers", type=int, default=None,
                        help="keep only the first N layers (widths as published; memory)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    setup()
    rows = run(args.shapes, new=args.new, rounds=args.rounds, scale=args.scale,
               layers=args.layers, prompt_length=args.prompt)
    if args.out:
        import transformers

        save_results(Path(args.out), dict(
            command="python3 benchmarks/" + " ".join(sys.argv[0].split("/")[-1:] + sys.argv[1:]),
            cpu=cpu_name(), threads=torch.get_num_threads(), torch=torch.__version__,
            transformers=transformers.__version__, rows=rows))


if __name__ == "__main__":
    main()
