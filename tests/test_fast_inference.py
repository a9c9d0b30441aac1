"""aiayn.fast: the inference engine beside the plain model.

Its compiled steps give the eager tokens without graph breaks; weights changed after preparing, in any
way (in place through ``.data``, ``load_state_dict``, ``AveragedModel``), are what decoding uses;
two engines in one process keep their own options; a user's ``nn.Linear`` subclass swapped into a
projection is called, not bypassed; a failing compiler falls back to the plain step with a warning.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from aiayn import CausalLM, Transformer, TransformerConfig
from aiayn.decoding.beam import beam_search
from aiayn.decoding.generation import decode_step, generate
from aiayn.decoding.greedy import decoder_step, greedy_search
from aiayn.fast import InferenceEngine, InferenceOptions, prepare_for_inference
from aiayn.fast.inference import CompiledStep

CONFIG = TransformerConfig.preset("tiny", vocab_size=60, max_length=48)
SOURCES = torch.tensor([[5, 9, 12, 7, 3, 8], [11, 4, 6, 0, 0, 0], [7, 7, 21, 30, 2, 0]])
PROMPTS = [[5, 6, 7, 8], [9, 10]]


def translator(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(CONFIG).eval()


def lm(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(CONFIG.replace(norm_first=True, n_encoder_layers=0)).eval()


def source_mask() -> torch.Tensor:
    return SOURCES != CONFIG.pad_id


def outputs(model: nn.Module, engine: InferenceEngine | None = None) -> dict[str, object]:
    """Every decoding mode's result: greedy and beam search and teacher-forced logits
    (encoder-decoder), greedy and seeded sampling and one cached step's logits (decoder-only)."""
    engine = engine or prepare_for_inference(model, InferenceOptions(compile=False))
    if isinstance(model, Transformer):
        with torch.no_grad():
            logits = model(SOURCES, SOURCES[:, :4], src_padding_mask=source_mask())
        return {"logits": logits,
                "greedy": [h.tokens for h in engine.greedy_search(SOURCES, source_mask(),
                                                                  max_extra=6)],
                "beam": [h.tokens for h in engine.beam_search(SOURCES, source_mask(),
                                                              beam_size=3, max_extra=6)]}
    cache = model.new_cache(2, 16)
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7], [8, 9, 10]]), cache=cache)
        logits = engine.decode_step(model, torch.tensor([[11], [12]]), None, None, cache)
    return {"greedy": engine.generate(PROMPTS, max_new_tokens=8, greedy=True).tokens,
            "sampled": engine.generate(PROMPTS, max_new_tokens=8, seed=3).tokens,
            "step": logits}


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        if isinstance(want[key], torch.Tensor):
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5, msg=key)
        else:
            assert got[key] == want[key], key


def fresh_copy(model: nn.Module) -> nn.Module:
    """A new model of the same class holding ``model``'s current weights."""
    fresh = type(model)(model.config).eval()
    fresh.load_state_dict(model.state_dict())
    return fresh


def perturb_through_data(model: nn.Module, std: float) -> None:
    """An EMA / weight-averaging style update that bypasses autograd's version counters."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.data.mul_(0.5).add_(torch.randn(p.shape, generator=generator) * std)


# --- the plain engine (no compiling): every decoding mode after every kind of weight change -------
@pytest.mark.parametrize("build", [translator, lm], ids=["encoder-decoder", "decoder-only"])
@pytest.mark.parametrize("std", [0.05, 0.5])
def test_decoding_after_an_in_place_data_update_equals_a_fresh_model(build, std):
    model = build()
    engine = prepare_for_inference(model, InferenceOptions(compile=False))
    outputs(model, engine)  # decode once before the update
    perturb_through_data(model, std)
    assert_same(outputs(model, engine), outputs(fresh_copy(model)))


@pytest.mark.parametrize("build", [translator, lm], ids=["encoder-decoder", "decoder-only"])
def test_load_state_dict_after_preparing_is_used(build):
    model, other = build(0), build(1)
    engine = prepare_for_inference(model, InferenceOptions(compile=False))
    before = outputs(model, engine)
    model.load_state_dict(other.state_dict())
    after = outputs(model, engine)
    assert_same(after, outputs(other))
    assert after["greedy"] != before["greedy"]


def test_averaged_model_decodes_with_its_averaged_weights():
    model = lm()
    averaged = torch.optim.swa_utils.AveragedModel(model)
    engine = prepare_for_inference(averaged.module, InferenceOptions(compile=False))
    outputs(averaged.module, engine)
    perturb_through_data(model, 0.3)
    averaged.update_parameters(model)  # in place, into the module the engine holds
    want = fresh_copy(averaged.module)
    assert_same(outputs(averaged.module, engine), outputs(want))


class CountingLinear(nn.Linear):
    """A user's ``nn.Linear`` subclass (LoRA, quantised, ...): adds a visible offset and counts."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CountingLinear.calls += 1
        return super().forward(x) + 0.25


def swap_in_counting_linears(model: nn.Module) -> int:
    """Every attention and FFN projection replaced by a ``CountingLinear`` with its weights."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                new = CountingLinear(child.in_features, child.out_features,
                                     bias=child.bias is not None)
                new.load_state_dict(child.state_dict())
                setattr(module, name, new)
                swapped += 1
    return swapped


@pytest.mark.parametrize("build", [translator, lm], ids=["encoder-decoder", "decoder-only"])
def test_a_swapped_in_linear_subclass_is_called_in_every_path(build):
    model = build()
    plain = outputs(model)
    assert swap_in_counting_linears(model) > 0
    CountingLinear.calls = 0
    swapped = outputs(model)
    assert CountingLinear.calls > 0
    logits = "logits" if "logits" in plain else "step"
    assert not torch.allclose(swapped[logits], plain[logits])  # the offset reached the output


# --- compiled engines ----------------------------------------------------------------------------
@pytest.fixture
def no_graph_breaks():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    breaks = dict(counters["graph_break"])
    torch._dynamo.reset()
    assert not breaks, breaks


@pytest.mark.slow  # compiles (tens of seconds on 2 cores)
@pytest.mark.parametrize("build", [translator, lm], ids=["encoder-decoder", "decoder-only"])
def test_compiled_steps_give_the_eager_results_and_follow_weight_changes(build, no_graph_breaks):
    """Sentences finish at different steps (the compiled step sees the rows shrink), prompts are
    left-padded; after a ``.data`` update the compiled graphs read the new weights."""
    model = build()
    compiled = prepare_for_inference(model, InferenceOptions(compile=True))
    plain = prepare_for_inference(model, InferenceOptions(compile=False))
    assert_same(outputs(model, compiled), outputs(model, plain))
    perturb_through_data(model, 0.3)
    assert_same(outputs(model, compiled), outputs(fresh_copy(model)))
    assert isinstance(compiled.decoder_step, CompiledStep) and not compiled.decoder_step.failed
    assert plain.decoder_step is decoder_step and plain.decode_step is decode_step


@pytest.mark.slow
def test_two_models_with_different_options_in_one_process():
    first, second = lm(0), lm(1)
    compiled = prepare_for_inference(first, InferenceOptions(compile=True))
    plain = prepare_for_inference(second, InferenceOptions(compile=False))
    assert compiled.options.compile and not plain.options.compile
    assert_same(outputs(first, compiled), outputs(first))
    assert_same(outputs(second, plain), outputs(second))
    assert outputs(first)["greedy"] != outputs(second)["greedy"]


def test_a_failing_compiler_falls_back_to_the_plain_step_with_a_warning(monkeypatch):
    model = translator()
    engine = prepare_for_inference(model, InferenceOptions(compile=True))

    def broken(*args):
        raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")

    monkeypatch.setattr(engine.decoder_step, "compiled", broken)
    with pytest.warns(RuntimeWarning, match="torch.compile failed.*InvalidCxxCompiler"):
        got = [h.tokens for h in engine.greedy_search(SOURCES, source_mask(), max_extra=6)]
    assert got == [h.tokens for h in greedy_search(model, SOURCES, source_mask(), max_extra=6)]
    assert engine.decoder_step.failed
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, then plain without a word
        engine.greedy_search(SOURCES, source_mask(), max_extra=6)


def test_input_errors_are_raised_not_swallowed_by_the_fallback():
    engine = prepare_for_inference(lm(), InferenceOptions(compile=True))
    engine.decode_step.compiled = engine.decode_step.plain  # no compiling needed here
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[5, 999]], max_new_tokens=2)
    assert not engine.decode_step.failed


@pytest.mark.parametrize("options, message", [
    (dict(compile="yes"), "compile must be True, False or None"),
    (dict(mode="fastest"), "mode must be one of"),
    (dict(mode="max-autotune", compile=False), "is torch.compile's mode, and compile=False"),
])
def test_bad_options_name_the_problem(options, message):
    with pytest.raises(ValueError, match=message):
        InferenceOptions(**options)


def test_a_compile_mode_asks_for_compiled_steps_on_the_cpu_too():
    model = CausalLM(TransformerConfig.preset("tiny", vocab_size=50))
    assert not prepare_for_inference(model, InferenceOptions()).compiles  # the CPU's default
    assert prepare_for_inference(model, InferenceOptions(mode="reduce-overhead")).compiles


def test_prepare_needs_an_aiayn_model():
    with pytest.raises(TypeError, match="needs an aiayn model"):
        prepare_for_inference(nn.Linear(2, 2))


def test_engine_searches_are_the_library_functions_on_its_steps():
    model = translator()
    engine = prepare_for_inference(model, InferenceOptions(compile=False))
    mask = source_mask()
    assert [h.tokens for h in engine.beam_search(SOURCES, mask, beam_size=2, max_extra=5)] == \
        [h.tokens for h in beam_search(model, SOURCES, mask, beam_size=2, max_extra=5)]
    causal = lm()
    assert prepare_for_inference(causal, InferenceOptions(compile=False)).generate(
        PROMPTS, max_new_tokens=4, greedy=True).tokens == generate(
        causal, PROMPTS, max_new_tokens=4, greedy=True).tokens
    assert copy.copy(engine.options) == InferenceOptions(compile=False)


# --- fixed-shape steps (what a CUDA graph replays), run as plain calls on the CPU -----------------
@pytest.mark.parametrize("prompts", [[[5, 6, 7, 8], [9, 10, 11, 12]], PROMPTS],
                         ids=["same-length", "left-padded"])
@pytest.mark.parametrize("options", [dict(greedy=True), dict(seed=3, top_k=20),
                                     dict(greedy=True, stop_ids=(7, 13))],
                         ids=["greedy", "sampled", "stop-ids"])
def test_fixed_shape_steps_give_the_plain_loops_tokens(prompts, options):
    from aiayn.fast.cuda_graphs import GraphedSteps

    model = lm()
    steps = GraphedSteps(use_graph=False)
    for _ in range(2):  # the second call reuses the first's cache and buffers
        got = generate(model, prompts, max_new_tokens=12, steps=steps, **options)
        want = generate(model, prompts, max_new_tokens=12, **options)
        assert got.tokens == want.tokens and got.finish_reasons == want.finish_reasons
    assert len(steps.shapes) == 1


def test_capture_warms_up_on_a_side_stream_then_captures_one_run(monkeypatch):
    """The order ``capture`` follows, with torch.cuda's stream and graph objects recorded (no GPU
    here): three warm-up runs, each after ``prepare``, on a side stream; then one run inside the
    graph's capture, whose output is returned with the graph."""
    import contextlib

    from aiayn.fast import cuda_graphs

    events = []

    class Stream:
        def wait_stream(self, other):
            events.append("wait")

    @contextlib.contextmanager
    def on(where):
        events.append(f"enter {where}")
        yield
        events.append(f"exit {where}")

    class Graph:
        pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: on("side stream"))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph: on("capture"))
    runs = iter(range(10))

    def run():
        events.append("run")
        return torch.tensor(next(runs))

    graph, output = cuda_graphs.capture(run, lambda: events.append("prepare"))
    assert isinstance(graph, Graph) and int(output) == 3  # the fourth run: the captured one
    assert events == ["wait", "enter side stream", *["prepare", "run"] * 3, "exit side stream",
                      "wait", "enter capture", "run", "exit capture"]


def test_fixed_shape_steps_keep_the_most_recently_used_shapes():
    from aiayn.fast.cuda_graphs import GraphedSteps

    model = lm()
    steps = GraphedSteps(use_graph=False, max_shapes=2)
    for new in (4, 6, 8, 4):  # capacities 7, 9, 11, 7 for a 4-token prompt
        got = generate(model, PROMPTS[:1], max_new_tokens=new, greedy=True, steps=steps)
        assert got.tokens == generate(model, PROMPTS[:1], max_new_tokens=new, greedy=True).tokens
    assert list(steps.shapes) == [(1, 11), (1, 7)]


def test_fixed_shape_steps_slide_past_the_context_like_the_plain_loop():
    from aiayn.fast.cuda_graphs import GraphedSteps

    model = lm()
    steps = GraphedSteps(use_graph=False)
    got = generate(model, PROMPTS, max_new_tokens=30, greedy=True, context=12, slide=True,
                   steps=steps)
    want = generate(model, PROMPTS, max_new_tokens=30, greedy=True, context=12, slide=True)
    assert got.tokens == want.tokens and len(got.tokens[0]) == 30


def test_a_slot_step_equals_the_full_forward():
    model = lm()
    ids = torch.randint(3, 60, (2, 10))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 16)
        model(ids[:, :4], cache=cache)
        mask = torch.zeros(2, 16, dtype=torch.bool)
        mask[:, :4] = True
        for t in range(4, 10):
            mask[:, t] = True
            got = model(ids[:, t:t + 1], cache=cache, slots=torch.tensor([t]), padding_mask=mask,
                        positions=torch.full((2, 1), t))
            torch.testing.assert_close(got[:, 0], full[:, t], rtol=1e-5, atol=1e-5)
    assert cache.length == 4  # slots neither read nor advance the host count


@pytest.mark.parametrize("kwargs, message", [
    (dict(padding_mask=None), "slots need a cache, a padding_mask"),
    (dict(slots=torch.tensor([1, 2])), "one token at a time"),
    (dict(ids=torch.tensor([[3, 4]])), "one token at a time"),
    (dict(padding_mask=torch.ones(1, 5, dtype=torch.bool)), r"padding_mask must have shape"),
])
def test_bad_slot_steps_name_the_problem(kwargs, message):
    model = lm()
    cache = model.new_cache(1, 8)
    arguments = dict(ids=torch.tensor([[3]]), cache=cache, slots=torch.tensor([0]),
                     padding_mask=torch.ones(1, 8, dtype=torch.bool),
                     positions=torch.zeros(1, 1, dtype=torch.long))
    arguments.update(kwargs)
    ids = arguments.pop("ids")
    with pytest.raises(ValueError, match=message):
        model(ids, **arguments)


# --- fixed-shape beam search (what aiayn.fast.graphed_beam replays), plain calls on the CPU -------
EOS_PRONE = CONFIG.replace(output_bias=True)
BEAM_SOURCES = torch.tensor([[5, 9, 12, 7, 3, 8], [11, 4, 6, 0, 0, 0], [7, 7, 21, 30, 2, 0],
                             [3, 4, 5, 6, 7, 8]])


def eos_prone_translator(seed: int, eos_bias: float, **overrides) -> Transformer:
    """A random translator whose </s> logit is raised by ``eos_bias``: hypotheses then end at many
    different steps, sentences stop early, and the length penalty decides between them."""
    torch.manual_seed(seed)
    model = Transformer(EOS_PRONE.replace(**overrides)).eval()
    with torch.no_grad():
        model.generator.bias[EOS_PRONE.eos_id] = eos_bias
    return model


def assert_same_hypotheses(got, want) -> None:
    assert [h.tokens for h in got] == [h.tokens for h in want]
    for g, w in zip(got, want):
        assert g.score == pytest.approx(w.score, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("attention", ["fused", "reference"])
def test_fixed_shape_beam_search_is_beam_search(attention):
    """Every beam size, length penalty and length limit, over models whose hypotheses end at many
    steps: the same hypotheses as ``beam_search``, one state per shape reused across calls."""
    from aiayn.fast.graphed_beam import GraphedBeam

    searcher = GraphedBeam(use_graph=False)
    mask = BEAM_SOURCES != CONFIG.pad_id
    lengths = set()
    for seed, eos_bias in [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]:
        model = eos_prone_translator(seed, eos_bias, attention=attention)
        for beam_size in (1, 3, 4):
            for alpha in (0.0, 0.6, 1.5):
                for max_extra in (2, 10):
                    options = dict(beam_size=beam_size, alpha=alpha, max_extra=max_extra)
                    want = beam_search(model, BEAM_SOURCES, mask, **options)
                    assert_same_hypotheses(searcher(model, BEAM_SOURCES, mask, **options), want)
                    lengths.update(len(h.tokens) for h in want)
    assert len(lengths) >= 8, lengths  # the searches really ended at many different steps
    assert len(searcher.shapes) == 6  # (beam size, capacity) pairs: states are reused
    small = GraphedBeam(use_graph=False, max_shapes=2)
    for max_extra in (2, 3, 4, 2):
        assert_same_hypotheses(small(model, BEAM_SOURCES, mask, max_extra=max_extra),
                               beam_search(model, BEAM_SOURCES, mask, max_extra=max_extra))
    assert [key[2] for key in small.shapes] == [10, 8]  # the two most recent capacities


def test_fixed_shape_beam_search_takes_forced_tokens_and_a_start_symbol():
    """A target language code forced after the start symbol (NLLB), or given as the start symbol
    (mBART), one of two or two forced: ``beam_search``'s hypotheses, from one state per shape
    whatever the call's start and blocked ids; a start outside the vocabulary is refused."""
    from aiayn.fast.graphed_beam import GraphedBeam

    searcher = GraphedBeam(use_graph=False)
    mask = BEAM_SOURCES != CONFIG.pad_id
    lengths = set()
    for seed, eos_bias in [(1, 1.0), (2, 2.0)]:
        model = eos_prone_translator(seed, eos_bias)
        for language in ({"forced": [57]}, {"start": 57}, {"start": 58, "forced": [56, 55]}, {}):
            for beam_size, alpha, max_extra in [(4, 0.6, 10), (3, 0.0, 2), (2, 1.5, 6)]:
                options = dict(beam_size=beam_size, alpha=alpha, max_extra=max_extra, **language)
                want = beam_search(model, BEAM_SOURCES, mask, **options)
                assert_same_hypotheses(searcher(model, BEAM_SOURCES, mask, **options), want)
                lengths.update(len(h.tokens) for h in want)
                if "start" in language:  # never generated
                    assert all(language["start"] not in h.tokens for h in want)
    assert len(lengths) >= 5, lengths
    assert len(searcher.shapes) == 3  # one per (beam size, capacity): the language is not a shape
    with pytest.raises(ValueError, match=r"start token 60 is not an id"):
        searcher(model, BEAM_SOURCES, mask, start=60)


def test_engine_greedy_search_on_graphs_is_greedy_search(monkeypatch):
    """Where the engine replays beam search from CUDA graphs, its greedy search is that search
    with one beam and no length penalty: greedy search's tokens and scores, over length limits,
    models that end early or late, and language codes (forced, start). Graphs replaced by plain
    calls of the same fixed-shape steps (the CPU has none)."""
    from aiayn.fast import inference
    from aiayn.fast.graphed_beam import GraphedBeam

    made = []

    class PlainCalls(GraphedBeam):
        def __init__(self, step, *, use_graph=True):
            super().__init__(step, use_graph=False)
            made.append(self)

    monkeypatch.setattr(InferenceEngine, "uses_cuda_graphs", lambda self: True)
    monkeypatch.setattr(inference, "GraphedBeam", PlainCalls)
    mask = BEAM_SOURCES != CONFIG.pad_id
    lengths = set()
    for seed, eos_bias in [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]:
        model = eos_prone_translator(seed, eos_bias)
        engine = prepare_for_inference(model, InferenceOptions(compile=False))
        for max_extra in (2, 5, 10):
            for language in ({}, {"forced": [57]}, {"start": 57}):
                want = greedy_search(model, BEAM_SOURCES, mask, max_extra=max_extra, **language)
                got = engine.greedy_search(BEAM_SOURCES, mask, max_extra=max_extra, **language)
                assert_same_hypotheses(got, want)
                lengths.update(len(h.tokens) for h in want)
    assert len(lengths) >= 6, lengths
    assert len(made) == 4 and all(searcher.shapes for searcher in made)  # the graphed search ran


def test_fixed_shape_beam_search_reads_the_current_weights_in_inference_mode():
    """A state made under ``torch.inference_mode`` serves a later call outside it, and a weight
    update through ``.data`` between calls is what the next search uses."""
    from aiayn.fast.graphed_beam import GraphedBeam

    model = eos_prone_translator(1, 1.0)
    searcher = GraphedBeam(use_graph=False)
    mask = BEAM_SOURCES != CONFIG.pad_id
    with torch.inference_mode():
        first = searcher(model, BEAM_SOURCES, mask, max_extra=8)
    assert_same_hypotheses(first, beam_search(model, BEAM_SOURCES, mask, max_extra=8))
    perturb_through_data(model, 0.3)
    got = searcher(model, BEAM_SOURCES, mask, max_extra=8)
    assert_same_hypotheses(got, beam_search(fresh_copy(model), BEAM_SOURCES, mask, max_extra=8))
    assert [h.tokens for h in got] != [h.tokens for h in first]


@pytest.mark.slow  # compiles (tens of seconds on 2 cores)
def test_compiled_fixed_shape_beam_step_has_no_graph_breaks(no_graph_breaks):
    """The whole step (cache gather, decoder, choice) compiles as one graph with dynamic sizes: a
    second source shape reuses it."""
    from aiayn.fast.graphed_beam import GraphedBeam, beam_slot_step

    model = eos_prone_translator(1, 1.0)
    step = CompiledStep(beam_slot_step, InferenceOptions(compile=True), dynamic=True)
    searcher = GraphedBeam(step, use_graph=False)
    mask = BEAM_SOURCES != CONFIG.pad_id
    for rows in (4, 2):
        source, source_mask = BEAM_SOURCES[:rows, :rows + 2], mask[:rows, :rows + 2]
        want = beam_search(model, source, source_mask, max_extra=8)
        assert_same_hypotheses(searcher(model, source, source_mask, max_extra=8), want)
    assert not step.failed


def test_fixed_shape_beam_search_refuses_what_it_cannot_run():
    from aiayn.fast.graphed_beam import GraphedBeam

    mask = BEAM_SOURCES != CONFIG.pad_id
    t5 = Transformer(TransformerConfig.preset("t5-cpu", vocab_size=60, max_length=48)).eval()
    assert GraphedBeam.supports(translator()) and not GraphedBeam.supports(t5)
    assert not GraphedBeam.supports(lm())
    with pytest.raises(ValueError, match="relative position bias"):
        GraphedBeam(use_graph=False)(t5, BEAM_SOURCES, mask)
    for options, message in [(dict(beam_size=0), "positive integer"),
                             (dict(beam_size=31), "too large"), (dict(alpha=-1.0), "non-negative")]:
        with pytest.raises(ValueError, match=message):
            GraphedBeam(use_graph=False)(translator(), BEAM_SOURCES, mask, **options)


@pytest.mark.parametrize("change", ["dtype", "new-tensors"])
def test_fixed_shape_steps_follow_a_model_cast_or_given_new_parameter_tensors(change):
    """A graph reads the addresses it was captured with: after ``.to(dtype)`` or ``p.data = ...``
    the steps of that shape are made again, and decode the model as it is now."""
    from aiayn.fast.cuda_graphs import GraphedSteps
    from aiayn.fast.graphed_beam import GraphedBeam

    model, translation = lm(), eos_prone_translator(1, 1.0)
    steps, searcher = GraphedSteps(use_graph=False), GraphedBeam(use_graph=False)
    mask = BEAM_SOURCES != CONFIG.pad_id
    generate(model, PROMPTS, max_new_tokens=6, greedy=True, steps=steps)
    searcher(translation, BEAM_SOURCES, mask, max_extra=8)
    before = (dict(steps.shapes), dict(searcher.shapes))
    for module in (model, translation):
        if change == "dtype":
            module.to(torch.float64)
        else:
            with torch.no_grad():
                for p in module.parameters():
                    p.data = p.data * 1.5
    got = generate(model, PROMPTS, max_new_tokens=6, greedy=True, steps=steps)
    assert got.tokens == generate(model, PROMPTS, max_new_tokens=6, greedy=True).tokens
    assert_same_hypotheses(searcher(translation, BEAM_SOURCES, mask, max_extra=8),
                           beam_search(translation, BEAM_SOURCES, mask, max_extra=8))
    assert all(steps.shapes[key] is not old for key, old in before[0].items())
    assert all(searcher.shapes[key] is not old for key, old in before[1].items())


def test_a_failing_graph_capture_falls_back_to_the_plain_beam_search(monkeypatch):
    """Unmeasured GPUs and PyTorch versions: a capture that fails warns once, then the engine
    searches without graphs (same hypotheses); a caller's mistake is raised, not swallowed."""
    from aiayn.fast.graphed_beam import GraphedBeam

    def fail(self, *args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    model = eos_prone_translator(1, 1.0)
    mask = BEAM_SOURCES != CONFIG.pad_id
    engine = prepare_for_inference(model, InferenceOptions(compile=False))
    monkeypatch.setattr(InferenceEngine, "uses_cuda_graphs", lambda self: True)
    monkeypatch.setattr(GraphedBeam, "__call__", fail)
    with pytest.warns(RuntimeWarning, match="CUDA-graph beam search failed.*capturing"):
        got = engine.beam_search(BEAM_SOURCES, mask, max_extra=8)
    assert_same_hypotheses(got, beam_search(model, BEAM_SOURCES, mask, max_extra=8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        engine.beam_search(BEAM_SOURCES, mask, max_extra=8)
    with pytest.raises(ValueError, match="beam_size"):
        engine.beam_search(BEAM_SOURCES, mask, beam_size=0)


def test_cuda_graphs_apply_only_to_cuda_models_with_exact_kernels():
    engine = prepare_for_inference(lm(), InferenceOptions(compile=False))
    assert not engine.uses_cuda_graphs()  # a CPU model
    assert type(engine.generation_steps()).__name__ == "Steps"


def test_by_default_a_cpu_model_decodes_with_the_plain_steps():
    """Compiled steps measured no faster on the CPU: the default compiles on a GPU only."""
    engine = prepare_for_inference(lm())
    assert engine.options.compile is None and not engine.compiles
    assert engine.decode_step is decode_step and engine.decoder_step is decoder_step


@pytest.mark.parametrize("command", [["translate", "RUN"], ["evaluate", "RUN", "--data", "x.tsv"],
                                     ["generate", "RUN"]])
def test_decoding_commands_compile_only_when_asked(command):
    """A command runs one job: its engine compiles with --compile alone, on any device (on a GPU
    its steps replay CUDA graphs either way; compiling the bundled test set's beam search took
    longer than decoding it)."""
    from aiayn.cli import build_parser
    from aiayn.commands import engine as command_engine

    parser = build_parser()
    for extra, compiles in (([], False), (["--compile"], True), (["--no-compile"], False)):
        args = parser.parse_args(command + extra)
        made = command_engine.engine(lm(), args)
        assert made.options.compile is compiles and made.compiles is compiles
        assert made.options.cuda_graphs
