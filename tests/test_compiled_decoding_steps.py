"""Decoding steps inside ``torch.compile`` keep the packed weight copies (issue 6).

While ``torch.compile`` traces, a step's products of 2..64 rows (the layers' ``linear`` /
``linear_activation`` and a vocabulary-sized ``OutputProjection``) become the
``aiayn::decoding_step_linear`` operator, which multiplies the packed copy it looks up when it runs:

- the operator is in the graph for those products only (one row, 65 rows, autograd keep the plain
  product), and the results equal ``F.linear`` (+ activation);
- one copy per weight, reused call after call, rebuilt when the weight changes in place;
- the switches and inference-tensor weights are honoured when the graph runs, not when it was traced;
- a compiled beam search through inductor gives the eager tokens with every matrix packed.
"""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from aiayn import Transformer, TransformerConfig
from aiayn import inference_linear
from aiayn.models.heads import OutputProjection

pytestmark = pytest.mark.skipif(inference_linear._REORDER is None,
                                reason="no oneDNN packed linear here")

OPERATOR = "aiayn.decoding_step_linear"


class Step(nn.Module):
    """Two layer products (the second with a fused ReLU) and a vocabulary-sized projection."""

    def __init__(self, vocab: int = inference_linear.PACKED_MIN_OUTPUTS):
        super().__init__()
        self.first, self.second = nn.Linear(24, 40), nn.Linear(40, 24)
        self.embedding = nn.Embedding(vocab, 24)
        self.projection = OutputProjection(TransformerConfig.preset("tiny"), self.embedding,
                                           tied=True)

    def forward(self, x):
        h = inference_linear.linear(self.first, x)
        fused = inference_linear.linear_activation(self.second, h, "relu")  # None: not its path
        return self.projection(F.relu(self.second(h)) if fused is None else fused)

    def reference(self, x):
        return F.linear(F.relu(self.second(self.first(x))), self.embedding.weight)


def compiled(step):
    """``step`` under torch.compile with a backend that counts the operator and runs the graph
    eagerly (no code generation: fast)."""
    seen = []

    def backend(graph, example_inputs):
        seen.append(sum(str(node.target).startswith(OPERATOR) for node in graph.graph.nodes))
        return graph.forward

    torch._dynamo.reset()
    return torch.compile(step, backend=backend, dynamic=False, fullgraph=True), seen


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def reorders(monkeypatch):
    """How many packed copies were made."""
    made = []
    reorder = inference_linear._REORDER

    def counting(weight, *args):
        made.append(weight.shape)
        return reorder(weight, *args)

    monkeypatch.setattr(inference_linear, "_REORDER", counting)
    return made


def traced_step(rows: int = 4):
    """A Step, an input of ``rows`` rows, the compiled step run once on it (traced, copies made)
    and the operator counts of its graphs."""
    torch.manual_seed(0)
    step = Step()
    x = torch.randn(rows, 1, 24)
    run, seen = compiled(step)
    with torch.no_grad():
        run(x)
    return step, x, run, seen


@pytest.mark.parametrize("rows", [2, 8, 64])
def test_a_compiled_step_multiplies_packed_copies_once_made(rows, reorders):
    step, x, run, seen = traced_step(rows)
    assert seen == [3]
    assert len(reorders) == 3  # one copy per weight, the tied embedding's included
    with torch.no_grad():
        torch.testing.assert_close(run(x), step.reference(x), rtol=1e-5, atol=1e-5)
        run(torch.randn(rows, 1, 24))
    assert len(reorders) == 3  # reused call after call


def test_the_copies_follow_in_place_changes_of_the_weights(reorders):
    step, x, run, _ = traced_step()
    with torch.no_grad():
        step.first.weight.mul_(2.0)
        step.embedding.weight.add_(1.0)
        torch.testing.assert_close(run(x), step.reference(x), rtol=1e-5, atol=1e-4)
    assert len(reorders) == 5


@pytest.mark.parametrize("shape", [(1, 1, 24), (65, 1, 24), (4, 3, 24)])
def test_other_products_stay_plain_in_the_graph(shape):
    """One row (the split products' case), more rows than a step and several positions a row (a
    prefill) are not decoding steps of 2..64 rows."""
    step = Step()
    run, seen = compiled(step)
    with torch.no_grad():
        run(torch.randn(*shape))
    assert seen == [0]


def test_autograd_and_a_small_vocabulary_stay_plain():
    step = Step()
    run, seen = compiled(step)
    run(torch.randn(4, 1, 24))  # gradient mode on
    small = Step(vocab=100)  # below PACKED_MIN_OUTPUTS: the projection keeps its own path
    run_small, seen_small = compiled(small)
    with torch.no_grad():
        out = run_small(torch.randn(4, 1, 24))
    assert seen == [0] and seen_small == [2] and out.shape == (4, 1, 100)


@pytest.mark.parametrize("switch, copies", [("small_rows_enabled", 0),
                                            ("packed_layers_enabled", 1)])
def test_switches_apply_when_the_graph_runs(switch, copies, reorders, monkeypatch):
    """A graph traced with the copies on and run with a switch off makes no copy that the switch
    forbids (``packed_layers_enabled`` leaves the output projection's), with the same results."""
    step, x, run, _ = traced_step()
    del reorders[:]
    inference_linear.packed_weights.clear()
    with torch.no_grad():
        monkeypatch.setattr(inference_linear, switch, False)
        torch.testing.assert_close(run(x), step.reference(x), rtol=1e-5, atol=1e-5)
    assert len(reorders) == copies


def test_inference_tensor_weights_get_no_copy(reorders):
    with torch.inference_mode():
        step = Step()  # weights made here are inference tensors: no version counter
        x = torch.randn(4, 1, 24)
        run, seen = compiled(step)
        torch.testing.assert_close(run(x), step.reference(x), rtol=1e-5, atol=1e-5)
    assert seen == [3] and reorders == []


@pytest.mark.slow  # inductor generates and compiles C++ (seconds)
def test_compiled_beam_search_packs_every_matrix_and_gives_the_eager_tokens(reorders):
    from aiayn.decoding.beam import beam_search

    torch.manual_seed(0)
    config = TransformerConfig.preset("tiny", vocab_size=inference_linear.PACKED_MIN_OUTPUTS)
    model = Transformer(config).eval()
    source = torch.randint(4, config.vocab_size, (2, 7))
    mask = torch.ones_like(source, dtype=torch.bool)
    inference_linear.packed_weights.clear()
    eager = beam_search(model, source, mask, beam_size=3, max_extra=6)
    eager_copies = len(reorders)
    inference_linear.packed_weights.clear()
    del reorders[:]
    compiled_run = beam_search(model, source, mask, beam_size=3, max_extra=6, compile=True)
    assert [h.tokens for h in compiled_run] == [h.tokens for h in eager]
    assert [h.score for h in compiled_run] == pytest.approx([h.score for h in eager], abs=1e-4)
    assert eager_copies > 0 and len(reorders) == eager_copies  # the same matrices, packed once
