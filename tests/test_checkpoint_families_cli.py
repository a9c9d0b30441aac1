"""The commands on T5, Llama and Qwen3 checkpoint directories print what ``transformers`` computes with
the same checkpoint and its own tokenizer (small checkpoints built offline:
tests/checkpoint_builders.py):
``aiayn translate`` = ``T5ForConditionalGeneration.generate`` + decode (greedy and beam), ``aiayn
generate`` = ``LlamaForCausalLM.generate(do_sample=False)`` + decode; ``evaluate`` and ``attention``
run on both."""

import json
import subprocess
import sys

import pytest
import torch

import checkpoint_builders as builders
from hf_helpers import needs_transformers_5
from aiayn.cli import main

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.usefixtures("one_thread"), needs_transformers_5(
    "the test checkpoints' tokenizers are built with transformers 5's T5Tokenizer and "
    "LlamaTokenizer(vocab=...) constructors")]

SOURCES = [en for en, _ in builders.pairs(12)]
PROMPTS = ["ROMEO:", "What light", "the king", "First Citizen:\nBefore we proceed", "O"]
MAX_EXTRA = 50  # aiayn translate: source length + 50 positions, </s> forced at the last


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {"t5": builders.t5(root / "t5"), "llama": builders.llama(root / "llama"),
            "qwen3": builders.qwen3(root / "qwen3"), "gemma3": builders.gemma3(root / "gemma3"),
            "gemma2": builders.gemma2(root / "gemma2"), "phi3": builders.phi3(root / "phi3")}


def run_cli(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiayn", *args], capture_output=True,
                          input=stdin.encode() if stdin is not None else None, check=False)


def aiayn_generate(capsys, directory, *args) -> str:
    """What ``aiayn generate DIRECTORY ARGS`` prints, run in this process (a subprocess per call
    spends seconds importing; tests/test_lm.py streams through the real command)."""
    capsys.readouterr()
    assert main(["generate", str(directory), *args]) == 0
    return capsys.readouterr().out


def hf_translations(directory, sentences, *, beams: int):
    """``T5ForConditionalGeneration.generate`` + decode(skip_special_tokens=True), with aiayn's
    limits (padding never generated, </s> forced at the last position) and its beam scores
    without a length penalty (``--alpha 0``); also whether each output ran into the limit."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(directory).eval()
    config = model.config
    assert config.decoder_start_token_id == config.pad_token_id == 0  # T5 starts from <pad>
    outputs = []
    for sentence in sentences:
        ids = torch.tensor([tokenizer(sentence)["input_ids"]])
        assert ids[0, -1] == config.eos_token_id  # T5's tokenizer appends </s>
        with torch.no_grad():
            generated = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=beams,
                length_penalty=0.0, early_stopping=True, max_new_tokens=ids.shape[1] + MAX_EXTRA,
                min_new_tokens=0, forced_eos_token_id=config.eos_token_id,
                bad_words_ids=[[config.pad_token_id]], no_repeat_ngram_size=0,
                repetition_penalty=1.0)
        limit = generated.shape[1] >= ids.shape[1] + MAX_EXTRA + 1  # start + tokens + forced </s>
        outputs.append((tokenizer.decode(generated[0], skip_special_tokens=True), limit))
    return outputs


@pytest.mark.parametrize("beams", [1, 4])
def test_translate_on_t5_prints_what_transformers_generate_and_decode_print(checkpoints, beams):
    result = run_cli("translate", str(checkpoints["t5"]), "--beam", str(beams), "--alpha", "0",
                     "--threads", "1", stdin="".join(s + "\n" for s in SOURCES))
    assert result.returncode == 0, result.stderr.decode()
    printed = result.stdout.decode().splitlines()
    expected = hf_translations(checkpoints["t5"], SOURCES, beams=beams)
    assert len(printed) == len(SOURCES)
    # At the length limit HF scores the forced </s> with log-probability 0, aiayn with its own
    # (tests/test_hf_beam.py): beam hypotheses that reach it are left out; greedy has no scores.
    compared = [(ours, theirs) for ours, (theirs, limit) in zip(printed, expected)
                if beams == 1 or not limit]
    assert len(compared) >= 10
    assert [ours for ours, _ in compared] == [theirs for _, theirs in compared]
    assert sum(bool(ours) for ours, _ in compared) >= 10  # outputs, not empty lines


def test_evaluate_scores_a_t5_checkpoint(checkpoints, tmp_path, capsys):
    data = tmp_path / "pairs.tsv"
    data.write_text("".join(f"{en}\t{de}\n" for en, de in builders.pairs(5)), encoding="utf-8")
    assert main(["evaluate", str(checkpoints["t5"]), "--data", str(data), "--beam", "1",
                 "--output", str(tmp_path / "out.txt")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["sentences"] == 5 and result["bleu"] >= 0.0
    written = (tmp_path / "out.txt").read_text(encoding="utf-8").splitlines()
    sources = [en for en, _ in builders.pairs(5)]
    assert written == [text for text, _ in hf_translations(checkpoints["t5"], sources, beams=1)]


def hf_continuation(directory, prompt, *, new_tokens):
    """``LlamaForCausalLM.generate`` (greedy) + the tokenizer's decode of the whole sequence."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    assert ids[0, 0] == tokenizer.bos_token_id == 1  # Llama's tokenizer adds <s>
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   num_beams=1, max_new_tokens=new_tokens, min_new_tokens=0,
                                   pad_token_id=model.config.eos_token_id)
    return tokenizer.decode(generated[0], skip_special_tokens=True)


@pytest.mark.parametrize("family", ["llama", "gemma3", "gemma2", "phi3"])
def test_generate_on_llama_prints_what_transformers_generate_and_decode_print(checkpoints, family,
                                                                             capsys):
    """Covers the two ways a SentencePiece-style decoder differs from decoding the continuation
    alone: the space before a first "▁word" token (prompt "O") and byte-fallback runs that
    become U+FFFD only once complete (streamed output). Gemma 3 with the same tokenizer: sandwich
    norms, QK-norm, a sliding window, read from its files; Gemma 2: soft-capped scores and
    logits; Phi-3: fused projections split on load, a window on every layer."""
    directory = checkpoints[family]
    spaced = bytes_ = 0
    for prompt in PROMPTS:
        expected = hf_continuation(directory, prompt, new_tokens=12)
        assert expected.startswith(prompt)  # the prompts round-trip through the tokenizer
        spaced += expected[len(prompt):].startswith(" ")
        bytes_ += "\ufffd" in expected
        for stream in ([], ["--no-stream"]):
            printed = aiayn_generate(capsys, directory, "--prompt", prompt, "--greedy",
                                     "--max-new-tokens", "12", "--threads", "1", *stream)
            assert printed == expected + "\n", (prompt, stream)
    assert spaced and bytes_  # both cases were exercised


def test_generate_on_llama_batches_prompts_like_one_at_a_time(checkpoints, capsys):
    directory = checkpoints["llama"]
    prompts = [a for p in PROMPTS[:3] for a in ("--prompt", p)]
    printed = aiayn_generate(capsys, directory, *prompts, "--greedy", "--max-new-tokens", "12",
                             "--threads", "1")
    expected = "".join(f"=== {p!r}\n" + hf_continuation(directory, p, new_tokens=12) + "\n"
                       for p in PROMPTS[:3])
    assert printed == expected


def test_generate_on_qwen3_prints_what_transformers_generate_and_decode_print(checkpoints, capsys):
    """A byte-level tokenizer that adds no BOS, QK-norm and a tied head: the prompt's ids alone."""
    directory = checkpoints["qwen3"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    for prompt in PROMPTS[:4]:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        assert tokenizer.decode(ids[0]) == prompt  # nothing added in front
        with torch.no_grad():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       num_beams=1, max_new_tokens=12, min_new_tokens=0,
                                       pad_token_id=model.config.eos_token_id)
        expected = tokenizer.decode(generated[0], skip_special_tokens=True)
        printed = aiayn_generate(capsys, directory, "--prompt", prompt, "--greedy",
                                 "--max-new-tokens", "12", "--threads", "1")
        assert printed == expected + "\n", prompt


def test_evaluate_a_llama_checkpoint(checkpoints, tmp_path, capsys):
    path = tmp_path / "text.txt"
    path.write_text(builders.shakespeare(2000), encoding="utf-8")
    assert main(["evaluate", str(checkpoints["llama"]), "--data", str(path), "--split", "all"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tokens"] > 0 and result["loss"] > 0


@pytest.mark.parametrize("family, text", [("t5", SOURCES[0]), ("llama", PROMPTS[3])])
def test_attention_on_t5_and_llama_checkpoints(checkpoints, family, text, tmp_path):
    out = tmp_path / family
    result = run_cli("attention", str(checkpoints[family]), "--text", text, "--out", str(out),
                     "--dpi", "40")
    assert result.returncode == 0, result.stderr.decode()
    assert "the checkpoint's tokenizer" in result.stdout.decode()
    assert (out / "metrics.json").is_file()
