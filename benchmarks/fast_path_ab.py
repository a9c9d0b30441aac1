"""A/B of aiayn's fast paths against the plain paths they replace, alternating in one process.

Each fast path can be switched off at run time, so "before" and "after" run on the same model, inputs
and machine state (alternating, medians), with the peer (HF) timed alongside:

- ``beam``: the beam loop of generation.py (shared cross-attention memory, in-place prefix reorder
  of the KV cache, vocabulary-major output projection) vs the plain loop (memory repeated per beam,
  cross keys/values reordered, allocating reorder, ``linear`` head); the tokens must be identical;
- ``greedy``: ``aiayn.decoding.sampling.generate`` (batch 8) with and without the vocabulary-major
  output projection;
- ``greedy1``: the same at batch 1;
- ``encoder``: encoder inference with large products through MKL ("before": ``nn.Linear``) and
  through oneDNN with the FFN activation fused ("after": ``aiayn.onednn_linear.enabled``);
- ``encoder-padded``: encoder inference on the padded batch with the padding kept ("before") and
  skipped (``aiayn.packed_sequences.enabled``), both with oneDNN's products; outputs compared at the
  real positions;
- ``encoder-train-padded``: a training step (forward, backward, AdamW) of the same encoder on the
  padded batch, padding kept and skipped, against HF's ``BertModel``; the loss reads the real
  positions only (the mean square of their hidden states), as a task loss does;
- ``lm``, ``seq2seq``, ``seq2seq-torch``: a training step of lm_train.py / seq2seq_train.py with
  oneDNN's products off and on (each its own model copy; the peer is HF GPT-2, HF Marian,
  ``torch.nn.Transformer``; "hf" in the output);
- ``encoder-128-rows``, ``seq2seq-128-rows``: encoder inference of one 128-token sequence and a
  training step of seq2seq_train.py at batch 2 (128 rows a product) with oneDNN's products from
  256 rows ("before", ``onednn_linear.MIN_ROWS`` until the ninth pass) and from ``MIN_ROWS``;
- ``beam-folded``: the ``beam`` loop with the cross-attention unfolded ("before") and with its
  projections folded into the cached memory (``aiayn.attention.folded_cross``); tokens identical;
- ``encoder-residual``, ``encoder-residual-padded``: encoder inference with each residual sum in a
  new tensor ("before") and written into the sub-layer's output (``aiayn.layers.owns_output``);
  outputs identical;
- ``beam-topk``: the ``beam`` loop selecting each step's candidates with ``torch.topk`` ("before")
  and through block maxima (``aiayn.decoding.top_k``); tokens identical;
- ``lm-bf16``: lm_train.py's training step under CPU bf16 autocast (every side, HF's too) with the
  loss's plain logits path ("before", as until the twelfth pass) and the chunked loss (its products
  in bf16);
- ``lm-scratch``, ``seq2seq-scratch``: a training step of lm_train.py / seq2seq_train.py with the
  chunked loss's logits in a fresh buffer every chunk ("before") and in its reused buffer
  (``linear_cross_entropy.logits_scratch``; the float32 MKL path, oneDNN off);
- ``lm-vocab-blocks``, ``seq2seq-vocab-blocks``: the same steps with each chunk's logits projected
  in one product ("before") and in vocabulary blocks of ``linear_cross_entropy.VOCAB_BLOCK`` rows
  (the float32 MKL path, oneDNN off);
- ``lm-gemm-attention``, ``seq2seq-gemm-attention``: the training steps of lm_train.py (vs HF) and
  seq2seq_train.py (vs torch.nn) with attention through ``F.scaled_dot_product_attention`` ("before")
  and through batched products (``aiayn.attention.gemm_attention``);
- ``lm-compile-gemm-attention``: lm_train.py's ``aiayn+compile`` step (layers compiled) with the
  attention traced into the graphs as SDPA ("before") and through batched products between them;
- ``lm-sigmoid-gelu``: lm_train.py's step with GPT-2's GELU through ``F.gelu(approximate="tanh")``
  ("before") and through the sigmoid (``aiayn.sigmoid_gelu``);
- ``greedy-uncopied``, ``beam-uncopied``: ``greedy`` / ``beam`` with the derived weight copies
  switched off (``small_rows_enabled = False``, the memory-lean setting), the steps' products through
  MKL ("before") and through oneDNN on the weights as they are (``uses_uncopied_step``);
- ``greedy-split-rows``, ``greedy4-split-rows``: greedy generation at batch 8 / 4 with the derived
  weight copies switched off and PyTorch's own product for the few-row steps ("before") against the
  weights split across the threads as they are (``aiayn.inference_linear.split_rows``; oneDNN on
  the uncopied weights off on both sides, as where PyTorch runs AVX2 kernels);
- ``encoder-bf16``, ``greedy-bf16``: encoder inference / greedy batch 8 under CPU bf16 autocast
  (every side), autocast's own products ("before") and the packed bf16 weight copies
  (``aiayn.inference_linear.bf16_packed_linear``).

``--baseline pass2`` switches off the fast paths of the decode passes after the first (derived
weights for few rows, ``aiayn.inference_linear.small_rows_linear``, the packed layer weights and the
split one-row products), so "before" is the code the first pass left; ``--baseline pass3`` only those
of the fourth pass (the layers' packed weights at 2..64 rows, ``split_gemv`` at one row); the default
``plain`` switches off every fast path of the variant.

    python3 benchmarks/fast_path_ab.py beam greedy greedy1 encoder --rounds 8
    python3 benchmarks/fast_path_ab.py lm seq2seq seq2seq-torch --rounds 10
    python3 benchmarks/fast_path_ab.py encoder-padded encoder-train-padded --rounds 10
    python3 benchmarks/fast_path_ab.py encoder-128-rows seq2seq-128-rows --rounds 20
    python3 benchmarks/fast_path_ab.py greedy1 beam greedy --baseline pass3 --rounds 6
    python3 benchmarks/fast_path_ab.py beam-folded --rounds 20
    python3 benchmarks/fast_path_ab.py beam-topk --rounds 20
    python3 benchmarks/fast_path_ab.py encoder-residual encoder-residual-padded --rounds 16
    python3 benchmarks/fast_path_ab.py lm-bf16 --rounds 9
    python3 benchmarks/fast_path_ab.py lm-scratch seq2seq-scratch --rounds 12
    python3 benchmarks/fast_path_ab.py lm-vocab-blocks seq2seq-vocab-blocks --rounds 12
    python3 benchmarks/fast_path_ab.py lm-gemm-attention seq2seq-gemm-attention --rounds 12
    python3 benchmarks/fast_path_ab.py lm-compile-gemm-attention lm-sigmoid-gelu --rounds 12
    python3 benchmarks/fast_path_ab.py greedy-uncopied beam-uncopied --rounds 9
    python3 benchmarks/fast_path_ab.py encoder-bf16 greedy-bf16 --rounds 9
    python3 benchmarks/fast_path_ab.py greedy-split-rows greedy4-split-rows --rounds 9
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

from common import setup
import encoder_inference
import generation
import lm_train
import seq2seq_train
from peers import aiayn_from_hf, hf_marian

from aiayn import inference_linear, layers, onednn_linear, packed_sequences, sigmoid_gelu
from aiayn.attention import folded_cross, gemm_attention
from aiayn.attention.cache import KVCache
from aiayn.decoding import top_k as top_k_module
from aiayn.models.heads import OutputProjection
from aiayn.training import linear_cross_entropy


BASELINE = "plain"  # set by --baseline


@contextlib.contextmanager
def switched_off(*names: str):
    """The ``aiayn.inference_linear`` switches ``names`` off for the duration."""
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(setting(inference_linear, name, False))
        yield


def no_small_rows():
    """Without the few-row paths of decoding steps: derived weights (output projection and layers)
    and split products (one row, and 2..8 rows without copies)."""
    return switched_off("small_rows_enabled", "split_gemv_enabled", "split_rows_enabled")


@contextlib.contextmanager
def plain_decoding():
    """The decode paths as they were before issue 6: allocating reorder, ``linear`` head, no derived
    weights; with ``--baseline pass2`` only the few-row paths are off, with ``pass3`` only the fourth
    pass's (packed layer weights, split one-row products)."""
    if BASELINE in ("pass2", "pass3"):
        with (no_small_rows() if BASELINE == "pass2"
              else switched_off("packed_layers_enabled", "split_gemv_enabled")):
            yield
        return
    def allocating_reorder(self, index, *, filled=None):
        self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)

    with (setting(KVCache, "reorder", allocating_reorder),
          setting(OutputProjection, "VOCABULARY_MAJOR_ROWS", (1, 0)), no_small_rows()):
        yield


@contextlib.contextmanager
def setting(module, name: str, value):
    """``module.name`` set to ``value`` for the duration (a module switch or a benchmark's shape)."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


ROWS_BEFORE = 256  # onednn_linear.MIN_ROWS until the ninth pass
WHOLE_VOCABULARY = 1 << 40  # a vocabulary block larger than any vocabulary: one product a chunk


@torch.inference_mode()
def plain_beam_loop(model, src, beams: int, new_tokens: int) -> torch.Tensor:
    """The beam loop before issue 6: memory repeated per beam, every cache reordered, history copied."""
    batch, config = src.shape[0], model.config
    memory = model.encode(src).repeat_interleave(beams, dim=0)  # (B*K, S, D)
    cache = model.new_cache(batch * beams, new_tokens + 1)
    tokens = torch.full((batch * beams, 1), config.decoder_start_id, dtype=torch.long)
    scores = torch.zeros(batch, beams)
    scores[:, 1:] = float("-inf")
    history = torch.empty(batch * beams, new_tokens + 1, dtype=torch.long)
    history[:, 0] = config.decoder_start_id
    offsets = (torch.arange(batch) * beams)[:, None]  # (B, 1)
    for step in range(new_tokens):
        logits = model.decode(tokens, memory if step == 0 else None, cache=cache)[:, -1]
        log_probs = logits.float().log_softmax(dim=-1)  # (B*K, V)
        vocab = log_probs.shape[-1]
        candidates = (scores.view(-1, 1) + log_probs).view(batch, beams * vocab)
        scores, flat = candidates.topk(beams, dim=-1)  # (B, K)
        origin = (flat // vocab + offsets).view(-1)
        tokens = (flat % vocab).view(-1, 1)
        history = history.index_select(0, origin)
        history[:, step + 1] = tokens[:, 0]
        cache.reorder(origin)
    return history.index_select(0, scores.argmax(dim=-1) + offsets[:, 0])


def beam_variants() -> dict:
    torch.manual_seed(0)
    hf = hf_marian(d_model=256, layers=3, heads=4, d_ff=1024, vocab=8192, positions=512).eval()
    model = aiayn_from_hf(hf).eval()
    src = torch.randint(3, 8192, (generation.BEAM_BATCH, generation.SOURCE))
    peer = generation.build_beam(["hf"])["hf"]

    def before():
        with plain_decoding():
            if BASELINE in ("pass2", "pass3"):
                return generation.beam_loop(model, src, generation.BEAMS, generation.BEAM_NEW)
            return plain_beam_loop(model, src, generation.BEAMS, generation.BEAM_NEW)

    def after():
        return generation.beam_loop(model, src, generation.BEAMS, generation.BEAM_NEW)

    assert torch.equal(before(), after()), "fast and plain beam search disagree"
    return {"before": before, "after": after, "hf": peer}


def folded_beam_variants() -> dict:
    """generation.py's beam loop with its cross-attention unfolded ("before") and folded."""
    sides = beam_variants()
    after = sides["after"]

    def before():
        with setting(folded_cross, "folding_enabled", False):
            return after()

    assert torch.equal(before(), after()), "folded and unfolded beam search disagree"
    return {"before": before, "after": after, "hf": sides["hf"]}


def top_k_beam_variants() -> dict:
    """generation.py's beam loop selecting its candidates with ``torch.topk`` ("before") and through
    block maxima (``aiayn.decoding.top_k``); tokens identical."""
    sides = beam_variants()
    after = sides["after"]

    def before():
        with setting(top_k_module, "MIN_LENGTH", 1 << 62):
            return after()

    assert torch.equal(before(), after()), "block and plain top-k beam search disagree"
    return {"before": before, "after": after, "hf": sides["hf"]}


def greedy_variants(batch: int = 8) -> dict:
    sides = generation.build_greedy(["aiayn", "hf"], batch)

    def before():
        with plain_decoding():
            return sides["aiayn"]()

    assert torch.equal(before(), sides["aiayn"]()), "fast and plain greedy decoding disagree"
    return {"before": before, "after": sides["aiayn"], "hf": sides["hf"]}


def uncopied_variants(decoding: str) -> dict:
    """generation.py's greedy batch 8 / beam loop with the derived weight copies switched off, the
    steps' products through MKL ("before", as until the thirteenth pass) and through oneDNN on the
    weights as they are (``inference_linear.uses_uncopied_step``); tokens identical."""
    sides = greedy_variants() if decoding == "greedy" else beam_variants()
    fast = sides["after"]

    def before():
        with switched_off("small_rows_enabled", "uncopied_steps_enabled"):
            return fast()

    def after():  # switched on whatever the CPU's default (off where PyTorch runs AVX2 kernels)
        with switched_off("small_rows_enabled"), setting(inference_linear, "uncopied_steps_enabled",
                                                         True):
            return fast()

    assert torch.equal(before(), after()), "uncopied and plain decoding disagree"
    return {"before": before, "after": after, "hf": sides["hf"]}


def split_rows_variants(batch: int) -> dict:
    """generation.py's greedy loop at ``batch`` rows with the derived weight copies switched off and
    oneDNN on the uncopied weights off (as with AVX2 kernels): PyTorch's own product of the few rows
    ("before") against ``inference_linear.split_rows``; tokens identical."""
    sides = greedy_variants(batch)
    fast = sides["after"]

    def before():
        with switched_off("small_rows_enabled", "uncopied_steps_enabled", "split_rows_enabled"):
            return fast()

    def after():
        with switched_off("small_rows_enabled", "uncopied_steps_enabled"):
            return fast()

    assert torch.equal(before(), after()), "split and plain decoding disagree"
    return {"before": before, "after": after, "hf": sides["hf"]}


def encoder_variants() -> dict:
    sides = encoder_inference.build_sides(["aiayn", "hf"])

    def before():
        with setting(onednn_linear, "enabled", False):
            return sides["aiayn"]()

    def after():
        with setting(onednn_linear, "enabled", True):
            return sides["aiayn"]()

    difference = (after() - before()).abs().max().item()
    assert difference < 1e-3, f"oneDNN and plain encoder differ by {difference}"
    return {"before": before, "after": after, "hf": sides["hf"]}


def padded_encoder_variants() -> dict:
    sides = encoder_inference.build_sides(["aiayn", "hf"], padded=True)

    def before():
        with setting(packed_sequences, "enabled", False):
            return sides["aiayn"]()

    real = encoder_inference.padded_batch()[1]  # (B, T) True = real token
    difference = (sides["aiayn"]() - before())[real].abs().max().item()
    assert difference < 1e-3, f"packed and padded encoder differ by {difference} at real tokens"
    return {"before": before, "after": sides["aiayn"], "hf": sides["hf"]}


def residual_encoder_variants(padded: bool) -> dict:
    sides = encoder_inference.build_sides(["aiayn", "hf"], padded=padded)

    def before():
        with setting(layers, "owns_output", lambda sublayer, last: False):
            return sides["aiayn"]()

    assert torch.equal(before(), sides["aiayn"]()), "residual sums in place and not disagree"
    return {"before": before, "after": sides["aiayn"], "hf": sides["hf"]}


def bf16_lm_training_variants() -> dict:
    """lm_train.py's step under bf16 autocast: the plain loss path ("before") and the chunked one."""
    sides = lm_train.build_sides(256, ["aiayn", "hf"])

    def autocast(step):
        def call():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return step()
        return call

    def plain_loss(hidden):
        return False

    def before():
        with setting(linear_cross_entropy, "fused_loss_applies", plain_loss):
            return autocast(sides["aiayn"])()

    return {"before": before, "after": autocast(sides["aiayn"]), "hf": autocast(sides["hf"])}


def _under_bf16_autocast(call):
    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return call()
    return run


def bf16_inference_variants(kind: str) -> dict:
    """Encoder inference / greedy batch 8 under CPU bf16 autocast (every side, HF's too): autocast's
    own products ("before": ``inference_linear.autocast_bf16_enabled = False``) and the packed bf16
    weight copies (``inference_linear.bf16_packed_linear``)."""
    sides = (encoder_inference.build_sides(["aiayn", "hf"]) if kind == "encoder"
             else generation.build_greedy(["aiayn", "hf"], 8))
    after = _under_bf16_autocast(sides["aiayn"])

    def before():
        with switched_off("autocast_bf16_enabled"):
            return after()

    if kind == "encoder":
        difference = (after().float() - before().float()).abs().max().item()
        assert difference < 0.1, f"bf16 encoder paths differ by {difference}"
    return {"before": before, "after": after, "hf": _under_bf16_autocast(sides["hf"])}


def padded_encoder_training_variants() -> dict:
    """Training steps on the padded batch: aiayn with the padding kept ("before", its own model and
    optimizer) and skipped ("after"), and HF's BertModel, all from the same weights."""
    from common import aiayn_optimizer, peer_optimizer
    from peers import hf_bert

    ids, mask = encoder_inference.padded_batch()
    torch.manual_seed(0)
    shapes = dict(d_model=encoder_inference.D_MODEL, layers=encoder_inference.LAYERS,
                  heads=encoder_inference.HEADS, d_ff=encoder_inference.D_FF,
                  vocab=encoder_inference.VOCAB, positions=512)
    hf = hf_bert(**shapes).train()
    ours = {name: aiayn_from_hf(hf).train() for name in ("before", "after")}
    optimizers = {name: aiayn_optimizer(model) for name, model in ours.items()}
    hf_optimizer = peer_optimizer(hf, fused=True)
    hf_mask = mask.long()

    def step(name: str):
        with setting(packed_sequences, "enabled", name == "after"):
            loss = ours[name](ids, padding_mask=mask)[mask].pow(2).mean()
            loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)
        return loss.detach()

    def hf_step():
        hidden = hf(input_ids=ids, attention_mask=hf_mask).last_hidden_state
        loss = hidden[mask].pow(2).mean()
        loss.backward()
        hf_optimizer.step()
        hf_optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    difference = abs(step("before").item() - step("after").item())  # same weights and batch
    assert difference < 1e-4, f"packed and padded training losses differ by {difference}"
    return {"before": lambda: step("before"), "after": lambda: step("after"), "hf": hf_step}


def training_variants(ours: str, peer: str, build,
                      switch=(onednn_linear, "enabled", False, True)) -> dict:
    """A training step of the benchmark's aiayn side with ``switch`` = (module, name, before value,
    after value) set each way (by default oneDNN's products off and on), each on its own copy of the
    model and optimizer, and the peer's step."""
    module, name, before_value, after_value = switch
    sides = build([ours, peer])
    sides_after = build([ours])

    def before():
        with setting(module, name, before_value):
            return sides[ours]()

    def after():
        with setting(module, name, after_value):
            return sides_after[ours]()

    difference = abs(before().item() - after().item())  # the first step: same weights and batch
    assert difference < 1e-4, f"{name} {before_value} / {after_value}: losses differ by {difference}"
    return {"before": before, "after": after, "hf": sides[peer]}


# (module, name, before, after) switches of the training fast paths compared by the variants below.
SCRATCH = (linear_cross_entropy, "scratch_enabled", False, True)
VOCAB_BLOCKS = (linear_cross_entropy, "VOCAB_BLOCK", WHOLE_VOCABULARY, linear_cross_entropy.VOCAB_BLOCK)
GEMM_ATTENTION = (gemm_attention, "enabled", False, True)
SIGMOID_GELU = (sigmoid_gelu, "enabled", False, True)


def lm_training_variants(switch) -> dict:
    """lm_train.py's step (d 256) with ``switch`` each way, and HF GPT-2's."""
    return training_variants("aiayn", "hf", lambda which: lm_train.build_sides(256, which), switch)


def seq2seq_training_variants(switch, *, peer: str = "marian") -> dict:
    """seq2seq_train.py's step with ``switch`` each way (the model built from ``peer``'s weights),
    and the peer's."""
    return training_variants(f"aiayn<-{peer}", peer, seq2seq_train.build_sides, switch)


def few_rows_encoder_variants() -> dict:
    with setting(encoder_inference, "BATCH", 1):  # one sequence of 128 tokens: 128 rows a product
        sides = encoder_inference.build_sides(["aiayn", "hf"])

    def before():
        with setting(onednn_linear, "MIN_ROWS", ROWS_BEFORE):
            return sides["aiayn"]()

    difference = (sides["aiayn"]() - before()).abs().max().item()
    assert difference < 1e-3, f"oneDNN and MKL encoder differ by {difference}"
    return {"before": before, "after": sides["aiayn"], "hf": sides["hf"]}


def few_rows_training_variants() -> dict:
    """seq2seq_train.py's step at batch 2 (2 x 64 = 128 rows), each side its own model copy."""
    with setting(seq2seq_train, "BATCH", 2):
        return training_variants("aiayn<-marian", "marian", seq2seq_train.build_sides,
                                 (onednn_linear, "MIN_ROWS", ROWS_BEFORE, onednn_linear.MIN_ROWS))


VARIANTS = {"beam": beam_variants, "greedy": greedy_variants,
            "greedy1": lambda: greedy_variants(batch=1), "encoder": encoder_variants,
            "encoder-padded": padded_encoder_variants,
            "encoder-train-padded": padded_encoder_training_variants,
            "lm": lambda: training_variants("aiayn", "hf",
                                            lambda which: lm_train.build_sides(256, which)),
            "seq2seq": lambda: training_variants("aiayn<-marian", "marian", seq2seq_train.build_sides),
            "seq2seq-torch": lambda: training_variants("aiayn<-torch.nn", "torch.nn",
                                                       seq2seq_train.build_sides),
            "encoder-128-rows": few_rows_encoder_variants,
            "seq2seq-128-rows": few_rows_training_variants, "beam-folded": folded_beam_variants,
            "beam-topk": top_k_beam_variants,
            "encoder-residual": lambda: residual_encoder_variants(padded=False),
            "encoder-residual-padded": lambda: residual_encoder_variants(padded=True),
            "lm-bf16": bf16_lm_training_variants,
            "lm-scratch": lambda: lm_training_variants(SCRATCH),
            "seq2seq-scratch": lambda: seq2seq_training_variants(SCRATCH),
            "lm-vocab-blocks": lambda: lm_training_variants(VOCAB_BLOCKS),
            "seq2seq-vocab-blocks": lambda: seq2seq_training_variants(VOCAB_BLOCKS),
            "lm-gemm-attention": lambda: lm_training_variants(GEMM_ATTENTION),
            "lm-sigmoid-gelu": lambda: lm_training_variants(SIGMOID_GELU),
            "lm-compile-gemm-attention": lambda: training_variants(
                "aiayn+compile", "hf", lambda which: lm_train.build_sides(256, which), GEMM_ATTENTION),
            "seq2seq-gemm-attention": lambda: seq2seq_training_variants(GEMM_ATTENTION,
                                                                        peer="torch.nn"),
            "greedy-uncopied": lambda: uncopied_variants("greedy"),
            "beam-uncopied": lambda: uncopied_variants("beam"),
            "greedy-split-rows": lambda: split_rows_variants(8),
            "greedy4-split-rows": lambda: split_rows_variants(4),
            "encoder-bf16": lambda: bf16_inference_variants("encoder"),
            "greedy-bf16": lambda: bf16_inference_variants("greedy")}


def measure(variants: dict, rounds: int) -> dict[str, float]:
    """Median seconds per call of each variant, alternating the order every round."""
    names = list(variants)
    for name in names:
        variants[name]()
    seconds = {name: [] for name in names}
    for round_index in range(rounds):
        for name in names if round_index % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            variants[name]()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in seconds.items()}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", nargs="+", choices=sorted(VARIANTS))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--baseline", choices=("plain", "pass2", "pass3"), default="plain")
    args = parser.parse_args(argv)
    global BASELINE
    BASELINE = args.baseline
    setup()
    for name in args.which:
        median = measure(VARIANTS[name](), args.rounds)
        print(f"{name:<8} before {median['before'] * 1e3:8.1f} ms  after {median['after'] * 1e3:8.1f} ms"
              f"  hf {median['hf'] * 1e3:8.1f} ms  before/after {median['before'] / median['after']:.3f}"
              f"  hf/after {median['hf'] / median['after']:.3f}  hf/before "
              f"{median['hf'] / median['before']:.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
