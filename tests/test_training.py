"""The training engine: schedules, loss, accumulation, exact resume, checkpoints, run loading."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from aiayn import Transformer, TransformerConfig
from aiayn.training import (Schedule, TrainingConfig, average_checkpoints,
                            label_smoothed_cross_entropy, load_run, noam, train, warmup_cosine)
from aiayn.training import checkpoint as checkpoint_module
from aiayn.training.checkpoint import list_checkpoints
from aiayn.training.weights import read_tensors

PAD, BOS, EOS = 0, 1, 2


class ReverseTask:
    """Reverse a random token sequence; variable lengths so padding and token counts matter."""

    name = "translation"

    def __init__(self, *, seed=0, examples=12, batch_size=4, split=None, fail_at=None):
        generator = torch.Generator().manual_seed(seed)
        self.examples = []
        for _ in range(examples):
            length = int(torch.randint(2, 7, (1,), generator=generator))
            self.examples.append(torch.randint(3, 20, (length,), generator=generator))
        self.seed, self.batch_size, self.split = seed, batch_size, split
        self.fail_at, self.calls = fail_at, 0

    def model_config(self, base):
        return base

    def build_model(self, model_config):
        return Transformer(model_config)

    def _collate(self, chunk):
        src = torch.nn.utils.rnn.pad_sequence(chunk, batch_first=True, padding_value=PAD)
        targets = [torch.cat([x.flip(0), torch.tensor([EOS])]) for x in chunk]
        out = torch.nn.utils.rnn.pad_sequence(targets, batch_first=True, padding_value=PAD)
        tgt_in = torch.cat([torch.full((len(chunk), 1), BOS), out[:, :-1]], 1)
        tgt_in = tgt_in.masked_fill(out == PAD, PAD)
        return src, tgt_in, out

    def train_batches(self, epoch):
        order = torch.randperm(len(self.examples),
                               generator=torch.Generator().manual_seed(self.seed * 1000 + epoch))
        batches = []
        for start in range(0, len(order), self.batch_size):
            chunk = [self.examples[i] for i in order[start:start + self.batch_size]]
            sizes = self.split or [len(chunk)]
            offset = 0
            for size in sizes:  # optionally cut one batch into micro-batches
                batches.append(self._collate(chunk[offset:offset + size]))
                offset += size
        return iter(batches)

    def count(self, batch):
        return int((batch[2] != PAD).sum())

    def loss(self, model, batch):
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise KeyboardInterrupt("simulated kill")
        src, tgt_in, out = batch
        logits = model(src, tgt_in, src_padding_mask=src != PAD)
        return label_smoothed_cross_entropy(logits.flatten(0, 1), out.flatten(), smoothing=0.1,
                                            ignore_index=PAD)

    def evaluate(self, model):
        total, units = 0.0, 0
        for batch in self.train_batches(0):
            total += float(self.loss(model, batch))
            units += self.count(batch)
        return {"loss": total / units}

    def save_assets(self, run_dir):
        return {"examples": len(self.examples)}

    @classmethod
    def load_assets(cls, run_dir):
        return None


def tiny_config(dropout=0.0):
    return TransformerConfig.preset("tiny", vocab_size=24, dropout=dropout)


def training_config(**overrides):
    settings = dict(steps=6, schedule=Schedule(kind="constant", peak=3e-3, warmup=2),
                    eval_every=0, save_every=0, log_every=1, progress=False, device="cpu",
                    clip_norm=1.0)
    settings.update(overrides)
    return TrainingConfig(**settings)


def run(tmp_path, name, task, config, model_seed=0, dropout=0.0):
    torch.manual_seed(model_seed)
    model_config = tiny_config(dropout)
    model = task.build_model(model_config)
    metrics = train(model, task, config, tmp_path / name)
    return model, metrics


def train_losses(run_dir: Path):
    lines = (run_dir / "log.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["split"] == "train"]


# --- schedules ------------------------------------------------------------------------------------
def test_noam_matches_the_paper_formula_by_hand():
    # lrate = d^-0.5 * min(step^-0.5, step * warmup^-1.5), d=512, warmup=4000 (paper eq. 3)
    assert noam(1, d_model=512, warmup=4000) == pytest.approx(512 ** -0.5 * 4000 ** -1.5)
    assert noam(0, d_model=512, warmup=4000) == noam(1, d_model=512, warmup=4000)
    assert noam(4000, d_model=512, warmup=4000) == pytest.approx(1 / math.sqrt(512 * 4000))
    assert noam(16000, d_model=512, warmup=4000) == pytest.approx(1 / math.sqrt(512 * 16000))
    assert noam(100, d_model=256, warmup=10, factor=2.0) == pytest.approx(2 / math.sqrt(256 * 100))
    assert Schedule(kind="noam", d_model=512, warmup=4000)(2000) == pytest.approx(
        2000 / math.sqrt(512) / 4000 ** 1.5)


def test_warmup_cosine_values():
    kwargs = dict(peak=1.0, warmup=10, total=110, floor=0.1)
    assert warmup_cosine(5, **kwargs) == pytest.approx(0.5)
    assert warmup_cosine(10, **kwargs) == pytest.approx(1.0)
    assert warmup_cosine(60, **kwargs) == pytest.approx(0.1 + 0.9 * 0.5)
    assert warmup_cosine(110, **kwargs) == pytest.approx(0.1)
    assert warmup_cosine(500, **kwargs) == pytest.approx(0.1)


@pytest.mark.parametrize("field,value", [("kind", "linear"), ("warmup", -1), ("peak", 0.0),
                                         ("d_model", 0)])
def test_schedule_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=field if field != "kind" else "kind"):
        Schedule(**{field: value})


def test_training_config_rejects_bad_fields():
    with pytest.raises(ValueError, match="accumulation"):
        TrainingConfig(accumulation=0)
    with pytest.raises(ValueError, match="autocast"):
        TrainingConfig(autocast="fp8")
    with pytest.raises(ValueError, match="average_last"):
        TrainingConfig(keep_last=2, average_last=5)


# --- loss -----------------------------------------------------------------------------------------
def test_label_smoothed_loss_matches_hand_computation():
    logits = torch.tensor([[1.0, 2.0, 0.5], [0.0, 0.0, 3.0], [4.0, 1.0, 1.0]])
    targets = torch.tensor([1, 2, 0])
    eps = 0.1
    expected = 0.0
    for row, target in zip(logits.tolist(), targets.tolist()):
        log_z = math.log(sum(math.exp(v) for v in row))
        log_p = [v - log_z for v in row]
        # smoothed target: 1 - eps on the reference, eps / V on every class
        expected += -sum(((1 - eps) * (i == target) + eps / 3) * lp for i, lp in enumerate(log_p))
    got = label_smoothed_cross_entropy(logits, targets, smoothing=eps)
    assert got.item() == pytest.approx(expected, rel=1e-6)
    reference = torch.nn.functional.cross_entropy(logits, targets, label_smoothing=eps,
                                                  reduction="sum")
    assert got.item() == pytest.approx(reference.item(), rel=1e-6)


def test_label_smoothed_loss_ignores_padding_and_is_finite_for_extreme_logits():
    logits = torch.tensor([[1e4, -1e4, 0.0], [0.3, 0.2, 0.1]])
    targets = torch.tensor([1, 0])
    loss = label_smoothed_cross_entropy(logits, targets, smoothing=0.1, ignore_index=0)
    assert torch.isfinite(loss)
    alone = label_smoothed_cross_entropy(logits[:1], targets[:1], smoothing=0.1)
    assert loss.item() == pytest.approx(alone.item())
    assert label_smoothed_cross_entropy(logits.half(), targets, smoothing=0.1).dtype == torch.float32
    with pytest.raises(ValueError, match="smoothing"):
        label_smoothed_cross_entropy(logits, targets, smoothing=1.0)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_loss_equals_torch_cross_entropy_with_label_smoothing(smoothing):
    """Finite logits: the summed loss and its gradient are torch's cross-entropy's (independent
    reference); ignored rows get no gradient at all."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 50, generator=generator) * 4
    targets = torch.randint(0, 50, (37,), generator=generator)
    targets[::5] = 0  # ignored rows
    ours_in = logits.clone().requires_grad_()
    torch_in = logits.clone().requires_grad_()
    got = label_smoothed_cross_entropy(ours_in, targets, smoothing=smoothing, ignore_index=0)
    want = F.cross_entropy(torch_in, targets, ignore_index=0, label_smoothing=smoothing,
                           reduction="sum")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    (got * 1.7).backward()
    (want * 1.7).backward()
    torch.testing.assert_close(ours_in.grad, torch_in.grad, rtol=1e-5, atol=1e-6)
    assert ours_in.grad[targets == 0].abs().max() == 0


def test_loss_of_an_empty_batch_is_zero_with_a_gradient():
    logits = torch.zeros(0, 5, requires_grad=True)
    loss = label_smoothed_cross_entropy(logits, torch.zeros(0, dtype=torch.long), smoothing=0.1)
    loss.backward()
    assert loss.item() == 0.0 and logits.grad.shape == (0, 5)


# --- accumulation and resume ----------------------------------------------------------------------
def test_accumulation_normalised_by_true_token_count_equals_one_big_batch(tmp_path):
    # eps=1 makes Adam's update proportional to the gradient, so the comparison checks gradients
    # rather than Adam's amplification of round-off in gradients that are exactly zero in exact
    # arithmetic (the key biases: softmax ignores them).
    whole, _ = run(tmp_path, "whole", ReverseTask(batch_size=4),
                   training_config(steps=3, accumulation=1, eps=1.0))
    # the same 4 examples cut 1 + 3 per step: unequal token counts per micro-batch
    split, _ = run(tmp_path, "split", ReverseTask(batch_size=4, split=[1, 3]),
                   training_config(steps=3, accumulation=2, eps=1.0))
    for (name, a), b in zip(whole.state_dict().items(), split.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    whole_losses, split_losses = train_losses(tmp_path / "whole"), train_losses(tmp_path / "split")
    assert [s for s, _ in whole_losses] == [s for s, _ in split_losses] == [1, 2, 3]
    assert [x for _, x in whole_losses] == pytest.approx([x for _, x in split_losses], rel=1e-5)


def test_resumed_run_continues_exactly(tmp_path):
    config = training_config(steps=10, save_every=3, keep_last=2)
    # 12 examples / 4 per batch = 3 batches an epoch: the runs cross epochs and resume mid-epoch.
    full, _ = run(tmp_path, "full", ReverseTask(), config, dropout=0.2)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, "killed", ReverseTask(fail_at=8), config, dropout=0.2)
    assert [p.name for p in list_checkpoints(tmp_path / "killed" / "checkpoints")] == \
        ["step-3", "step-6"]
    torch.manual_seed(123)  # the resumed run must not depend on the caller's RNG
    resumed, _ = run(tmp_path, "killed", ReverseTask(), config, model_seed=5, dropout=0.2)
    assert train_losses(tmp_path / "killed") == train_losses(tmp_path / "full")
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert [p.name for p in list_checkpoints(tmp_path / "killed" / "checkpoints")] == \
        ["step-9", "step-10"]


def test_resume_refuses_another_config_or_a_fresh_start(tmp_path):
    run(tmp_path, "a", ReverseTask(), training_config(steps=2, save_every=1))
    model = Transformer(tiny_config().replace(d_ff=32))
    with pytest.raises(ValueError, match="d_ff"):
        train(model, ReverseTask(), training_config(steps=3), tmp_path / "a")
    with pytest.raises(ValueError, match="already holds a run"):
        train(Transformer(tiny_config()), ReverseTask(), training_config(steps=3), tmp_path / "a",
              resume=False)


def test_resume_refuses_other_training_settings_and_names_them(tmp_path):
    """Settings that shape the steps still to come (the learning rate, lr_scales, the optimizer's
    hyper-parameters, accumulation, the seed, the metric behind the best value) must be the run's
    own; nothing is written when they are not."""
    base = dict(steps=2, save_every=1)
    run(tmp_path, "a", ReverseTask(), training_config(**base))
    run_file = tmp_path / "a" / "run.json"
    before = run_file.read_bytes()
    schedule = training_config(**base).schedule
    for changes, named in (
            ({"lr_scales": {"decoder.": 30.0}}, "lr_scales (the run's {}, now {'decoder.': 30.0})"),
            ({"schedule": Schedule(kind="constant", peak=schedule.peak, warmup=7)}, "schedule"),
            ({"betas": (0.9, 0.99), "weight_decay": 0.1}, "betas"),
            ({"accumulation": 2}, "accumulation"),
            ({"seed": 1}, "seed (the run's 0, now 1)"),
            ({"best_metric": None}, "best_metric (the run's 'loss', now None)")):
        with pytest.raises(ValueError, match="trained with other settings") as error:
            train(Transformer(tiny_config()), ReverseTask(),
                  training_config(**{**base, "steps": 3, **changes}), tmp_path / "a")
        assert named in str(error.value) and "--init" in str(error.value)
        assert run_file.read_bytes() == before
    assert [p.name for p in list_checkpoints(tmp_path / "a" / "checkpoints")][-1] == "step-2"


def test_resume_may_change_how_long_where_and_what_it_reports(tmp_path):
    """More steps (the schedule's end follows them), a time limit, other intervals, no progress
    bar: the run resumes, and run.json records the settings it now runs with."""
    def cosine(total):
        return Schedule(kind="warmup_cosine", peak=3e-3, warmup=1, total=total)

    run(tmp_path, "a", ReverseTask(), training_config(steps=2, save_every=1, schedule=cosine(2)))
    config = training_config(steps=4, save_every=2, eval_every=2, log_every=2, keep_last=3,
                             time_limit=600.0, progress=False, schedule=cosine(4))
    train(Transformer(tiny_config()), ReverseTask(), config, tmp_path / "a")
    assert [p.name for p in list_checkpoints(tmp_path / "a" / "checkpoints")][-1] == "step-4"
    saved = json.loads((tmp_path / "a" / "run.json").read_text(encoding="utf-8"))
    assert saved["training_config"]["steps"] == saved["training_config"]["schedule"]["total"] == 4


def test_the_cli_names_an_option_for_every_setting_a_resume_must_keep():
    """``SETTING_OPTIONS`` covers exactly the TrainingConfig fields outside RESUME_MAY_CHANGE, and
    each option it names is one of the ``aiayn train TASK`` parsers'."""
    import argparse
    from dataclasses import fields

    from aiayn.cli import build_parser
    from aiayn.commands.train import SETTING_OPTIONS
    from aiayn.training.run import RESUME_MAY_CHANGE

    assert set(SETTING_OPTIONS) == {f.name for f in fields(TrainingConfig)} - RESUME_MAY_CHANGE

    def options(parser):  # every option string of the parser and of its sub-commands
        found = set()
        for action in parser._actions:
            found |= set(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    found |= options(sub)
        return found

    known = options(build_parser())
    for field, names in SETTING_OPTIONS.items():
        assert set(names) <= known, (field, set(names) - known)


def test_a_run_saved_before_a_training_field_existed_resumes(tmp_path):
    """run.json of an older aiayn lacks training fields added since (they take their defaults);
    one written before the training config was recorded is not compared."""
    run(tmp_path, "a", ReverseTask(), training_config(steps=2, save_every=1))
    path = tmp_path / "a" / "run.json"
    info = json.loads(path.read_text(encoding="utf-8"))
    assert info["training_config"].pop("lr_scales") == {}
    path.write_text(json.dumps(info), encoding="utf-8")
    train(Transformer(tiny_config()), ReverseTask(), training_config(steps=3, save_every=1),
          tmp_path / "a")
    info = json.loads(path.read_text(encoding="utf-8"))
    del info["training_config"]
    path.write_text(json.dumps(info), encoding="utf-8")
    train(Transformer(tiny_config()), ReverseTask(), training_config(steps=4, save_every=1),
          tmp_path / "a")
    assert [p.name for p in list_checkpoints(tmp_path / "a" / "checkpoints")][-1] == "step-4"


def test_a_run_saved_before_a_config_field_existed_resumes(tmp_path):
    """run.json of an older aiayn lacks the fields added since; they take their defaults."""
    import json

    run(tmp_path, "a", ReverseTask(), training_config(steps=2, save_every=1))
    path = tmp_path / "a" / "run.json"
    info = json.loads(path.read_text(encoding="utf-8"))
    for field in ("image_size", "patch_size", "num_channels"):  # fields of a later aiayn
        del info["model_config"][field]
    path.write_text(json.dumps(info), encoding="utf-8")
    train(Transformer(tiny_config()), ReverseTask(), training_config(steps=3, save_every=1),
          tmp_path / "a")
    assert [p.name for p in list_checkpoints(tmp_path / "a" / "checkpoints")][-1] == "step-3"


def test_lr_scales_multiply_the_learning_rate_of_matching_parameters(tmp_path):
    """Adam's first update is lr * g / (|g| + eps): with lr_scales {"decoder.": 4} the decoder's
    parameters move exactly 4x as far as without, every other parameter exactly as far."""
    torch.manual_seed(0)  # as run() builds its model
    start = Transformer(tiny_config()).state_dict()
    moved = {}
    for name, scales in (("plain", {}), ("scaled", {"decoder.": 4.0})):
        model, _ = run(tmp_path, name, ReverseTask(),
                       training_config(steps=1, lr_scales=scales, clip_norm=None))
        moved[name] = {key: value.detach() - start[key]  # a tied matrix under its first name
                       for key, value in model.named_parameters()}
    scaled_any = False
    for key, plain in moved["plain"].items():
        factor = 4.0 if key.startswith("decoder.") else 1.0
        torch.testing.assert_close(moved["scaled"][key], factor * plain, rtol=1e-5, atol=1e-6,
                                   msg=key)
        scaled_any |= factor == 4.0 and bool(plain.abs().max() > 0)
    assert scaled_any


def test_lr_scales_longest_prefix_wins_and_names_ignore_wrappers():
    from aiayn.training.optimizer import lr_scale, make_optimizer

    scales = {"encoder.": 2.0, "encoder.layers.1.": 5.0}
    assert lr_scale("encoder.layers.1.ffn.w", scales) == 5.0
    assert lr_scale("encoder.layers.0.ffn.w", scales) == 2.0
    assert lr_scale("head.classifier.weight", scales) == 1.0
    compiled = torch.compile(Transformer(tiny_config()))  # names gain "_orig_mod."; not run
    optimizer = make_optimizer(compiled, training_config(lr_scales={"decoder.": 4.0}))
    decoder = {id(p) for name, p in compiled._orig_mod.named_parameters()
               if name.startswith("decoder.")}  # a tied matrix under its first name
    for group in optimizer.param_groups:
        assert group["lr_scale"] == (4.0 if id(group["params"][0]) in decoder else 1.0)
    for bad in ({"": 2.0}, {"head.": 0.0}, {"head.": True}):
        with pytest.raises(ValueError, match="lr_scales"):
            training_config(lr_scales=bad)


def test_a_run_with_lr_scales_resumes_exactly(tmp_path):
    config = training_config(steps=6, save_every=2, lr_scales={"decoder.": 3.0})
    full, _ = run(tmp_path, "full", ReverseTask(), config)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, "killed", ReverseTask(fail_at=5), config)
    resumed, _ = run(tmp_path, "killed", ReverseTask(), config, model_seed=5)
    assert train_losses(tmp_path / "killed") == train_losses(tmp_path / "full")
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


# --- checkpoints ----------------------------------------------------------------------------------
def test_failed_checkpoint_write_leaves_the_previous_one_intact(tmp_path, monkeypatch):
    run(tmp_path, "a", ReverseTask(), training_config(steps=2, save_every=2))
    step2 = tmp_path / "a" / "checkpoints" / "step-2"
    before = {p.name: p.read_bytes() for p in step2.iterdir()}

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        train(Transformer(tiny_config()), ReverseTask(), training_config(steps=4, save_every=2),
              tmp_path / "a")
    names = sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir())
    assert names == ["step-2"]  # no half-written step-4, no temporary directory left
    assert {p.name: p.read_bytes() for p in step2.iterdir()} == before


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    run(tmp_path, "a", ReverseTask(), training_config(steps=2, save_every=1, keep_last=0))
    weights = tmp_path / "a" / "checkpoints" / "step-2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="step-2.*(checksum|corrupt)"):
        train(Transformer(tiny_config()), ReverseTask(), training_config(steps=3), tmp_path / "a")
    state = tmp_path / "a" / "checkpoints" / "step-1" / "trainer_state.safetensors"
    state.write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="corrupt or truncated|checksum"):
        checkpoint_module.read_checkpoint(state.parent)


def test_average_checkpoints_is_the_elementwise_mean(tmp_path):
    run(tmp_path, "a", ReverseTask(), training_config(steps=3, save_every=1, keep_last=0))
    paths = list_checkpoints(tmp_path / "a" / "checkpoints")
    tensors = [read_tensors(p / "model.safetensors") for p in paths]
    averaged = average_checkpoints(paths)
    for name, value in averaged.items():
        torch.testing.assert_close(value, sum(t[name] for t in tensors) / 3)
    with pytest.raises(ValueError, match="at least one"):
        average_checkpoints([])


def test_average_last_and_best_pick_the_run_model(tmp_path):
    _, metrics = run(tmp_path, "a", ReverseTask(),
                     training_config(steps=6, save_every=2, eval_every=2, average_last=3))
    info = json.loads((tmp_path / "a" / "run.json").read_text())
    assert info["weights_source"].startswith(("best@", "average of 3@"))
    loaded = load_run(tmp_path / "a", task="translation", load_assets=False)
    with torch.no_grad():
        reevaluated = ReverseTask().evaluate(loaded.model)["loss"]
    assert info["weights_metrics"]["loss"] == pytest.approx(reevaluated, rel=1e-5)
    records = [json.loads(x) for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "valid"] == [2, 4, 6]
    assert any(r["split"] == "valid_averaged" for r in records)


@pytest.mark.parametrize("metric", [None, "loss"])
def test_the_average_is_the_run_model_without_a_metric_and_the_model_keeps_its_weights(
        tmp_path, metric):
    """With no best_metric the run's model is the average of the last checkpoints (paper 6.1),
    not the final weights; with one, the better of the two. Either way the trained model ends
    holding its final weights, not the average it was evaluated with."""
    model, _ = run(tmp_path, "a", ReverseTask(), training_config(
        steps=6, save_every=2, eval_every=2, keep_last=0, average_last=3, best_metric=metric))
    checkpoints = list_checkpoints(tmp_path / "a" / "checkpoints")
    average, final = average_checkpoints(checkpoints[-3:]), read_tensors(
        checkpoints[-1] / "model.safetensors")
    assert not all(torch.equal(average[name], final[name]) for name in final)
    for name, value in model.state_dict().items():
        if name in final:
            torch.testing.assert_close(value, final[name], rtol=0, atol=0, msg=name)
    info = json.loads((tmp_path / "a" / "run.json").read_text())
    published = read_tensors(tmp_path / "a" / "model.safetensors")
    records = [json.loads(x) for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    averaged_loss = next(r["loss"] for r in records if r["split"] == "valid_averaged")
    best_loss = min(r["loss"] for r in records if r["split"] == "valid")
    if metric is None or averaged_loss < best_loss:
        assert info["weights_source"] == "average of 3@6"
        assert info["weights_metrics"]["loss"] == averaged_loss
        for name in average:
            torch.testing.assert_close(published[name], average[name], rtol=0, atol=0, msg=name)
    else:
        assert info["weights_source"].startswith("best@")


def test_averaging_fewer_checkpoints_than_asked_warns(tmp_path):
    """save_every 0 writes only the last checkpoint: its "average" is the final weights, said in a
    warning and in the log; a run with enough checkpoints does not warn."""
    with pytest.warns(RuntimeWarning, match=r"average_last=3: the run has only 1 checkpoint\(s\) "
                                            r"to average \(save_every=0, 4 steps\)"):
        run(tmp_path, "a", ReverseTask(), training_config(steps=4, eval_every=2, average_last=3))
    records = [json.loads(x) for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    assert [r["checkpoints"] for r in records if r["split"] == "valid_averaged"] == [1]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="average_last", category=RuntimeWarning)
        run(tmp_path, "b", ReverseTask(), training_config(steps=4, eval_every=2, save_every=1,
                                                          average_last=3))


def test_a_resumed_run_keeps_published_weights_better_than_its_checkpoints(tmp_path):
    """The checkpoint average is published after the last checkpoint is written, so no checkpoint
    records its score: a resumed run must still beat it before replacing the run's model."""
    run(tmp_path, "a", ReverseTask(),
        training_config(steps=4, save_every=2, eval_every=2, best_metric="loss", best_mode="min"))
    run_json = tmp_path / "a" / "run.json"
    info = json.loads(run_json.read_text())
    best_loss = min(json.loads(line)["loss"] for line in (tmp_path / "a" / "log.jsonl")
                    .read_text().splitlines() if json.loads(line)["split"] == "valid")
    # As the published average leaves it: a better score than any checkpoint's best.
    info.update(weights_source="average of 2@4",
                weights_metrics={**info["weights_metrics"], "loss": best_loss / 10})
    run_json.write_text(json.dumps(info))
    weights = (tmp_path / "a" / "model.safetensors").read_bytes()
    run(tmp_path, "a", ReverseTask(),
        training_config(steps=8, save_every=2, eval_every=2, best_metric="loss", best_mode="min"))
    after = json.loads(run_json.read_text())
    assert after["weights_source"] == "average of 2@4"
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == weights
    state = json.loads((tmp_path / "a" / "checkpoints" / "step-8" / "trainer_state.json")
                       .read_text())
    assert state["best"] == pytest.approx(best_loss / 10)  # carried into later checkpoints


def test_nonfinite_gradient_skips_the_update(tmp_path):
    class Poisoned(ReverseTask):
        def loss(self, model, batch):
            loss = super().loss(model, batch)
            return loss * float("inf") if self.calls == 2 else loss

    model, _ = run(tmp_path, "a", Poisoned(), training_config(steps=3))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    last = [json.loads(x) for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()
            if json.loads(x)["split"] == "train"][-1]
    assert last["skipped"] == 1
    with pytest.raises(ValueError, match="non-finite"):
        run(tmp_path, "b", Poisoned(), training_config(steps=3, nonfinite="raise"))


def test_validation_runs_in_eval_mode_and_restores_the_mode_also_after_an_error():
    from aiayn.training.validation import evaluate_model

    class Probe(ReverseTask):
        def evaluate(self, model):
            self.seen = model.training
            if self.fail:
                raise RuntimeError("evaluation failed")
            return super().evaluate(model)

    model = Transformer(tiny_config(dropout=0.3)).train()
    task = Probe()
    task.fail = False
    first, second = evaluate_model(model, task), evaluate_model(model, task)
    assert first == second and task.seen is False and model.training  # no dropout inside
    task.fail = True
    with pytest.raises(RuntimeError, match="evaluation failed"):
        evaluate_model(model, task)
    assert model.training


def test_time_limit_stops_training_early(tmp_path):
    _, metrics = run(tmp_path, "a", ReverseTask(), training_config(steps=50, time_limit=1e-6))
    assert metrics["step"] == 1
    records = [json.loads(x) for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    assert any(r.get("stopped") == "time_limit" for r in records)


def test_bf16_autocast_trains(tmp_path):
    _, metrics = run(tmp_path, "a", ReverseTask(), training_config(steps=3, autocast="bf16"))
    assert math.isfinite(metrics["loss"])


# --- load_run -------------------------------------------------------------------------------------
def test_load_run_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not an aiayn run directory"):
        load_run(tmp_path / "empty")
    run(tmp_path, "a", ReverseTask(), training_config(steps=2))
    run_dir = tmp_path / "a"
    loaded = load_run(run_dir, load_assets=False)
    assert loaded.task == "translation" and not loaded.model.training
    with pytest.raises(ValueError, match="task 'translation', not 'lm'"):
        load_run(run_dir, task="lm")
    with pytest.raises(ValueError, match="not an aiayn class"):
        load_run(run_dir)  # the test task class lives outside aiayn: never imported from data
    info = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**info, "format_version": 99}))
    with pytest.raises(ValueError, match="newer"):
        load_run(run_dir, load_assets=False)
    (run_dir / "run.json").write_text(json.dumps(
        {**info, "model_config": {**info["model_config"], "d_model": 64, "n_heads": 4}}))
    with pytest.raises(ValueError, match="do not match the model config"):
        load_run(run_dir, load_assets=False)
    (run_dir / "run.json").write_text(json.dumps(info))
    weights = run_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(ValueError, match="checksum mismatch"):
        load_run(run_dir, load_assets=False)
    (run_dir / "run.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt run file"):
        load_run(run_dir)
