"""Collecting attention, heatmaps, the paper's plots and the HTML report on tiny models."""

import json
import shutil
import subprocess

import pytest
import torch

from aiayn import CausalLM, SequenceClassifier, Transformer, TransformerConfig
from aiayn.visualise.attention_report import Example, measure_patterns, write_attention_report
from aiayn.visualise.collect import collect_attention, views_of

pytest.importorskip("matplotlib")


def tiny(**overrides):
    return TransformerConfig.preset("tiny", dropout=0.0, **overrides)


def png_size(path):
    import matplotlib.image

    image = matplotlib.image.imread(path)
    return image.shape[1], image.shape[0]  # width, height


@pytest.mark.parametrize("attention", ["fused", "reference"])
def test_logits_identical_with_and_without_collecting_attention(attention):
    torch.manual_seed(0)
    config = tiny(attention=attention)
    src = torch.randint(3, 100, (2, 7))
    tgt = torch.randint(3, 100, (2, 5))
    src_mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    tgt_mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    with torch.inference_mode():
        model = Transformer(config).eval()
        plain = model(src, tgt, src_padding_mask=src_mask, tgt_padding_mask=tgt_mask)
        logits, maps = model(src, tgt, src_padding_mask=src_mask, tgt_padding_mask=tgt_mask,
                             return_attention=True)
        assert torch.equal(plain, logits)
        lm = CausalLM(config).eval()
        plain_lm = lm(tgt, padding_mask=tgt_mask)
        logits_lm, _ = collect_attention(lm, tgt, padding_mask=tgt_mask)
        assert torch.equal(plain_lm, logits_lm)
        classifier = SequenceClassifier(config).eval()
        assert torch.equal(classifier(src, padding_mask=src_mask),
                           collect_attention(classifier, src, padding_mask=src_mask)[0])
    assert len(maps.encoder) == len(maps.decoder) == len(maps.cross) == 2
    assert maps.cross[0].shape == (2, 4, 5, 7)
    # rows of real queries sum to 1 over real keys; padded keys get nothing
    assert torch.allclose(maps.cross[1][1, :, :3].sum(-1), torch.ones(4, 3))
    assert maps.encoder[0][1, :, :, 4:].abs().max() == 0


def test_views_cut_padding_and_label_tokens():
    torch.manual_seed(0)
    model = Transformer(tiny()).eval()
    src = torch.randint(3, 100, (2, 6))
    tgt = torch.randint(3, 100, (2, 4))
    _, maps = collect_attention(model, src, target_ids=tgt)
    views = views_of(maps, 1, source_tokens=list("abc"), target_tokens=list("xy"))
    assert [view.kind for view in views] == ["encoder", "decoder", "cross"]
    assert views[0].weights.shape == (2, 4, 3, 3) and views[0].query_tokens == list("abc")
    assert views[2].weights.shape == (2, 4, 2, 3) and views[2].key_tokens == list("abc")
    assert views[1].causal and not views[2].causal
    assert torch.equal(views[2].weights, torch.stack([w[1, :, :2, :3] for w in maps.cross]).float())
    with pytest.raises(ValueError, match="target ids"):
        collect_attention(model, src)
    with pytest.raises(ValueError, match="target ids are only"):
        collect_attention(CausalLM(tiny()), src, target_ids=tgt)


def test_padding_aware_file_metrics_equal_one_text_at_a_time():
    """Batched (right-padded) metrics equal the row-weighted mean of the texts measured alone."""
    torch.manual_seed(0)
    model = CausalLM(tiny()).eval()
    texts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    examples = [Example(ids, [str(i) for i in ids]) for ids in texts]
    batched = measure_patterns(model, examples, batch_size=3)
    single = [measure_patterns(model, [example]) for example in examples]
    rows = [len(ids) for ids in texts]
    for index, row in enumerate(batched):
        expected = sum(single[t][index]["max_weight"] * rows[t] for t in range(3)) / sum(rows)
        assert row["max_weight"] == pytest.approx(expected, abs=1e-6)
        assert row["attention"] == "decoder"


def test_attention_report_files_and_images(tmp_path):
    torch.manual_seed(0)
    model = Transformer(tiny(max_length=64)).eval()
    source = [f"src{i}" for i in range(40)]  # a 40-token sentence: every label must stay visible
    target = [f"tgt{i}" for i in range(12)]
    example = Example(list(range(3, 43)), source, list(range(3, 15)), target)
    written = write_attention_report(model, [example], tmp_path, layer=1, head=2, kind="cross",
                                     html=True)
    expected = {"encoder_grid", "decoder_grid", "cross_grid", "cross_L1_H2", "metrics.json",
                "metrics.csv", "html"}
    assert set(written) == expected
    for name in ("encoder_grid", "cross_grid", "cross_L1_H2"):
        width, height = png_size(written[name])
        assert 400 < width < 8000 and 300 < height < 8000, (name, width, height)
    # 40 columns of labels in a 4-head grid need more room than a 5-token grid
    small = write_attention_report(model, [Example([3, 4, 5], ["a", "b", "c"], [3, 4], ["x", "y"])],
                                   tmp_path / "small")
    assert png_size(written["encoder_grid"])[0] > png_size(small["encoder_grid"])[0]
    rows = json.loads(written["metrics.json"].read_text())
    assert len(rows) == 3 * 2 * 4  # kinds x layers x heads
    assert {row["attention"] for row in rows} == {"encoder", "decoder", "cross"}
    assert all(row["label"] in {"previous-token", "first-token", "last-token", "self", "broad",
                                "other"} for row in rows)
    with pytest.raises(ValueError, match="--layer 2"):
        write_attention_report(model, [example], tmp_path / "bad", layer=2)
    with pytest.raises(ValueError, match="max_length"):
        write_attention_report(model, [Example(list(range(3, 70)), ["t"] * 67, [3], ["x"])],
                               tmp_path / "bad")


def test_a_layer_is_checked_against_the_kind_drawn(tmp_path):
    """--kind decoder --layer 1 on a model with one encoder and two decoder layers draws that
    decoder layer (the encoder's depth does not refuse it); without --kind every kind must have
    the layer."""
    torch.manual_seed(0)
    model = Transformer(tiny(n_encoder_layers=1, n_decoder_layers=2)).eval()
    example = Example([5, 6, 7, 2], list("abcd"), [1, 8, 9], list("xyz"))
    written = write_attention_report(model, [example], tmp_path / "ok", kind="decoder", layer=1)
    assert written["decoder_L1_H0"].is_file()
    with pytest.raises(ValueError, match=r"--layer 1: encoder attention has layers 0\.\.0"):
        write_attention_report(model, [example], tmp_path / "bad", layer=1)
    with pytest.raises(ValueError, match=r"--layer 1: encoder attention has layers 0\.\.0"):
        write_attention_report(model, [example], tmp_path / "bad", kind="encoder", layer=1)


def test_heatmap_label_mismatch_is_an_error(tmp_path):
    from aiayn.visualise.heatmaps import plot_attention_grid, plot_attention_head

    with pytest.raises(ValueError, match="token labels"):
        plot_attention_grid(torch.rand(1, 2, 3, 3), ["a", "b"], ["a", "b", "c"], tmp_path / "g.png",
                            title="t")
    with pytest.raises(ValueError, match=r"\(T, S\)"):
        plot_attention_head(torch.rand(1, 3, 3), ["a"] * 3, ["a"] * 3, tmp_path / "z.png",
                            title="t")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_zoomed_head_prints_its_weights_while_legible_and_leaves_zeros_blank():
    from aiayn.visualise.heatmaps import PRINTED_UP_TO, head_figure, pyplot

    weights = torch.tensor([[1.0, 0.0, 0.0, 0.0],
                            [0.4, 0.6, 0.0, 0.0],
                            [0.004, 0.006, 0.99, 0.0]])  # (T, S): causal, 0.004 prints as 0.00
    figure = head_figure(weights, ["a", "b", "c"], ["a", "b", "c", "d"], title="t")
    axis = figure.axes[0]
    printed = {(text.get_position(), text.get_text()) for text in axis.texts}
    assert printed == {((0, 0), "1.00"), ((0, 1), "0.40"), ((1, 1), "0.60"), ((1, 2), "0.01"),
                       ((2, 2), "0.99")}  # (column, row) of each cell; 0.00 cells blank
    assert "blank: 0.00" in figure.axes[1].get_ylabel()  # the colour bar says so
    pyplot().close(figure)

    # a real sentence of 30 tokens: every weight that is not 0.00 is printed
    torch.manual_seed(0)
    weights = torch.randn(30, 30).mul(3).softmax(-1)
    tokens = [f"t{i}" for i in range(30)]
    figure = head_figure(weights, tokens, tokens, title="t")
    expected = sorted(f"{w:.2f}" for w in weights.flatten().tolist() if f"{w:.2f}" != "0.00")
    assert sorted(text.get_text() for text in figure.axes[0].texts) == expected
    assert len(expected) > 200
    width = figure.get_figwidth()
    pyplot().close(figure)

    # past PRINTED_UP_TO tokens a side, colours only, in smaller cells; the colour bar says why
    long = PRINTED_UP_TO + 1
    tokens = [f"t{i}" for i in range(long)]
    weights = torch.randn(8, long).softmax(-1)  # a short target on a long source: still too wide
    figure = head_figure(weights, tokens[:8], tokens, title="t")
    assert len(figure.axes[0].texts) == 0
    assert figure.axes[1].get_ylabel() == (f"attention weight (not printed: over {PRINTED_UP_TO} "
                                           "tokens)")
    assert figure.get_figwidth() < width  # 41 columns in less room than 30 printed ones
    pyplot().close(figure)
    figure = head_figure(weights, tokens[:8], tokens, title="t", print_up_to=long)
    assert len(figure.axes[0].texts) > 0
    pyplot().close(figure)


def test_position_and_schedule_plots(tmp_path):
    from aiayn.visualise.plots import plot_positions, plot_schedule, readable_dimensions

    path = plot_positions(64, 50, tmp_path / "pe.png")
    width, height = png_size(path)
    assert width > 1000 and 300 < height < 1500
    dims = readable_dimensions(512, 100)
    assert len(dims) == 4 and all(dim % 2 == 0 for dim in dims)  # sine dims, distinct wavelengths
    plot_schedule(tmp_path / "lr.png", d_models=[512, 256], warmups=[4000, 8000], steps=200)
    assert png_size(tmp_path / "lr.png")[0] > 500
    with pytest.raises(ValueError, match="even"):
        plot_positions(63, 10, tmp_path / "x.png")
    with pytest.raises(ValueError, match="warmups"):
        plot_schedule(tmp_path / "x.png", warmups=[])


def write_log(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_run_curves_from_a_log(tmp_path):
    from aiayn.visualise.plots import collect_series, plot_run, read_log

    records = []
    for step in range(10, 201, 10):
        records.append({"step": step, "split": "train", "loss": 5.0 / step ** 0.3, "lr": 1e-3,
                        "ppl": 1.0})
        if step % 50 == 0:
            records.append({"step": step, "split": "valid", "loss": 6.0 / step ** 0.3,
                            "bleu": step / 10, "accuracy": step / 400})
    log = write_log(tmp_path / "log.jsonl", [json.dumps(r) for r in records])
    series = collect_series(read_log(log))
    assert series[("loss", "valid loss")][0] == [50, 100, 150, 200]
    assert series[("bleu", "valid bleu")][1] == [5.0, 10.0, 15.0, 20.0]
    path = plot_run(log, tmp_path / "curves.png")
    width, height = png_size(path)
    assert width > 4 * 400 and 300 < height < 1200  # four panels: loss, ppl, scores, lr


@pytest.mark.parametrize("lines, message", [
    ([], "empty"),
    (['{"step": 1, "loss": 2.0}', "{not json"], r"log.jsonl:2: not valid JSON"),
    (['{"loss": 2.0}'], r"log.jsonl:1: record has no integer 'step'"),
    (['[1, 2]'], "expected a JSON object"),
    (['{"step": 1, "tokens": 5}'], "no loss, score or learning-rate"),
])
def test_bad_logs_are_clear_errors(tmp_path, lines, message):
    from aiayn.visualise.plots import plot_run

    log = write_log(tmp_path / "log.jsonl", lines)
    with pytest.raises(ValueError, match=message):
        plot_run(log, tmp_path / "curves.png")
    assert not (tmp_path / "curves.png").exists()


def html_views():
    torch.manual_seed(0)
    model = Transformer(tiny()).eval()
    example = Example([3, 4, 5, 6], ["<s>", "</script>", "a&b", "$x$"], [3, 4, 5], ["x", "y", "z"])
    from aiayn.visualise.attention_report import example_views

    return example_views(model, example)


def test_html_report_is_self_contained(tmp_path):
    from aiayn.visualise.report_html import write_attention_html

    path = write_attention_html(html_views(), tmp_path / "a.html", title="<b>t</b>")
    page = path.read_text()
    assert "<b>t</b>" not in page and "&lt;b&gt;t&lt;/b&gt;" in page
    assert "http://" not in page and "https://" not in page and "<link" not in page
    assert page.count("</script>") == 2  # the token "</script>" is escaped inside the data
    start = page.index('type="application/json">') + len('type="application/json">')
    data = json.loads(page[start:page.index("</script>", start)].replace("<\\/", "</"))
    kinds = [section["kind"] for section in data["sections"]]
    assert kinds == ["encoder", "decoder", "cross"]
    assert data["sections"][0]["queries"][1] == "</script>"
    assert len(data["sections"][2]["weights"][1][3]) == 3  # (L, H, T, S) nested lists


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.skipif(chromium() is None, reason="no headless Chromium (Debian package: chromium)")
def test_html_report_renders_every_head_in_headless_chromium(tmp_path):
    from aiayn.visualise.report_html import write_attention_html

    views = html_views()
    path = write_attention_html(views, tmp_path / "a.html", title="test")
    expected = sum(view.weights.shape[0] * view.weights.shape[1] for view in views)  # 3 x 2 x 4

    def dump(fragment):
        result = subprocess.run(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu",
             "--disable-background-networking", "--disable-component-update", "--no-first-run",
             f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
             path.resolve().as_uri() + fragment],
            capture_output=True, text=True, timeout=90)
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout

    dom = dump("#selftest")
    assert 'data-state="ok"' in dom, dom[-3000:]
    assert f'data-heads="{expected}"' in dom and f"drew {expected} heads" in dom
    dom = dump("")  # the default view: the first kind's first layer
    assert 'data-state="ok"' in dom and 'data-heads="4"' in dom
    assert dom.count('class="head"') == 4
