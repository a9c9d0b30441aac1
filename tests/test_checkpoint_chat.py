"""``aiayn generate`` on a Hugging Face checkpoint does what ``transformers`` does with it: it stops
at the end-of-sequence ids of ``generation_config.json`` (one or several), takes its sampling settings
unless options override them, and ``--chat`` lays a conversation out with the tokenizer's chat
template exactly as ``apply_chat_template`` does, then prints the reply that ``generate`` + decode
give; ``--chat -`` holds a conversation read from stdin, each turn what ``apply_chat_template`` on
the history so far (earlier replies as assistant messages) + ``generate`` + decode give. Settings
are compared with ``transformers.GenerationConfig``, templates with ``apply_chat_template``,
replies with ``generate`` on the same checkpoint (tests/checkpoint_builders.py)."""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

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
                          repetition_penalty=1.05, no_repeat_ngram_size=3,
                          suppress_tokens=[5], min_new_tokens=6, bad_words_ids=[[3]],
                          max_length=4096, num_beams=1, pad_token_id=0, output_scores=True)
    ours = read_generation_settings(directory)
    theirs = transformers.GenerationConfig.from_pretrained(directory)
    assert ours.stop_ids == tuple(theirs.eos_token_id) == (5, 7, 9)
    fields = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
    assert [getattr(ours, name) for name in fields] == [getattr(theirs, name) for name in fields] \
        == [0.7, 20, 0.8, 0.05, 1.05]
    assert ours.sample == theirs.do_sample is True
    # named: what changes the tokens and aiayn does not apply, whatever transformers calls it;
    # not: the applied settings, neutral values, the length (--max-new-tokens's) and how
    # generate returns its output
    assert set(ours.unsupported) == {"no_repeat_ngram_size=3", "suppress_tokens=[5]",
                                     "min_new_tokens=6", "bad_words_ids=[[3]]"}
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


# --chat -: a conversation read from stdin, each turn compared with transformers on the history

def converse_cli(monkeypatch, capsys, directory, stdin: str | io.StringIO, *options: str
                 ) -> tuple[int, str, str]:
    """``aiayn generate DIR --chat - OPTIONS`` in this process, ``stdin`` as its standard input:
    (exit code, stdout, stderr)."""
    from aiayn.cli import main

    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin) if isinstance(stdin, str) else stdin)
    capsys.readouterr()  # what came before (transformers' progress bars)
    code = main(["generate", str(directory), "--chat", "-", *options, "--threads", "1"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


class HFChat:
    """transformers' side of a conversation: ``apply_chat_template(history,
    add_generation_prompt=True)``, ``generate`` with the checkpoint's generation config (greedy
    here), ``decode(skip_special_tokens=True)`` of the new tokens without the end token that
    stopped them; each reply joins the history as an assistant message."""

    def __init__(self, directory):
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        end_ids = self.model.generation_config.eos_token_id
        self.end_ids = set(end_ids if isinstance(end_ids, list) else [end_ids])

    def ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def reply(self, ids: list[int], new_tokens: int) -> tuple[list[int], str]:
        prompt = torch.tensor([ids])
        with torch.no_grad():
            out = self.model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                      max_new_tokens=new_tokens)
        new = out[0, len(ids):].tolist()
        shown = new[:-1] if new and new[-1] in self.end_ids else new
        return new, self.tokenizer.decode(shown, skip_special_tokens=True)

    def converse(self, messages: list[str], new_tokens: int, *, system: str | None = None
                 ) -> list[tuple[list[int], list[int], str]]:
        """Per message: (prompt ids, new ids, reply text)."""
        history = [{"role": "system", "content": system}] if system else []
        turns = []
        for message in messages:
            history.append({"role": "user", "content": message})
            ids = self.ids(history)
            new, reply = self.reply(ids, new_tokens)
            turns.append((ids, new, reply))
            history.append({"role": "assistant", "content": reply})
        return turns


def with_settings(directory, copy, *, positions: int | None = None, **generation) -> str:
    """A copy of a checkpoint with ``positions`` as its context (config.json's
    max_position_embeddings: the Qwen3 RoPE does not depend on it, so transformers' outputs stay
    the same) and generation_config.json settings changed."""
    shutil.copytree(directory, copy)
    for name, changes in (("config.json", {"max_position_embeddings": positions}),
                          ("generation_config.json", generation)):
        changes = {key: value for key, value in changes.items() if value is not None}
        settings = json.loads((copy / name).read_text())
        (copy / name).write_text(json.dumps({**settings, **changes}))
    return str(copy)


MESSAGES = ["Who art thou?", "Speak, I pray thee.", "What news from Verona?"]


@pytest.fixture(scope="module")
def qwen_long(qwen, tmp_path_factory):
    """The Qwen-style checkpoint with a context of 256 (its own 64 holds one turn): three turns
    fit, so no reply slides."""
    return with_settings(qwen, tmp_path_factory.mktemp("long") / "qwen3", positions=256)


def test_a_conversation_answers_turn_by_turn_as_transformers(qwen_long, monkeypatch, capsys,
                                                             tmp_path):
    # A second end id that stops the second reply part-way (not in the first, so the first turn
    # is the same): one turn ends at an end id, the other at --max-new-tokens.
    plain = HFChat(qwen_long).converse(MESSAGES[:2], 16)
    first, second = plain[0][1], plain[1][1]
    stop = next(token for index, token in enumerate(second)
                if index and token not in first and token not in second[:index])
    eos = json.loads((Path(qwen_long) / "config.json").read_text())["eos_token_id"]
    directory = with_settings(qwen_long, tmp_path / "stops", eos_token_id=[eos, stop])
    turns = HFChat(directory).converse(MESSAGES, 16)
    assert len(turns[0][1]) == 16 and turns[1][1][-1] == stop and len(turns[1][1]) < 16
    assert all(len(ids) + 16 <= 256 for ids, _, _ in turns)  # no reply slides
    want = "".join(reply + "\n" for _, _, reply in turns)
    stdin = f"{MESSAGES[0]}\n\n   \n{MESSAGES[1]}\n  {MESSAGES[2]}  \n"  # blank lines skipped
    for stream in ([], ["--no-stream"]):
        code, out, err = converse_cli(monkeypatch, capsys, directory, stdin,
                                      "--max-new-tokens", "16", *stream)
        assert code == 0, err  # the end of stdin ends the conversation
        assert out == want
        assert "> " not in err  # no prompt marker when stdin is not a terminal


def test_a_conversation_with_a_sentencepiece_tokenizer_answers_as_transformers(
        tmp_path, monkeypatch, capsys):
    """A Llama-style tokenizer (Metaspace, byte fallback): a reply is decoded alone, as
    transformers decodes the new tokens, so a first token "▁..." gives no leading space."""
    from aiayn.cli import main

    directory = builders.llama(tmp_path / "llama")
    (directory / "chat_template.jinja").write_text(LLAMA3_STYLE)
    directory = with_settings(directory, tmp_path / "llama-long", positions=512)
    hf = HFChat(directory)
    turns = hf.converse(MESSAGES[:2], 10)
    assert any(hf.tokenizer.convert_ids_to_tokens(new[0]).startswith("\u2581")
               for _, new, _ in turns)
    assert all(len(ids) + 10 <= 512 for ids, _, _ in turns)
    code, out, err = converse_cli(monkeypatch, capsys, directory, "\n".join(MESSAGES[:2]),
                                  "--max-new-tokens", "10")
    assert code == 0, err
    assert out == "".join(reply + "\n" for _, _, reply in turns)
    fresh = hf.converse(MESSAGES[1:2], 10)[0][2]
    assert main(["generate", directory, "--chat", MESSAGES[1], "--max-new-tokens", "10",
                 "--threads", "1"]) == 0
    assert capsys.readouterr().out == fresh + "\n"


def test_stop_strings_cut_each_reply_and_the_history_holds_it_cut(qwen_long, monkeypatch,
                                                                   capsys):
    hf = HFChat(qwen_long)
    full = hf.converse(MESSAGES[:1], 16)[0][2]
    stop = full[len(full) // 2:len(full) // 2 + 2]

    def cut(text: str) -> str:  # greedy: the tokens before a stop string are the same
        return text[:text.index(stop)] if stop in text else text

    history, want = [], []
    for message in MESSAGES[:2]:
        history.append({"role": "user", "content": message})
        want.append(cut(hf.reply(hf.ids(history), 16)[1]))
        history.append({"role": "assistant", "content": want[-1]})
    assert want[0] and want[0] != full
    code, out, err = converse_cli(monkeypatch, capsys, qwen_long, "\n".join(MESSAGES[:2]),
                                  "--max-new-tokens", "16", "--stop", stop)
    assert code == 0, err
    assert out == f"{want[0]}\n{want[1]}\n"


def test_reset_starts_over_with_the_system_message(qwen_long, monkeypatch, capsys):
    system = "You speak like Shakespeare."
    hf = HFChat(qwen_long)
    first = hf.converse(MESSAGES[:1], 12, system=system)[0][2]
    fresh = hf.converse(MESSAGES[1:2], 12, system=system)[0][2]
    continued = hf.converse(MESSAGES[:2], 12, system=system)[1][2]
    assert fresh != continued  # the test tells the two apart
    options = ["--system", system, "--max-new-tokens", "12"]
    code, out, err = converse_cli(monkeypatch, capsys, qwen_long,
                                  f"{MESSAGES[0]}\n/reset\n{MESSAGES[1]}\n", *options)
    assert code == 0, err
    assert out == f"{first}\n{fresh}\n"
    from aiayn.cli import main

    assert main(["generate", qwen_long, "--chat", MESSAGES[1], *options, "--threads", "1"]) == 0
    assert capsys.readouterr().out == f"{fresh}\n"  # a single --chat gives the same reply


def test_exit_ends_the_conversation_and_a_terminal_gets_a_prompt(qwen_long, monkeypatch, capsys):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    reply = HFChat(qwen_long).converse(MESSAGES[:1], 8)[0][2]
    stdin = Terminal(f"{MESSAGES[0]}\n/exit\n{MESSAGES[1]}\n")
    code, out, err = converse_cli(monkeypatch, capsys, qwen_long, stdin, "--max-new-tokens", "8")
    assert code == 0, err
    assert out == reply + "\n"  # stdout holds the replies alone
    assert err == "> > "  # asked for two lines on stderr: the message, then /exit
    assert stdin.read() == f"{MESSAGES[1]}\n"  # nothing read past /exit
    code, out, err = converse_cli(monkeypatch, capsys, qwen_long, Terminal(""))
    assert (code, out, err) == (0, "", "> \n")  # the end of stdin ends it on a new line


def test_old_turns_are_dropped_when_the_conversation_outgrows_the_context(
        qwen, monkeypatch, capsys, tmp_path):
    messages = ["Who art thou?", "Good.",
                "And what news from fair Verona, where we lay our scene of old?"]
    new_tokens = 4
    hf = HFChat(qwen)
    turns = hf.converse(messages, new_tokens)
    replies = [reply for _, _, reply in turns]
    # the third turn without the first: user 2, reply 2, user 3 (the template's default system)
    history = [{"role": "user", "content": messages[1]},
               {"role": "assistant", "content": replies[1]},
               {"role": "user", "content": messages[2]}]
    kept = hf.ids(history)
    context = len(kept) + new_tokens  # a context the truncated conversation fits, unslid
    assert len(turns[2][0]) > context  # the whole one does not
    assert all(len(ids) + new_tokens <= context for ids, _, _ in turns[:2])
    truncated_reply = hf.reply(kept, new_tokens)[1]
    directory = with_settings(qwen, tmp_path / "short", positions=context)
    code, out, err = converse_cli(monkeypatch, capsys, directory, "\n".join(messages) + "\n",
                                  "--max-new-tokens", str(new_tokens))
    assert code == 0, err
    assert out == f"{replies[0]}\n{replies[1]}\n{truncated_reply}\n"
    assert err == (f"aiayn generate: warning: the conversation has {len(turns[2][0])} tokens, "
                   f"more than the context of {context} allows; dropped its 1 oldest turn\n")


def test_a_message_longer_than_the_context_keeps_its_last_tokens(qwen, monkeypatch, capsys):
    message = " ".join(["Speak, speak."] * 30)
    hf = HFChat(qwen)
    ids = hf.ids([{"role": "user", "content": message}])
    assert len(ids) > 64
    reply = hf.reply(ids[-64:], 1)[1]  # one new token: no position past the 64 of the model
    code, out, err = converse_cli(monkeypatch, capsys, qwen, message + "\n", "--max-new-tokens",
                                  "1")
    assert code == 0, err
    assert out == reply + "\n"
    assert f"the message has {len(ids)} tokens with the chat template, more than the context " \
           f"of 64 allows; keeping its last 64" in err


def test_a_seed_makes_a_sampled_conversation_reproducible(qwen_long, monkeypatch, capsys):
    """--seed seeds one random stream at the start: the first reply is a single --chat's with the
    same seed, the same stdin gives the same replies, and a repeated message after /reset draws
    further from the stream (it is not reseeded per turn)."""
    from aiayn.cli import main

    options = ["--temperature", "1", "--seed", "7", "--max-new-tokens", "12"]
    stdin = f"{MESSAGES[0]}\n{MESSAGES[1]}\n/reset\n{MESSAGES[0]}\n"
    runs = [converse_cli(monkeypatch, capsys, qwen_long, stdin, *options) for _ in range(2)]
    assert runs[0] == runs[1] and runs[0][0] == 0
    assert main(["generate", qwen_long, "--chat", MESSAGES[0], *options, "--threads", "1"]) == 0
    single = capsys.readouterr().out  # the reply and its newline (sampled replies hold newlines
    out = runs[0][1]                  # too, so stdout is not split into replies here)
    assert out.startswith(single) and out.count("\n") > 3 * single.count("\n")
    assert not out.endswith("\n" + single)  # reseeded per turn, the third reply would be the first


def test_each_turn_keeps_the_cached_turns_before_and_replies_as_a_full_prefill(
        qwen_long, monkeypatch, capsys, kept_positions):
    """The prefix cache (the default): each turn after the first keeps the positions the ids of
    the conversation share with the turn before, and prints what --no-prefix-cache (every turn
    prefilled whole) and transformers print, greedy and sampled with a seed."""
    kept = kept_positions
    turns = HFChat(qwen_long).converse(MESSAGES, 12, system="Be brief.")
    stdin = "\n".join(MESSAGES) + "\n"
    for options, want in ((["--max-new-tokens", "12"], "".join(r + "\n" for *_, r in turns)),
                          (["--max-new-tokens", "12", "--temperature", "1", "--seed", "3"], None)):
        kept.clear()
        runs = [converse_cli(monkeypatch, capsys, qwen_long, stdin, "--system", "Be brief.",
                             *options, *extra) for extra in ([], ["--no-prefix-cache"])]
        assert runs[0] == runs[1] and runs[0][0] == 0
        assert want is None or runs[0][1] == want
        assert len(kept) == 3 and kept[0] == 0  # --no-prefix-cache makes no PrefixCache
        # the previous turn's prompt is kept, and its reply up to where the template's
        # re-encoding differs (greedy: the prompts are transformers')
        first, second = (len(prompt) for prompt, _, _ in turns[:2])
        assert kept[1] >= first and kept[2] >= (second if want else first)


def test_conversation_turns_drop_oldest_first_never_the_system_message():
    from aiayn.commands.chat_loop import Conversation, fit

    conversation = Conversation("sys")
    conversation.turns = [("u1", "a1"), ("u2", "a2"), ("u3", "a3")]

    def encode(messages):  # one id per character of the contents
        return [ord(c) for message in messages for c in message["content"]]

    assert fit(conversation, "now", encode, context=3 + 4 + 3) == list(b"sysu3a3now")
    assert conversation.turns == [("u3", "a3")]  # the two dropped turns stay dropped
    conversation.turns.clear()
    assert fit(conversation, "long message", encode, context=5) == list(b"ssage")


@pytest.fixture(scope="module")
def run_from_scratch(tmp_path_factory):
    from aiayn.cli import main

    out = tmp_path_factory.mktemp("scratch") / "run"
    assert main(["train", "lm", "--data", str(builders.DATA / "shakespeare_tiny.txt.gz"),
                 "--out", str(out), "--preset", "baby-gpt", "--set", "d_model=32", "--set",
                 "n_heads=2", "--set", "d_ff=64", "--set", "n_decoder_layers=1",
                 "--block-size", "16", "--batch-size", "4", "--steps", "1", "--eval-every", "0",
                 "--no-progress", "--threads", "1"]) == 0
    return out


@pytest.mark.parametrize("case, options, message", [
    ("qwen", ["--prompt", "x"], "give --prompt .* or --chat .*, not both"),
    ("qwen", ["--system", ""], "must not be empty"),
    ("no template", [], "the tokenizer has no chat template"),
    ("scratch", [], "--chat needs a Hugging Face tokenizer with a chat template; this run's "
                    "vocabulary has none"),
])
def test_bad_conversation_requests_fail_before_the_model_loads(
        qwen, run_from_scratch, monkeypatch, capsys, tmp_path, case, options, message):
    import aiayn.tasks.checkpoints

    directory = {"qwen": qwen, "scratch": run_from_scratch}.get(case)
    if case == "no template":
        directory = tmp_path / "plain"
        shutil.copytree(qwen, directory)
        (directory / "chat_template.jinja").unlink()

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(aiayn.tasks.checkpoints, "load_model_dir", no_loading)
    code, out, err = converse_cli(monkeypatch, capsys, directory, "hello\n", *options)
    assert code == 1 and out == ""
    assert re.search(message, err), err
