"""Distributed training (2 processes, gloo on CPU): DDP and FSDP runs equal a 1-process run with the
same global batch, kill + resume with 2 processes, rank disagreement and failure, batch sharding,
activation checkpointing and torch.compile."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import sys
import traceback
from pathlib import Path

import pytest
import script_helpers as scripts
import torch

from aiayn import CausalLM, MaskedLM, Transformer, TransformerConfig
from aiayn.training import TrainingConfig, train
from aiayn.training.checkpoint import list_checkpoints
from aiayn.training.distributed import Parallel
from aiayn.training.layer_wrappers import transformer_layers
from aiayn.training.process_group import process_group_from_env
from aiayn.training.weights import average_checkpoints, read_tensors

PAD = 0


def _has_fsdp2() -> bool:
    import torch.distributed.fsdp as fsdp
    return hasattr(fsdp, "fully_shard")  # public from torch 2.6


# Older torch: Parallel.wrap raises a RuntimeError that names the version and suggests DDP.
NEEDS_FSDP2 = pytest.mark.skipif(not _has_fsdp2(),
                                 reason=f"torch {torch.__version__} has no FSDP2 fully_shard")
CONFIG = TransformerConfig.preset("tiny", vocab_size=23, d_model=16, n_heads=2, d_ff=32,
                                  n_decoder_layers=2, max_length=16, dropout=0.0,
                                  attention_dropout=0.0, activation_dropout=0.0)


class TinyLMTask:
    """Next-token prediction on random sequences of random lengths: batches of different sizes and
    token counts, so the global token normalisation matters. 7 batches an epoch (odd on purpose:
    steps straddle epochs)."""

    name = "lm"

    def __init__(self, *, seed=0, batches=7, fail_rank=None, fail_at=None, lm_loss=False,
                 translation=False, masked=False, overflow_batch=None):
        self.seed, self.batches = seed, batches
        # The loss of this batch of epoch 0 is multiplied by 1e10: its fp16 gradients overflow.
        self.overflow = (None if overflow_batch is None
                         else list(self.train_batches(0))[overflow_batch])
        self.fail_rank, self.fail_at, self.calls = fail_rank, fail_at, 0
        self.lm_loss = lm_loss  # aiayn's LM loss (on the CPU: hidden_states + chunked loss)
        # An encoder-decoder Transformer under the translation task's loss: the source is the
        # sequence without its first token, the target the next-token pairs as in the LM.
        self.translation = translation
        # A MaskedLM under the masked-LM task's loss: every third position is replaced by id 1 and
        # predicted.
        self.masked = masked

    def model_config(self, base):
        return base

    def build_model(self, model_config):
        if self.masked:
            return MaskedLM(model_config)
        return Transformer(model_config) if self.translation else CausalLM(model_config)

    def train_batches(self, epoch):
        generator = torch.Generator().manual_seed(self.seed * 1000 + epoch)
        for _ in range(self.batches):
            size = int(torch.randint(1, 4, (1,), generator=generator))
            lengths = torch.randint(3, 12, (size,), generator=generator)
            ids = torch.randint(1, CONFIG.vocab_size, (size, int(lengths.max())),
                                generator=generator)
            ids[torch.arange(ids.shape[1]) >= lengths[:, None]] = PAD
            yield ids

    def count(self, batch):
        return int((batch[:, 1:] != PAD).sum())

    def loss(self, model, batch):
        self.calls += 1
        rank = int(os.environ.get("RANK", "0"))
        if self.fail_at is not None and self.calls == self.fail_at and rank == self.fail_rank:
            raise RuntimeError(f"simulated failure on rank {rank}")
        if self.overflow is not None and batch.shape == self.overflow.shape \
                and torch.equal(batch, self.overflow):
            self.overflow = None  # once
            return self.unscaled_loss(model, batch) * 1e10
        return self.unscaled_loss(model, batch)

    def unscaled_loss(self, model, batch):
        if self.masked:
            from aiayn.tasks.masked_lm import masked_lm_loss

            chosen = (torch.arange(batch.shape[1]) % 3 == 0) & (batch != PAD)  # (B, T)
            return masked_lm_loss(model, batch.masked_fill(chosen, 1),
                                  batch.masked_fill(~chosen, -100), batch != PAD)[0]
        if self.translation:
            from aiayn.tasks.translation import translation_loss

            return translation_loss(model, batch[:, 1:], batch[:, :-1], batch[:, 1:], pad_id=PAD)
        if self.lm_loss:
            from aiayn.tasks.lm import token_loss

            return token_loss(model, batch[:, :-1], batch[:, 1:].masked_fill(batch[:, 1:] == PAD,
                                                                             -100))
        logits = model(batch[:, :-1], padding_mask=batch[:, :-1] != PAD)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(),
                                                 ignore_index=PAD, reduction="sum")

    def evaluate(self, model):
        batch = next(iter(self.train_batches(99)))
        return {"loss": float(self.loss(model, batch)) / self.count(batch)}

    def save_assets(self, run_dir):
        return {}

    @classmethod
    def load_assets(cls, run_dir):
        return None


def _config(**changes):
    # eps 1e-4, not the paper's 1e-9: the key-projection bias has an analytically zero gradient
    # (softmax ignores a constant per query), so its float noise (~1e-9) would be blown up by Adam
    # to updates of ~lr whose sign depends on summation order, i.e. on the number of processes.
    base = dict(steps=4, accumulation=1, optimizer="adamw", weight_decay=0.01, clip_norm=1.0,
                eps=1e-4,
                schedule={"kind": "constant", "peak": 3e-3, "warmup": 0}, log_every=1,
                eval_every=0, save_every=2, keep_last=0, best_metric=None, progress=False,
                device="cpu")
    return TrainingConfig(**{**base, **changes})


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _threads() -> list[str]:
    """The names of this process's native threads (Linux; [] elsewhere)."""
    names = []
    for task in Path("/proc/self/task").glob("*"):
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # a thread that ended meanwhile
            continue
    return sorted(names)


def _worker(rank, world, port, run_dir, config_changes, task_changes, timeout_s, error_file):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # The native threads before joining the process group and after leaving it.
    threads_file = Path(error_file).with_suffix(".threads")
    threads_file.write_text(json.dumps({"before": _threads()}), encoding="utf-8")
    try:
        with process_group_from_env(device="cpu", timeout_s=timeout_s):
            config = CONFIG.replace(dropout=task_changes.pop("dropout", 0.0))
            task = TinyLMTask(**task_changes)
            torch.manual_seed(0)
            train(task.build_model(config), task, _config(**config_changes), run_dir,
                  model_config=config)
    except BaseException as error:  # reported to the test through a file
        Path(error_file).write_text(f"{type(error).__name__}: {error}\n"
                                    f"{traceback.format_exc()}", encoding="utf-8")
        _record_threads_after(threads_file)
        sys.exit(1)
    _record_threads_after(threads_file)


def _record_threads_after(path: Path) -> None:
    record = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**record, "after": _threads()}), encoding="utf-8")


def _launch(run_dir, *, world=2, config=None, task=None, per_rank_config=None,
            per_rank_task=None, timeout_s=60.0, join_s=120.0):
    """Run ``world`` training processes; return (exit codes, error texts by rank)."""
    context = multiprocessing.get_context("spawn")
    port = _free_port()
    errors = [Path(run_dir).parent / f"{Path(run_dir).name}.rank{r}.err" for r in range(world)]
    processes = []
    for rank in range(world):
        changes = {**(config or {}), **((per_rank_config or {}).get(rank, {}))}
        task_changes = {**(task or {}), **((per_rank_task or {}).get(rank, {}))}
        process = context.Process(target=_worker, args=(
            rank, world, port, str(run_dir), changes, task_changes, timeout_s,
            str(errors[rank])))
        process.start()
        processes.append(process)
    codes = []
    for process in processes:
        process.join(join_s)
        if process.is_alive():
            process.kill()
            process.join()
            codes.append("hung")
        else:
            codes.append(process.exitcode)
    texts = [e.read_text(encoding="utf-8") if e.is_file() else "" for e in errors]
    return codes, texts


def _losses(run_dir):
    lines = (Path(run_dir) / "log.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["loss"] for line in lines if json.loads(line)["split"] == "train"]


def _weights(run_dir):
    return read_tensors(list_checkpoints(Path(run_dir) / "checkpoints")[-1] / "model.safetensors")


def _assert_same_run(ours, reference):
    assert _losses(ours) == pytest.approx(_losses(reference), rel=1e-5, abs=1e-6)
    mine, theirs = _weights(ours), _weights(reference)
    assert mine.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-4, atol=1e-5, msg=name)
    # The optimizer moments too (gathered from the shards under FSDP, numbered as in 1 process):
    # the checkpoint is the same whatever the number of processes that wrote it.
    mine, theirs = _trainer_tensors(ours), _trainer_tensors(reference)
    assert mine.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-3, atol=1e-7, msg=name)


def _trainer_tensors(run_dir):
    last = list_checkpoints(Path(run_dir) / "checkpoints")[-1]
    tensors = read_tensors(last / "trainer_state.safetensors")
    return {name: value for name, value in tensors.items() if name.startswith("optimizer/")}


def _single(run_dir, task=None, **changes):
    task = TinyLMTask(**(task or {}))
    torch.manual_seed(0)
    train(task.build_model(CONFIG), task, _config(**changes), run_dir, model_config=CONFIG)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """1 process, accumulation 4 = the global batch of 2 processes x accumulation 2."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    _single(run_dir, accumulation=4)
    return run_dir


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=[pytest.mark.slow,
                                                                         NEEDS_FSDP2])])
def test_two_processes_equal_one_process_with_the_same_global_batch(tmp_path, reference,
                                                                    strategy):
    run_dir = tmp_path / "run"
    codes, errors = _launch(run_dir, config={"accumulation": 2, "distributed": strategy})
    assert codes == [0, 0], errors
    _assert_same_run(run_dir, reference)
    info = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    assert info["training_config"]["distributed"] == strategy
    assert len(_losses(run_dir)) == 4  # rank 0 alone wrote the log, once per step


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=NEEDS_FSDP2)])
@pytest.mark.parametrize("metric", [None, "loss"])
def test_checkpoint_averaging_with_two_processes_equals_one_process(tmp_path, strategy, metric):
    """average_last under DDP (rank 0 evaluates the average) and FSDP (every rank loads its shard
    of the average and evaluates): the same averaged score, the same published model and the same
    choice of it as one process with the same global batch."""
    changes = dict(steps=6, eval_every=2, save_every=2, keep_last=0, average_last=2,
                   best_metric=metric)
    _single(tmp_path / "single", accumulation=4, **changes)
    codes, errors = _launch(tmp_path / "run", config={"accumulation": 2, "distributed": strategy,
                                                      **changes})
    assert codes == [0, 0], errors

    def outcome(run_dir):
        records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text(
            encoding="utf-8").splitlines()]
        averaged = [r for r in records if r["split"] == "valid_averaged"]
        info = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
        return averaged, info["weights_source"], read_tensors(run_dir / "model.safetensors")

    (ours, source, weights), (theirs, their_source, their_weights) = (
        outcome(tmp_path / "run"), outcome(tmp_path / "single"))
    assert len(ours) == 1 and ours[0]["checkpoints"] == 2
    assert ours[0]["loss"] == pytest.approx(theirs[0]["loss"], rel=1e-5)
    assert source == their_source
    if metric is None:  # the run's model is the average of its own last two checkpoints
        assert source == "average of 2@6"
        average = average_checkpoints(list_checkpoints(tmp_path / "run" / "checkpoints")[-2:])
        for name in average:
            torch.testing.assert_close(weights[name], average[name], rtol=0, atol=0, msg=name)
    for name in their_weights:
        torch.testing.assert_close(weights[name], their_weights[name], rtol=1e-4, atol=1e-5,
                                   msg=name)


@NEEDS_FSDP2
def test_fsdp_gathers_the_parameters_for_a_causal_lms_hidden_states(tmp_path):
    """aiayn's LM loss runs CausalLM.hidden_states, not forward, on the CPU (the chunked loss):
    FSDP gathers the sharded parameters for it too, and the run equals one process's."""
    _single(tmp_path / "single", task={"lm_loss": True}, accumulation=4)
    codes, errors = _launch(tmp_path / "run", config={"accumulation": 2, "distributed": "fsdp"},
                            task={"lm_loss": True})
    assert codes == [0, 0], errors
    _assert_same_run(tmp_path / "run", tmp_path / "single")


@NEEDS_FSDP2
def test_fsdp_gathers_the_parameters_for_the_translation_loss(tmp_path):
    """The translation task's loss runs Transformer.hidden_states and the output projection, not
    forward: FSDP gathers the shared embeddings and the projection for them, and the run equals
    one process's (it failed on mixed Tensor and DTensor arguments in the embedding)."""
    _single(tmp_path / "single", task={"translation": True}, accumulation=4)
    codes, errors = _launch(tmp_path / "run", config={"accumulation": 2, "distributed": "fsdp"},
                            task={"translation": True})
    assert codes == [0, 0], errors
    _assert_same_run(tmp_path / "run", tmp_path / "single")


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=NEEDS_FSDP2)])
def test_the_masked_lm_loss_trains_under_ddp_and_fsdp(tmp_path, strategy):
    """The masked-LM task's loss projects only the chosen positions (MaskedLM.hidden_states and
    the head): under FSDP the parameters are gathered for it; under DDP the wrapper's forward runs
    instead (DDP has no hidden_states). Either run equals one process's."""
    _single(tmp_path / "single", task={"masked": True}, accumulation=4)
    codes, errors = _launch(tmp_path / "run", config={"accumulation": 2, "distributed": strategy},
                            task={"masked": True})
    assert codes == [0, 0], errors
    _assert_same_run(tmp_path / "run", tmp_path / "single")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=NEEDS_FSDP2)])
def test_killed_run_resumed_with_two_processes_reaches_the_same_weights(tmp_path, reference,
                                                                        strategy):
    run_dir = tmp_path / "run"
    # Rank 1 dies in its 5th micro-batch (step 3), after the step-2 checkpoint.
    codes, errors = _launch(run_dir, config={"accumulation": 2, "distributed": strategy},
                            task={"fail_rank": 1, "fail_at": 5}, timeout_s=20.0)
    assert codes[1] == 1 and "simulated failure on rank 1" in errors[1]
    assert codes[0] != 0 and codes[0] != "hung"  # rank 0 fails too instead of hanging
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step-2"]
    codes, errors = _launch(run_dir, config={"accumulation": 2, "distributed": strategy})
    assert codes == [0, 0], errors
    _assert_same_run(run_dir, reference)


@pytest.mark.slow
@pytest.mark.slow
def test_resume_with_dropout_continues_every_ranks_random_stream(tmp_path):
    uninterrupted, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    codes, errors = _launch(uninterrupted, task={"dropout": 0.3})
    assert codes == [0, 0], errors
    codes, errors = _launch(resumed, task={"dropout": 0.3, "fail_rank": 1, "fail_at": 3},
                            timeout_s=20.0)
    assert codes[1] == 1 and "simulated failure on rank 1" in errors[1]
    saved = read_tensors(resumed / "checkpoints" / "step-2" / "trainer_state.safetensors")
    assert "rng/rank1/torch" in saved and "rng/rank0/torch" not in saved
    codes, errors = _launch(resumed, task={"dropout": 0.3})
    assert codes == [0, 0], errors
    assert _losses(resumed) == _losses(uninterrupted)
    mine, theirs = _weights(resumed), _weights(uninterrupted)
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_a_failing_rank_shuts_every_rank_down_without_hanging(tmp_path):
    codes, errors = _launch(tmp_path / "run", task={"fail_rank": 0, "fail_at": 2},
                            timeout_s=15.0, join_s=90.0)
    assert codes[0] == 1 and "simulated failure on rank 0" in errors[0]
    assert codes[1] not in (0, "hung"), errors[1]
    assert not list_checkpoints(tmp_path / "run" / "checkpoints")


def _threads_left(run_dir, rank):
    record = json.loads((Path(run_dir).parent / f"{Path(run_dir).name}.rank{rank}.threads")
                        .read_text(encoding="utf-8"))
    return record["before"], record["after"]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads through /proc")
@pytest.mark.parametrize("fail", [False, True], ids=["finishing", "failing"])
def test_leaving_the_process_group_ends_its_threads_on_every_rank(tmp_path, fail):
    """The group is destroyed before the process_group_from_env block is left, by a finishing or a
    failing rank: none of its threads (gloo's workers, the store's server) is left for the
    interpreter's shutdown to tear down, where a failing rank used to abort with SIGABRT."""
    task = {"dropout": 0.3, **({"fail_rank": 1, "fail_at": 3} if fail else {})}
    codes, errors = _launch(tmp_path / "run", task=task, timeout_s=20.0)
    if fail:
        assert codes == [1, 1] and "simulated failure on rank 1" in errors[1], (codes, errors)
    else:
        assert codes == [0, 0], errors
    for rank in range(2):
        before, after = _threads_left(tmp_path / "run", rank)
        assert not [name for name in after if "gloo" in name or "tcpstore" in name], after
        assert len(after) <= len(before), (before, after)


def test_ranks_that_disagree_on_the_config_fail_with_a_clear_error(tmp_path):
    codes, errors = _launch(tmp_path / "run", per_rank_config={1: {"steps": 5}})
    assert codes == [1, 1]
    for text in errors:
        assert "ranks disagree on: training config (rank(s) 1 differ from rank 0)" in text
    assert not (tmp_path / "run" / "run.json").exists()  # nothing written


@pytest.mark.slow
def test_ranks_that_disagree_on_the_data_fail_with_a_clear_error(tmp_path):
    # A task seeded by the rank (a common mistake): different batches on each rank.
    codes, errors = _launch(tmp_path / "run", per_rank_task={1: {"seed": 1}})
    assert codes == [1, 1]
    for text in errors:
        assert "ranks disagree on: training data (rank(s) 1 differ from rank 0)" in text


def test_each_rank_takes_its_own_batches_none_dropped_or_repeated():
    class Stream:  # the trainer's BatchStream: a global stream across epochs
        def __init__(self):
            self.position = 0

        def next(self):
            self.position += 1
            return self.position - 1

    world, accumulation, steps = 3, 2, 5
    taken = []
    for rank in range(world):
        parallel = Parallel("ddp", torch.device("cpu"))
        parallel.rank, parallel.world_size = rank, world
        stream = Stream()
        mine = [parallel.step_batches(stream, accumulation) for _ in range(steps)]
        assert all(len(step) == accumulation for step in mine)  # same number of steps and sizes
        assert stream.position == world * accumulation * steps  # every rank advances alike
        taken.append([batch for step in mine for batch in step])
        assert taken[-1][:2] == [rank, rank + world]
    assert sorted(sum(taken, [])) == list(range(world * accumulation * steps))


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    config = CONFIG.replace(dropout=0.2, attention_dropout=0.1)
    task = TinyLMTask()
    batch = next(iter(task.train_batches(0)))
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = task.build_model(config).train()
        if checkpointing:
            parallel = Parallel("ddp", torch.device("cpu"))
            parallel.wrap(model, activation_checkpointing=True)
            assert len(transformer_layers(model)) == 2
        torch.manual_seed(1)
        loss = task.loss(model, batch)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=0)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], msg=name)
    assert set(dict(model.named_parameters())) == set(grads_a)  # names unchanged by the wrapper


def test_activation_checkpointing_and_bf16_train_and_save_like_the_plain_model(tmp_path):
    _single(tmp_path / "plain", steps=2)
    _single(tmp_path / "ckpt", steps=2, activation_checkpointing=True)
    _assert_same_run(tmp_path / "ckpt", tmp_path / "plain")
    _single(tmp_path / "bf16", steps=2, activation_checkpointing=True, autocast="bf16")
    assert all(torch.isfinite(torch.tensor(_losses(tmp_path / "bf16"))))


@pytest.mark.slow
def test_compile_option_trains_a_tiny_model(tmp_path, monkeypatch):
    # One process compiles the task's loss (model and loss in one graph) with the default
    # (inductor) backend; here the aot_eager backend keeps the test short on a CPU (the same Dynamo
    # capture and AOT autograd, no C++ code generation).
    from aiayn.training import trainer

    compiled = []
    plain_compile = torch.compile

    def compile_for_test(function, *args, **kwargs):
        compiled.append(function.__qualname__)
        return plain_compile(function, *args, **{**kwargs, "backend": "aot_eager"})

    monkeypatch.setattr(trainer.torch, "compile", compile_for_test)
    _single(tmp_path / "plain", steps=2)
    assert not compiled
    _single(tmp_path / "compiled", steps=2, compile=True)
    assert compiled == ["TinyLMTask.loss"]  # the loss, not the layers
    assert _losses(tmp_path / "compiled") == pytest.approx(_losses(tmp_path / "plain"), rel=1e-4)
    assert _weights(tmp_path / "compiled").keys() == _weights(tmp_path / "plain").keys()


def test_compile_layers_compiles_the_layers_and_keeps_the_chunked_loss(monkeypatch):
    """What ``compile`` does under DDP / FSDP: the layers in place, the model's call and loss
    eager."""
    from aiayn import CausalLM, TransformerConfig
    from aiayn.tasks.lm import token_loss
    from aiayn.training import chunked_loss
    from aiayn.training.layer_wrappers import compile_layers

    model = CausalLM(TransformerConfig.preset("tiny", norm_first=True))
    assert compile_layers(model) == model.config.n_decoder_layers  # lazy: nothing compiled yet
    assert all(layer._compiled_call_impl is not None for layer in model.decoder.layers)
    assert model._compiled_call_impl is None  # the model's call, and with it the loss, stays eager
    chunked = []
    real = chunked_loss.chunked_cross_entropy
    monkeypatch.setattr(chunked_loss, "chunked_cross_entropy",
                        lambda *a, **k: chunked.append(1) or real(*a, **k))
    for layer in model.decoder.layers:  # stands in for the compiled call (compiling takes long)
        layer._compiled_call_impl = layer._call_impl
    ids = torch.randint(3, 100, (2, 9))
    token_loss(model, ids[:, :-1], ids[:, 1:]).backward()
    assert chunked == [1]
    with pytest.raises(ValueError, match="no encoder/decoder layers"):
        compile_layers(torch.nn.Linear(2, 2))


def test_grad_norm_without_get_total_norm_equals_it(monkeypatch):
    """torch < 2.6 has no nn.utils.get_total_norm: the trainer's global gradient norm (logged
    every step, clipping or not) is then computed directly, to the same value."""
    torch.manual_seed(0)
    parameters = [torch.nn.Parameter(torch.randn(shape)) for shape in ((3, 4), (5,), (2, 2))]
    for parameter in parameters[:2]:  # the last one has no gradient, as a frozen parameter
        parameter.grad = torch.randn_like(parameter)
    expected = torch.cat([p.grad.reshape(-1) for p in parameters[:2]]).square().sum().sqrt()
    if hasattr(torch.nn.utils, "get_total_norm"):
        assert torch.allclose(Parallel.grad_norm(parameters, None), expected, rtol=1e-6, atol=0)
        monkeypatch.delattr(torch.nn.utils, "get_total_norm")
    assert torch.allclose(Parallel.grad_norm(parameters, None), expected, rtol=1e-6, atol=0)
    assert Parallel.grad_norm(parameters[2:], None).item() == 0.0


def test_bad_distributed_option_is_rejected():
    with pytest.raises(ValueError, match="distributed must be one of"):
        TrainingConfig(distributed="zero3")


@pytest.mark.slow
@NEEDS_FSDP2
def test_torchrun_runs_the_train_command(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question. " * 40, encoding="utf-8")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(_free_port()), "-m", "aiayn", "train", "lm",
               "--data", str(text), "--preset", "tiny", "--set", "max_length=16",
               "--batch-size", "2", "--batches-per-epoch", "5", "--steps", "3",
               "--eval-every", "3", "--save-every", "3", "--log-every", "1", "--no-progress",
               "--device", "cpu", "--distributed", "fsdp", "--activation-checkpointing",
               "--out", str(tmp_path / "run")]
    # In a session of its own: a timeout kills torchrun and its workers.
    result = scripts.finish(scripts.start(command[1:], env={**os.environ, "OMP_NUM_THREADS": "1"}),
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1 and json.loads(reports[0])["step"] == 3  # rank 0 reports alone
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-3"]
    assert (tmp_path / "run" / "model.safetensors").is_file()


@NEEDS_FSDP2
def test_fp16_with_a_gradient_scaler_under_fsdp_equals_one_process(tmp_path):
    """fp16 autocast's gradient scaler under FSDP, each rank holding a shard of the gradients:
    step 2's batch 5 (rank 1's alone with 2 processes) overflows, and every rank skips that step
    and halves the scale, as one process does; the run equals one process's."""
    task = {"overflow_batch": 5}
    _single(tmp_path / "single", task=task, accumulation=4, autocast="fp16")
    codes, errors = _launch(tmp_path / "run", config={"accumulation": 2, "distributed": "fsdp",
                                                      "autocast": "fp16"}, task=task)
    assert codes == [0, 0], errors
    _assert_same_run(tmp_path / "run", tmp_path / "single")
    for run_dir in (tmp_path / "run", tmp_path / "single"):
        states = [json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
                  for path in list_checkpoints(run_dir / "checkpoints")]
        assert [state["scaler"]["scale"] for state in states] == [2.0 ** 15] * 2
        assert [state["skipped"] for state in states] == [1, 1]  # that step, counted once
