"""``aiayn generate`` on a Hugging Face checkpoint does what ``transformers`` does with it: it stops
at the end-of-sequence ids of ``generation_config.json`` (one or several), takes its sampling settings
unless options override them, and ``--chat`` lays a conversation out with the tokenizer's chat
template exactly as ``apply_chat_template`` does, then prints the reply that ``generate`` + decode
give. Settings are compared with ``transformers.GenerationConfig``, templates with
``apply_chat_template``, replies with ``generate`` on the same checkpoint
(tests/checkpoint_builders.py)."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

import checkpoint_builders as builders
from aiayn.commands.generate import generation_config
from aiayn.interop.hf_generation import (CheckpointGeneration, chat_template,
                                         read_generation_settings, render_chat)
from aiayn.tasks.checkpoints import load_model_dir
from hf_helpers import needs_transformers_5

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.usefixtures("one_thread"), needs_transformers_5(
    "the test checkpoints' tokenizers are built with transformers 5's constructors")]

PROMPT = "ROMEO:"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return builders.qwen3(tmp_path_factory.mktemp("qwen") / "qwen3")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiayn", "generate", *args, "--threads", "1"],
                          capture_output=True, timeout=300)


def hf_reply(directory, ids: list[int], new_tokens: int = 20) -> tuple[list[int], str]:
    """``generate`` with the checkpoint's own generation config (greedy here) + decode."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=new_tokens)
    new = out[0, len(ids):].tolist()
    return new, tokenizer.decode(new, skip_special_tokens=True)


def copy_with(directory, tmp_path, **generation) -> str:
    copy = tmp_path / "checkpoint"
    shutil.copytree(directory, copy)
    settings = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**settings, **generation}))
    return str(copy)


def test_generation_settings_read_as_transformers_reads_them(qwen, tmp_path):
    directory = copy_with(qwen, tmp_path, eos_token_id=[5, 7, 9], do_sample=True,
                          temperature=0.7, top_k=20, top_p=0.8, min_p=0.05,
                          repetition_penalty=1.05, no_repeat_ngram_size=3)
    ours = read_generation_settings(directory)
    theirs = transformers.GenerationConfig.from_pretrained(directory)
    assert ours.stop_ids == tuple(theirs.eos_token_id) == (5, 7, 9)
    fields = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
    assert [getattr(ours, name) for name in fields] == [getattr(theirs, name) for name in fields] \
        == [0.7, 20, 0.8, 0.05, 1.05]
    assert ours.sample == theirs.do_sample is True
    assert ours.unsupported == ("no_repeat_ngram_size=3",)
    (tmp_path / "checkpoint" / "generation_config.json").unlink()  # then config.json's eos
    plain = read_generation_settings(directory)
    eos = json.loads((qwen / "config.json").read_text())["eos_token_id"]
    assert plain == CheckpointGeneration(stop_ids=(eos,), sample=False, top_k=50)
    # what sampling falls back to: transformers 5 fills unset fields from these defaults
    assert transformers.GenerationConfig._get_default_generation_params()["top_k"] == 50


def test_options_override_the_checkpoints_settings_one_by_one():
    own = CheckpointGeneration(stop_ids=(2, 3), sample=False, temperature=0.7, top_k=20,
                               top_p=0.8, min_p=0.05, repetition_penalty=1.05)
    defaults = dict(temperature=None, top_k=None, top_p=None, min_p=None, repetition_penalty=None,
                    greedy=False, ignore_eos=False, max_new_tokens=10, seed=None, no_slide=False)

    def config(checkpoint=own, **options):
        return generation_config(argparse.Namespace(**{**defaults, **options}), checkpoint)

    greedy = config()  # not do_sample: greedy, with the checkpoint's penalty and end ids
    assert greedy.picks_greedily and greedy.stop_ids == (2, 3)
    assert greedy.repetition_penalty == 1.05
    sampled = config(temperature=0.9)  # an option asks for sampling; the rest are the checkpoint's
    assert not sampled.picks_greedily
    assert (sampled.temperature, sampled.top_k, sampled.top_p, sampled.min_p) == \
        (0.9, 20, 0.8, 0.05)
    assert config(repetition_penalty=1.0).repetition_penalty == 1.0
    assert config(ignore_eos=True).stop_ids == ()
    assert config(top_k=5, greedy=True).picks_greedily
    run = config(None)  # a run of aiayn train lm: sampling at 1 from every token, no end id
    assert (run.picks_greedily, run.temperature, run.top_k, run.stop_ids) == (False, 1.0, None, ())
    assert (run.min_p, run.repetition_penalty) == (None, 1.0)


def test_generate_stops_where_transformers_stops_at_any_end_id(qwen, tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen)
    ids = tokenizer(PROMPT)["input_ids"]
    long_ids, long_text = hf_reply(qwen, ids)
    assert len(long_ids) == 20  # no end id on the way: the stop below is what ends it
    eos = json.loads((qwen / "config.json").read_text())["eos_token_id"]
    stop = long_ids[6]
    directory = copy_with(qwen, tmp_path, eos_token_id=[eos, stop])
    short_ids, _ = hf_reply(directory, ids)
    assert short_ids[-1] == stop and len(short_ids) <= 7
    # the end token is not printed (a real one, special, decodes to nothing in transformers too)
    short_text = tokenizer.decode(short_ids[:-1], skip_special_tokens=True)
    for stream in ([], ["--no-stream"]):
        result = run_cli(directory, "--prompt", PROMPT, "--max-new-tokens", "20", *stream)
        assert result.returncode == 0, result.stderr.decode()
        assert result.stdout.decode() == PROMPT + short_text + "\n"
    result = run_cli(directory, "--prompt", PROMPT, "--max-new-tokens", "20", "--ignore-eos")
    assert result.stdout.decode() == PROMPT + long_text + "\n"


LLAMA3_STYLE = (  # a Llama 3 style template, written here: bos_token, headers, trim, strftime_now
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if loop.first and message['role'] == 'system' %}Year: {{ strftime_now('%Y') }}\n{% endif %}"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
TOJSON_STYLE = (  # tojson keeps non-ASCII text; {% generation %} marks assistant text
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] | tojson }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}"
    "{% endgeneration %}{% endif %}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
CONVERSATION = [{"role": "system", "content": "  Be brief.  "},
                {"role": "user", "content": "Wer bist du? Ça va?"},
                {"role": "assistant", "content": "Ich bin's."},
                {"role": "user", "content": "Und jetzt?"}]


@pytest.mark.parametrize("template", [builders.CHATML, LLAMA3_STYLE, TOJSON_STYLE],
                         ids=["chatml", "llama3-style", "tojson-generation"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_chat_templates_render_and_encode_as_apply_chat_template(template, family, tmp_path):
    directory = getattr(builders, family)(tmp_path / family)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    ours = load_model_dir(directory, task="lm").assets
    specials = {name: ours.tokenizer.id_to_token(index)
                for name, index in ours.tokenizer.special_ids.items()}
    for messages in (CONVERSATION, CONVERSATION[1:2]):
        want = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
        assert render_chat(template, messages, special_tokens=specials) == want
    (directory / "chat_template.jinja").write_text(template)
    want_ids = tokenizer(tokenizer.apply_chat_template(CONVERSATION, chat_template=template,
                                                       tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
    assert ours.encode_chat(CONVERSATION) == want_ids
    if family == "llama" and "bos_token" in template:  # the template wrote <s>, once
        assert want_ids[0] == tokenizer.bos_token_id and want_ids[1] != tokenizer.bos_token_id


def test_the_template_is_found_in_tokenizer_config_too(qwen, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(qwen, copy)
    template = (copy / "chat_template.jinja").read_text()
    (copy / "chat_template.jinja").unlink()
    settings = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": [
        {"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]}))
    assert chat_template(copy) == template


@pytest.mark.parametrize("system", [None, "You speak like Shakespeare."])
def test_chat_prints_the_reply_transformers_gives(qwen, system):
    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen)
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": "Who art thou?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    new_tokens = 64 - len(ids)  # up to the model's 64 positions, where aiayn's cache would slide
    assert new_tokens >= 10
    _, reply = hf_reply(qwen, ids, new_tokens)
    options = ["--system", system] if system else []
    for stream in ([], ["--no-stream"]):
        result = run_cli(str(qwen), "--chat", "Who art thou?", *options, "--max-new-tokens",
                         str(new_tokens), *stream)
        assert result.returncode == 0, result.stderr.decode()
        assert result.stdout.decode() == reply + "\n"


@pytest.mark.parametrize("args, message", [
    (["--chat", "hi", "--prompt", "x"], "give --prompt .* or --chat .*, not both"),
    (["--system", "be brief"], "--system goes with --chat"),
    (["--chat", ""], "must not be empty"),
    (["--chat", "hi", "--system", "s"], None),  # the template's raise_exception (below)
])
def test_bad_chat_requests_get_clear_errors(qwen, tmp_path, args, message):
    directory = qwen
    if message is None:  # a template that refuses system messages
        directory = tmp_path / "refusing"
        shutil.copytree(qwen, directory)
        (directory / "chat_template.jinja").write_text(
            "{% for m in messages %}{% if m.role == 'system' %}"
            "{{ raise_exception('System role not supported') }}{% endif %}{% endfor %}")
        message = "the chat template failed: System role not supported"
    result = run_cli(str(directory), *args)
    assert result.returncode != 0
    assert re.search(message, result.stderr.decode()), result.stderr.decode()


def test_chat_without_a_template_says_so(qwen, tmp_path):
    directory = tmp_path / "plain"
    shutil.copytree(qwen, directory)
    (directory / "chat_template.jinja").unlink()
    result = run_cli(str(directory), "--chat", "hi")
    assert result.returncode != 0
    assert "the tokenizer has no chat template" in result.stderr.decode()


def test_a_run_fine_tuned_from_a_checkpoint_keeps_its_generation_settings(qwen, tmp_path):
    """``aiayn train lm --init`` copies generation_config.json with the tokenizer: the run decodes
    greedily (the checkpoint's setting) and stops at the checkpoint's end ids."""
    from aiayn.cli import main
    from aiayn.decoding.generation import generate

    run_dir = tmp_path / "run"
    data = builders.DATA / "shakespeare_tiny.txt.gz"
    assert main(["train", "lm", "--init", str(qwen), "--data", str(data), "--out", str(run_dir),
                 "--steps", "2", "--eval-every", "0", "--block-size", "32", "--batch-size", "2",
                 "--no-progress", "--threads", "1"]) == 0
    settings = run_dir / "pretrained_tokenizer" / "generation_config.json"
    assert settings.is_file()
    run = load_model_dir(run_dir, task="lm")
    ids = run.assets.encode(PROMPT)
    free = generate(run.model, [ids], max_new_tokens=20, greedy=True).tokens[0]
    stop = free[4]
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "eos_token_id": [stop]}))
    cut = free[:free.index(stop)]
    for stream in ([], ["--no-stream"]):
        result = run_cli(str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "20", *stream)
        assert result.returncode == 0, result.stderr.decode()
        assert result.stdout.decode() == run.assets.decode(ids + cut) + "\n"
