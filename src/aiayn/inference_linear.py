"""Linear layers on CPU: derived weights for decoding steps, oneDNN for large products, bf16 autocast.

Large products (``onednn_linear.MIN_ROWS`` rows and more) go through oneDNN's ``linear`` instead of
``nn.Linear``'s MKL GEMM where ``aiayn.onednn_linear`` says so: by default on CPUs with AVX-512,
where oneDNN was 1-25 % faster (its docstring has the figures; on an AVX2 Zen 3 it was slower, on a
Zen 1 faster, so it is off there unless switched on). Under autograd that is
``onednn_linear.linear`` (forward and input gradient through oneDNN); without a gradient to record
(``torch.no_grad`` / ``torch.inference_mode``) the FFN's ReLU / GELU / SiLU is also applied in the
same oneDNN pass over the output (``linear_activation``). Switched off, below those rows, off CPU,
outside float32, under autocast, for a layer with forward hooks, or where the operator is missing, a
product of many rows is exactly ``nn.Linear``.

Decoding steps multiply a handful of rows (batch x beams) by the same weights step after step. There
a derived copy of the weight is made once and reused while the weight is unchanged (``PackedWeights``):

- the output projection (``small_rows_linear``, vocabulary-sized outputs): for one row the transposed
  (I, O) matrix, which MKL reads as a plain GEMV operand instead of repacking the (O, I) matrix on
  every call (measured, 1 thread, AMD EPYC: the 256 -> 8192 output projection 3.2 -> 1.5 ms a row),
  and for 2..64 rows oneDNN's prepacked (blocked) weight (``torch.ops.mkldnn._reorder_linear_weight``):
  256 -> 8192 at 8 rows 8.4 -> 4.1 ms, at 16 rows 10.6 -> 4.7 ms;
- the layers' own (D, 3D), (D, D), (D, F), (F, D) matrices (``linear`` / ``linear_activation`` at
  2..64 rows): oneDNN's prepacked weight, with the FFN's activation fused. Measured (2 threads, the 18
  products of a d256 3-layer decoder step, cold weights): 16 rows 5.1 -> 3.7 ms, 8 rows 3.7 -> 2.9
  ms, 4 rows 3.5 -> 2.3 ms. Not at one row: a GEMV is bound by reading the weights, whatever their
  layout (transposed copies measured 3-6 % slower in whole decoding runs, oneDNN's packed weight 20 %
  slower).

Where no copy is made (copies switched off, or a weight made under ``torch.inference_mode``, whose
changes could not be seen), the layers' products at 2..64 rows still go through oneDNN, on the weight
as it is (``uses_uncopied_step``): oneDNN reads the (O, I) matrix in place where MKL's GEMM repacks
all of it on every call. Measured (2 threads, cold weights, the 16 products of a 4-layer decoder
step, MKL / oneDNN): d256 1.16-1.55x, d512 1.25-1.70x at 2..64 rows; whole generations with the
copies switched off 1.06-1.19x (greedy batch 8, beam search of 4 x 4: ``benchmarks/fast_path_ab.py
greedy-uncopied beam-uncopied``), all on a Zen 4 with AVX-512; where PyTorch runs AVX2 kernels
MKL was faster (the same whole generations 0.967-0.971x), so there it is off by default. The
vocabulary-sized output projection takes it from 16 rows (``OutputProjection``; below, its
vocabulary-major product is faster).

Where no copy is made and oneDNN's uncopied products are off (AVX2), products of 2..8 rows (such
steps, and a prompt's or a sentence's forward of that few tokens) split the weight, as it is, across
the threads (``split_rows``: one batched product over row blocks of the weight, 1.12-1.16x whole
greedy generations at batch 4 / 8 against MKL's GEMM, which repacks the whole matrix on every
call); the output projection at 6..12 rows.

At one row with 2+ threads every product (layers and output projection) is ``split_gemv`` instead:
MKL runs a lone GEMV on one thread, so the weight, unchanged and uncopied, is multiplied as P
row blocks in one batched call that spreads over the threads (the 16 layer products of a d256 step
2.1 -> 1.7 ms, the 256 -> 8192 projection 0.72 ms with the transposed copy -> 0.58 ms).

The price is memory: one derived copy of every matrix a decoding step multiplies at 2..64 rows (and of
the output projection at one row on one thread). ``small_rows_enabled = False`` turns all of it off;
``packed_layers_enabled = False`` only the layers' part; ``split_gemv_enabled = False`` the one-row
split; ``split_rows_enabled = False`` the split of 2..8 rows;
``uncopied_steps_enabled = False`` the oneDNN products on uncopied weights. A derived copy is
rebuilt whenever its weight changes: in-place updates (an optimizer step, ``load_state_dict``,
``copy_``) bump the weight's version counter, ``.to()`` / ``.data = ...`` change its storage, and the
cache checks both on every call; fused optimizers update weights in place without moving the version
counter, so every optimizer step in the process (a global ``torch.optim`` step hook) invalidates all
copies as well.

Inside ``torch.compile`` (``generate(compile=True)``, ``beam_search(compile=True)``) the copies are
Python state a graph cannot hold, so a step's products of 2..64 rows become the custom operator
``aiayn::decoding_step_linear`` (``compiled_step_linear``), which looks the copy up when the graph
runs, and inductor fuses the rest of the step around it.

Under CPU bf16 autocast (no autograd) the float32 paths above stand aside, since autocast's
products are bf16: products of two or more rows multiply a oneDNN-packed bf16 copy of the weight
(``bf16_packed_linear``; the FFN's activation fused), kept while the weight is unchanged like the
copies above, instead of autocast casting every weight again in each forward; one row is
autocast's own. Measured (AMD EPYC Zen 4 with AVX512_BF16, 2 threads, everything under autocast,
HF's side too; ``benchmarks/fast_path_ab.py encoder-bf16 greedy-bf16``): all-MiniLM encoder
inference 1.06-1.12x autocast's own products, greedy generation at batch 8 1.38-1.42x.
``autocast_bf16_enabled = False`` turns it off.

Results equal ``linear`` (+ activation) up to summation order (tests/test_fast_paths.py,
tests/test_packed_weights.py; under bf16 autocast up to bf16 rounding, tests/test_bf16_inference.py).

Legend: N rows (batch x length), I input width, O output width.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from aiayn import onednn_linear

# activation name (aiayn.feedforward) -> oneDNN post-op (name, algorithm)
FUSED_ACTIVATIONS = {name: post_op for name, post_op in onednn_linear.POST_OPS.items()
                     if name != "none"}


_LINEAR_POINTWISE = onednn_linear.LINEAR_POINTWISE


def uses_onednn(x: Tensor, layer: nn.Linear) -> bool:
    """Whether ``linear`` would take the oneDNN path for input ``x`` (…, I), with or without
    autograd (``aiayn.onednn_linear.applies``, and no hook on the layer that the direct call would
    skip)."""
    return onednn_linear.applies(x, layer.weight) and not has_hooks(layer)


def has_hooks(layer: nn.Module) -> bool:
    """Whether a call of ``layer`` would run forward (pre-)hooks, its own or global ones: fast paths
    that skip the call must not apply then."""
    return bool(layer._forward_hooks or layer._forward_pre_hooks
                or nn.modules.module._global_forward_hooks
                or nn.modules.module._global_forward_pre_hooks)


def linear(layer: nn.Linear, x: Tensor) -> Tensor:
    """``layer(x)``: (…, I) -> (…, O); many rows through oneDNN when ``uses_onednn`` (with or without
    autograd); without autograd, one row through ``split_gemv``, 2..SMALL_ROWS rows through the
    layer's packed weight (``uses_packed_layer``), or where no copy is made through oneDNN on the
    weight as it is (``uses_uncopied_step``) or, at 2..SPLIT_ROWS_MAX rows, ``split_rows``."""
    # Decoding calls this ~100 times a token: the weight is fetched once (a module attribute lookup
    # costs as much as a small operator) and only the tests of the row count at hand run.
    if torch.is_grad_enabled():
        if uses_onednn(x, layer):
            return onednn_linear.linear(x, layer.weight, layer.bias)
        return layer(x)
    weight = layer.weight
    if torch.is_autocast_enabled("cpu"):  # the float32 paths below would ignore it
        if uses_bf16_packed(x, weight) and not has_hooks(layer):
            return bf16_packed_linear(x, weight, layer.bias)
        return layer(x)
    rows = x.numel() // x.shape[-1]
    if rows == 1:
        parts = split_gemv_parts(x, weight)
        if parts > 1:
            return split_gemv(x, weight, layer.bias, parts)
    elif 1 < rows <= SMALL_ROWS:
        if _packs_layer(x, weight):
            return _LINEAR_POINTWISE(x, _onednn_packed(weight), layer.bias, "none", [], "")
        if _steps_uncopied(x, weight):
            return uncopied_step_linear(x, weight, layer.bias)
        if compiled_step_applies(x, weight):
            return compiled_step_linear(x, weight, layer.bias)
        parts = split_rows_parts(x, weight)
        if parts > 1:
            return split_rows(x, weight, layer.bias, parts)
    elif uses_onednn(x, layer):
        return onednn_linear.linear(x, weight, layer.bias)
    return layer(x)


def linear_activation(layer: nn.Linear, x: Tensor, activation: str) -> Tensor | None:
    """``activation(layer(x))`` in one oneDNN call, or None when that path does not apply (the caller
    then runs its plain code). ``activation`` names an ``aiayn.feedforward`` activation."""
    if torch.is_grad_enabled():
        return None
    fused = FUSED_ACTIVATIONS.get(activation)
    if fused is None:
        return None
    weight = layer.weight
    if torch.is_autocast_enabled("cpu"):
        if uses_bf16_packed(x, weight) and not has_hooks(layer):
            return bf16_packed_linear(x, weight, layer.bias, activation)
        return None
    rows = x.numel() // x.shape[-1]
    if 1 < rows <= SMALL_ROWS:
        if _packs_layer(x, weight):
            return _LINEAR_POINTWISE(x, _onednn_packed(weight), layer.bias, fused[0], [], fused[1])
        if _steps_uncopied(x, weight):
            return _LINEAR_POINTWISE(x, weight, layer.bias, fused[0], [], fused[1])
        if compiled_step_applies(x, weight):
            return compiled_step_linear(x, weight, layer.bias, activation)
    elif rows > SMALL_ROWS and uses_onednn(x, layer):
        return onednn_linear.linear(x, weight, layer.bias, activation=activation)
    return None


# --- derived weights for decoding steps (few rows) -------------------------------------------------
SMALL_ROWS = 64  # decoding steps: batch x beams rows at most
PACKED_MIN_OUTPUTS = 4096  # oneDNN's packed weight pays off for vocabulary-sized outputs only
small_rows_enabled = True  # module switch (tests and A/B benchmarks turn it off)


def _onednn_reorder():
    try:
        return torch.ops.mkldnn._reorder_linear_weight
    except (AttributeError, RuntimeError):
        return None


_REORDER = _onednn_reorder() if _LINEAR_POINTWISE is not None else None


_optimizer_steps = 0  # every optimizer step in this process, counted by the hook below


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


# Fused optimizers (torch.optim.AdamW(fused=True), the trainer's default on CPU) update parameters in
# place without moving their version counters, so any optimizer step invalidates every derived copy.
register_optimizer_step_post_hook(_count_optimizer_step)


class PackedWeights:
    """Derived layouts of weights, rebuilt when their weight changes.

    An entry is keyed by the weight object and layout name and remembers the weight's storage (kept
    alive, so no other tensor can take its address while the entry exists), data pointer, version
    counter, shape, dtype and device, and the process's optimizer step count; any difference rebuilds
    it. Entries go when their weight is garbage collected.
    """

    def __init__(self):
        self._entries: dict[tuple[int, str], tuple] = {}

    def get(self, weight: Tensor, layout: str, build) -> Tensor:
        key = (id(weight), layout)
        entry = self._entries.get(key)
        if entry is not None:
            ref, storage, pointer, version, steps, shape, dtype, device, derived = entry
            if (ref() is weight and pointer == weight.data_ptr() and version == weight._version
                    and steps == _optimizer_steps and shape == weight.shape
                    and dtype == weight.dtype and device == weight.device):
                return derived
        with torch.no_grad():
            derived = build(weight.detach())
        ref = weakref.ref(weight, lambda _, key=key: self._entries.pop(key, None))
        self._entries[key] = (ref, weight.untyped_storage(), weight.data_ptr(), weight._version,
                              _optimizer_steps, weight.shape, weight.dtype, weight.device, derived)
        return derived

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


packed_weights = PackedWeights()


packed_layers_enabled = True  # module switch: the layers' own weights packed for 2..SMALL_ROWS rows


def uses_packed_layer(x: Tensor, layer: nn.Linear) -> bool:
    """Whether ``linear`` multiplies ``x`` by ``layer``'s oneDNN-packed weight: a decoding step
    (one new position per row: (N, 1, I), or (N, I)) of 2..SMALL_ROWS rows (batch x beams), no
    autograd, CPU float32, and a weight whose changes can be seen (not an inference tensor, which has
    no version counter). A prompt's prefill (N, T > 1, I) keeps ``linear``: the copy pays off only
    over many steps, and a batch-1 generation never multiplies more than one row after it."""
    return (1 < x.numel() // x.shape[-1] <= SMALL_ROWS and _packs_layer(x, layer.weight)
            and not torch.is_autocast_enabled("cpu"))


def _packs_layer(x: Tensor, weight: Tensor) -> bool:
    """``uses_packed_layer`` once the row count is known to be 2..SMALL_ROWS."""
    # is_inference() last: torch.compile cannot trace it, and the step test excludes compiling
    return (packed_layers_enabled and small_rows_enabled and _REORDER is not None
            and _eager_float32_step(x, weight) and not weight.is_inference())


def _float32_step(x: Tensor, weight: Tensor) -> bool:
    """A decoding step's product: one new position per row ((N, 1, I) or (N, I)), no autograd, CPU
    float32."""
    return ((x.dim() < 3 or x.shape[-2] == 1) and not torch.is_grad_enabled()
            and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32)


def _eager_float32_step(x: Tensor, weight: Tensor) -> bool:
    """What both few-row layer paths need besides their switches: ``_float32_step``, not inside
    ``torch.compile``."""
    return _float32_step(x, weight) and not torch.compiler.is_compiling()


# Module switch: oneDNN on the weight as it is where no copy is made. On by default where oneDNN's
# large products are (PyTorch running AVX-512 kernels, onednn_linear.prefers_onednn): on a Zen 4
# with AVX-512 hidden (AVX2 kernels) MKL's GEMM was faster for these steps too (whole generations
# without copies, greedy batch 8 / beam search, MKL / oneDNN: 1.030 / 1.034).
uncopied_steps_enabled = onednn_linear.prefers_onednn()


def uses_uncopied_step(x: Tensor, weight: Tensor) -> bool:
    """Whether a decoding step of 2..SMALL_ROWS rows that gets no derived copy (copies switched off,
    or the weight of an inference tensor) is multiplied by oneDNN on the weight as it is
    (``uncopied_step_linear``): CPU float32, no autograd, not inside ``torch.compile``."""
    return (1 < x.numel() // x.shape[-1] <= SMALL_ROWS and _steps_uncopied(x, weight)
            and not torch.is_autocast_enabled("cpu"))


def uncopied_step_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN on the uncopied weight; where
    ``uses_uncopied_step`` holds."""
    return _LINEAR_POINTWISE(x, weight, bias, "none", [], "")


def _steps_uncopied(x: Tensor, weight: Tensor) -> bool:
    """``uses_uncopied_step`` once the row count is known to be 2..SMALL_ROWS."""
    return (uncopied_steps_enabled and _LINEAR_POINTWISE is not None
            and _eager_float32_step(x, weight))


split_gemv_enabled = True  # module switch: one-row products split across threads


def split_gemv_parts(x: Tensor, weight: Tensor) -> int:
    """Into how many parts ``split_gemv`` cuts the product of the single row ``x`` (…, I) by
    ``weight`` (O, I): the thread count when it divides O, else 1 (the plain path)."""
    if not split_gemv_enabled or x.numel() != x.shape[-1]:
        return 1
    return _split_parts(x, weight)


def _split_parts(x: Tensor, weight: Tensor) -> int:
    """What both split products need besides their switch and row count: the thread count when it
    divides O, no autograd, CPU float32 without autocast; else 1."""
    if torch.is_grad_enabled():
        return 1
    parts = _thread_count()
    if (parts < 2 or weight.shape[0] % parts or x.device.type != "cpu" or x.dtype != torch.float32
            or weight.dtype != torch.float32 or torch.is_autocast_enabled("cpu")):
        return 1
    return parts


_threads_seen = torch.get_num_threads()


def _thread_count() -> int:
    """``torch.get_num_threads()``; inside ``torch.compile`` (which cannot trace that call) the count
    the last eager call saw, which the compiled graph then holds as a guarded constant."""
    global _threads_seen
    if not torch.compiler.is_compiling():
        _threads_seen = torch.get_num_threads()
    return _threads_seen


def split_gemv(x: Tensor, weight: Tensor, bias: Tensor | None, parts: int) -> Tensor:
    """``F.linear`` of one row x (…, I) -> (…, O) as ``parts`` GEMVs in one batched call.

    MKL runs a lone GEMV on one thread, so a decoding step at batch 1 reads its weights at one core's
    memory bandwidth; the batched product over row blocks of the same (unchanged, uncopied) weight
    runs one block per thread.
    """
    out_features, in_features = weight.shape
    blocks = weight.view(parts, out_features // parts, in_features)  # (P, O/P, I): a view
    # (1, I) transposed: an (I, 1) column that the batched GEMM reads in place for every block.
    column = x.reshape(1, in_features).t().expand(parts, in_features, 1)  # (P, I, 1)
    out = torch.bmm(blocks, column).view(*x.shape[:-1], out_features)  # (…, O)
    return out if bias is None else out.add_(bias)


# Module switch: products of 2..SPLIT_ROWS_MAX rows that get no derived copy split across threads.
split_rows_enabled = True
SPLIT_ROWS_MAX = 8


def split_rows_parts(x: Tensor, weight: Tensor, max_rows: int = SPLIT_ROWS_MAX) -> int:
    """Into how many parts ``split_rows`` cuts the product of 2..``max_rows`` rows ``x`` (…, I) by
    ``weight`` (O, I): the thread count when it divides O, else 1 (the plain path)."""
    if not split_rows_enabled or not 1 < x.numel() // x.shape[-1] <= max_rows:
        return 1
    return _split_parts(x, weight)


def split_rows(x: Tensor, weight: Tensor, bias: Tensor | None, parts: int) -> Tensor:
    """``F.linear`` of a few rows x (…, I) -> (…, O) as ``parts`` products in one batched call.

    Where a decoding step's weight has no derived copy (copies switched off, or an inference
    tensor), MKL's GEMM of a few rows repacks the whole (O, I) matrix on every call; the batched
    product over row blocks of the weight, as it is, runs one block per thread instead.
    Measured (2 threads, AVX2 kernels, the four products of a decoder layer, us, ``addmm`` / split):
    d 256 at 2 / 4 / 8 rows 1,191 / 793, 1,543 / 1,011, 1,587 / 1,327 (a GPT-2 step with its
    output projection, hot); d 512 and d 768 2-3x at 2..8 rows. From 16 rows ``addmm`` is faster.
    """
    out_features, in_features = weight.shape
    rows = x.numel() // in_features
    blocks = weight.view(parts, out_features // parts, in_features)  # (P, O/P, I): a view
    flat = x.reshape(1, rows, in_features).expand(parts, rows, in_features)  # (P, N, I)
    if bias is None:
        out = torch.bmm(flat, blocks.transpose(1, 2))  # (P, N, O/P)
    else:
        out = torch.baddbmm(bias.view(parts, 1, out_features // parts), flat,
                            blocks.transpose(1, 2))
    return out.transpose(0, 1).reshape(*x.shape[:-1], out_features)  # (N, P, O/P) -> (…, O)


def _onednn_packed(weight: Tensor) -> Tensor:
    """oneDNN's prepacked copy of ``weight`` (O, I), made once while the weight is unchanged."""
    return packed_weights.get(weight, "onednn", _REORDER)


def _transposed(weight: Tensor) -> Tensor:
    return weight.t().contiguous()  # (I, O)


def uses_small_rows(x: Tensor, weight: Tensor) -> bool:
    """Whether ``small_rows_linear`` applies: no autograd, CPU float32, a vocabulary-sized output (at
    least PACKED_MIN_OUTPUTS), and one row, or 2..SMALL_ROWS rows where oneDNN is present; not for a
    weight made under ``torch.inference_mode`` (no version counter: a change could not be seen)."""
    if not small_rows_enabled or torch.is_grad_enabled() or weight.shape[0] < PACKED_MIN_OUTPUTS:
        return False
    rows = x.numel() // x.shape[-1]
    return ((rows == 1 or (1 < rows <= SMALL_ROWS and _REORDER is not None))
            and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling() and not weight.is_inference())


def small_rows_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)`` for a decoding step's few rows x (…, I) -> (…, O), through a
    derived weight kept in ``packed_weights`` (see the module docstring). Call it only where
    ``uses_small_rows`` holds."""
    if x.numel() == x.shape[-1]:  # one row
        parts = split_gemv_parts(x, weight)
        if parts > 1:
            return split_gemv(x, weight, bias, parts)
        flat = x.reshape(1, x.shape[-1])  # (1, I)
        transposed = packed_weights.get(weight, "transposed", _transposed)  # (I, O)
        out = torch.mm(flat, transposed) if bias is None else torch.addmm(bias, flat, transposed)
        return out.view(*x.shape[:-1], weight.shape[0])  # (…, O)
    return _LINEAR_POINTWISE(x, _onednn_packed(weight), bias, "none", [], "")


# --- decoding steps inside torch.compile -------------------------------------------------------------
# The derived copies are Python state a compiled graph cannot hold, so a compiled decoding step used
# to multiply through inductor's own products on the weights as they are: beam search with compiled
# steps lost to eager (1.75x HF against 1.80x on a Zen 4 with AVX2 kernels; now 1.87-2.00x,
# docs/performance.md, nineteenth pass). Inside the graph the step's products are now one custom
# operator, an opaque kernel that looks the packed copy up when it runs (made once, rebuilt when the
# weight changes, the switches read then), while inductor fuses the rest of the step (the views,
# LayerNorms, residual sums, softmax and cache updates, whose Python and dispatch cost is a third of
# an eager step at these sizes).


def compiled_step_applies(x: Tensor, weight: Tensor) -> bool:
    """Whether, while ``torch.compile`` traces, the product of ``x`` (…, I) by ``weight`` (O, I) is
    a decoding step's for ``compiled_step_linear``: one new position per row, 2..SMALL_ROWS rows, no
    autograd, CPU float32 without autocast, oneDNN present."""
    return (torch.compiler.is_compiling() and _REORDER is not None and _float32_step(x, weight)
            and not torch.is_autocast_enabled("cpu") and 1 < x.numel() // x.shape[-1] <= SMALL_ROWS)


def compiled_step_linear(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str = "none",
                         *, layer: bool = True) -> Tensor:
    """``activation(F.linear(x, weight, bias))`` of a compiled decoding step, where
    ``compiled_step_applies``: the ``aiayn::decoding_step_linear`` operator. ``layer``: a layer's
    own matrix (``packed_layers_enabled`` applies) rather than the output projection."""
    return _step_linear_op(x, weight, bias, activation, layer)


# Defined through torch.library.Library rather than ``custom_op``: its dispatch costs ~4 us a call
# against ~7 (13 products a step).
_LIBRARY = torch.library.Library("aiayn", "FRAGMENT")
_LIBRARY.define("decoding_step_linear(Tensor x, Tensor weight, Tensor? bias, str activation, "
                "bool layer) -> Tensor")


def _decoding_step_linear(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str,
                          layer: bool) -> Tensor:
    post_op, algorithm = onednn_linear.POST_OPS[activation]
    # The eager paths' conditions that tracing could not see: the switches, and inference-tensor
    # weights (no version counter: a change could not be seen, so never copied).
    if small_rows_enabled and (packed_layers_enabled or not layer) and not weight.is_inference():
        weight = _onednn_packed(weight)
    return _LINEAR_POINTWISE(x, weight, bias, post_op, [], algorithm)


_LIBRARY.impl("decoding_step_linear", _decoding_step_linear, "CPU")


@torch.library.register_fake("aiayn::decoding_step_linear", lib=_LIBRARY)
def _(x, weight, bias, activation, layer):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_step_linear_op = torch.ops.aiayn.decoding_step_linear


# --- inference under CPU bf16 autocast ----------------------------------------------------------------
autocast_bf16_enabled = True  # module switch: packed bf16 weights under CPU bf16 autocast


def _bf16_supported() -> bool:
    try:
        return _REORDER is not None and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


_BF16_SUPPORTED = _bf16_supported()


def uses_bf16_packed(x: Tensor, weight: Tensor) -> bool:
    """Whether ``bf16_packed_linear`` applies: CPU bf16 autocast without autograd, two or more rows,
    oneDNN with bf16 kernels, a float32 weight whose changes can be seen (not an inference tensor),
    not inside ``torch.compile``."""
    # autocast first: outside it (every float32 call) the test ends there
    return (torch.is_autocast_enabled("cpu") and autocast_bf16_enabled and _BF16_SUPPORTED
            and torch.get_autocast_dtype("cpu") == torch.bfloat16 and not torch.is_grad_enabled()
            and x.numel() > x.shape[-1] and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.bfloat16) and weight.dtype == torch.float32
            and not torch.compiler.is_compiling() and not weight.is_inference())


def bf16_packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None,
                       activation: str = "none") -> Tensor:
    """``activation(F.linear(x, weight, bias))`` as bf16 autocast computes it (x, the weight and the
    bias rounded to bf16, a bf16 result), through a oneDNN-packed bf16 copy of the weight kept in
    ``packed_weights``, with the activation applied in the same pass. Where ``uses_bf16_packed``
    holds.

    Autocast casts every float32 weight to bf16 again in each autocast region (each forward) and
    MKL-DNN's matmul then reorders it for its kernel; the copy here is made once while the weight is
    unchanged. Measured (AMD EPYC Zen 4 with AVX512_BF16, 2 threads, 4096 rows, the all-MiniLM
    encoder layer's products, autocast / packed copy): 384 -> 1152 9.9 / 8.7 ms, 384 -> 384 3.3 / 3.0,
    384 -> 1536 with GELU 15.3 / 13.1, 1536 -> 384 13.5 / 12.1. The fused activation works on the
    product before it is rounded to bf16 (autocast rounds, then applies it): results differ by bf16
    rounding there. The copy costs half the float32 weight's memory, kept between calls (autocast
    holds its casts only for the duration of its region).
    """
    post_op, algorithm = onednn_linear.POST_OPS[activation]
    packed = packed_weights.get(weight, "bf16", _bf16_reordered)
    low_bias = None if bias is None else packed_weights.get(bias, "bf16", _to_bf16)
    return _LINEAR_POINTWISE(x.to(torch.bfloat16), packed, low_bias, post_op, [], algorithm)


def _bf16_reordered(weight: Tensor) -> Tensor:
    return _REORDER(weight.to(torch.bfloat16))


def _to_bf16(tensor: Tensor) -> Tensor:
    return tensor.to(torch.bfloat16)
