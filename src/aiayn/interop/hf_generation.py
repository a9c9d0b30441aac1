"""What a Hugging Face checkpoint directory says about generating text, read as ``transformers``
reads it: the end tokens and sampling settings of ``generation_config.json`` (else ``config.json``),
and the chat template of its tokenizer (``chat_template.jinja``, else ``tokenizer_config.json``'s
``chat_template``), rendered in a sandbox because templates come with downloaded files.

``transformers``' ``generate`` stops at every id of ``eos_token_id`` (Llama 3 Instruct lists three,
Qwen2.5 Instruct two: the end of a turn is one of them), picks greedily unless ``do_sample``, and
samples with ``top_k`` 50 unless told otherwise; ``CheckpointGeneration`` holds the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiayn.interop.hf_tokenizer import read_json_object

GENERATION_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
HF_TOP_K = 50  # transformers' GenerationConfig default, used when sampling without a top_k
# Settings of transformers' generate that aiayn's sampler applies (read below)
APPLIED = frozenset({"eos_token_id", "do_sample", "temperature", "top_k", "top_p", "min_p",
                     "repetition_penalty"})
# Settings that do not change which tokens come out (ids named elsewhere, caching, what generate
# returns, speculative decoding), or that aiayn's own options decide (the length: --max-new-tokens)
NO_EFFECT = frozenset({
    "_from_model_config", "transformers_version", "bos_token_id", "pad_token_id",
    "decoder_start_token_id", "use_cache", "cache_implementation", "cache_config", "max_cache_len",
    "compile_config", "disable_compile", "continuous_batching_config", "prefill_chunk_size",
    "output_attentions", "output_hidden_states", "output_logits", "output_scores",
    "return_dict_in_generate", "low_memory", "remove_invalid_values", "renormalize_logits",
    "is_assistant", "assistant_confidence_threshold", "assistant_early_exit",
    "assistant_lookbehind", "num_assistant_tokens", "num_assistant_tokens_schedule",
    "prompt_lookup_num_tokens", "max_matching_ngram_size", "target_lookbehind",
    "speculation_type", "max_length", "max_new_tokens", "max_time"})
# The neutral values of settings aiayn does not apply, where they are not None / False / empty;
# any other setting with another value is named in ``unsupported`` (new ones included)
NEUTRAL = {"no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "typical_p": 1.0,
           "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "num_beams": 1, "num_beam_groups": 1,
           "length_penalty": 1.0, "diversity_penalty": 0.0, "encoder_repetition_penalty": 1.0,
           "min_length": 0, "num_return_sequences": 1, "guidance_scale": 1.0}


@dataclass(frozen=True)
class CheckpointGeneration:
    """A checkpoint's own generation settings.

    Attributes:
        stop_ids: every end-of-sequence id (generation_config.json's ``eos_token_id``, one or many).
        sample: ``do_sample``; False: greedy.
        temperature, top_k, top_p, min_p: the sampling settings (top_p, min_p None: off).
        repetition_penalty: applied greedy or sampled (1: off).
        unsupported: settings that change the tokens and that aiayn does not apply, as
            "name=value" (beams, suppressed or banned tokens, a minimum length, ...).
    """

    stop_ids: tuple[int, ...] = ()
    sample: bool = False
    temperature: float = 1.0
    top_k: int | None = HF_TOP_K
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    unsupported: tuple[str, ...] = ()


def _ids(value: Any) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    return tuple(v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0)


def read_generation_settings(directory: str | Path) -> CheckpointGeneration:
    """The generation settings of a checkpoint directory (defaults where it has none).

    Raises:
        ValueError: generation_config.json is not JSON or holds an impossible value.
    """
    directory = Path(directory)
    path = directory / GENERATION_FILE
    settings = read_json_object(path)
    if not settings:
        path, model = directory / "config.json", read_json_object(directory / "config.json")
        settings = {"eos_token_id": model.get("eos_token_id")}
    temperature = settings.get("temperature", 1.0)
    top_k, top_p = settings.get("top_k", HF_TOP_K), settings.get("top_p", 1.0)
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"{path}: temperature must be a number >= 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"{path}: top_k must be an integer >= 0, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"{path}: top_p must be in (0, 1], got {top_p!r}")
    min_p, penalty = settings.get("min_p"), settings.get("repetition_penalty", 1.0)
    if min_p is not None and not (isinstance(min_p, (int, float)) and 0 <= min_p <= 1):
        raise ValueError(f"{path}: min_p must be in [0, 1], got {min_p!r}")
    penalty = 1.0 if penalty is None else penalty
    if not isinstance(penalty, (int, float)) or penalty <= 0:
        raise ValueError(f"{path}: repetition_penalty must be > 0, got {penalty!r}")
    unsupported = tuple(f"{name}={value!r}" for name, value in settings.items()
                        if name not in APPLIED and name not in NO_EFFECT
                        and value not in (None, False, [], {}, NEUTRAL.get(name)))
    return CheckpointGeneration(
        stop_ids=_ids(settings.get("eos_token_id")), sample=bool(settings.get("do_sample", False)),
        temperature=float(temperature), top_k=top_k or None,  # transformers: 0 turns top-k off
        top_p=None if top_p in (None, 1, 1.0) else float(top_p), min_p=min_p or None,
        repetition_penalty=float(penalty), unsupported=unsupported)


def chat_template(directory: str | Path) -> str | None:
    """The tokenizer's chat template: ``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``chat_template`` (a string, or a list of named templates: the one named "default")."""
    directory = Path(directory)
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        return (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    template = read_json_object(directory / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def require_chat_template(directory: str | Path) -> str:
    """``chat_template(directory)``, or a ValueError saying the tokenizer has none."""
    template = chat_template(directory)
    if template is None:
        raise ValueError(f"{directory}: the tokenizer has no chat template "
                         f"({CHAT_TEMPLATE_FILE} or tokenizer_config.json's chat_template); "
                         f"use --prompt for a model that continues text")
    return template


def render_chat(template: str, messages: list[dict[str, str]], *,
                special_tokens: dict[str, str], add_generation_prompt: bool = True) -> str:
    """The text of a conversation as the checkpoint's template lays it out, with the opening of the
    assistant's turn when ``add_generation_prompt``: what ``transformers``'
    ``apply_chat_template(tokenize=False)`` returns. The template runs in Jinja's immutable sandbox
    with transformers' settings (trim_blocks, lstrip_blocks, loop controls) and helpers
    (``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text).

    Raises:
        ValueError: the template does not parse or raises (``raise_exception``, e.g. for roles it
            does not know).
    """
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    version = tuple(int(part) for part in jinja2.__version__.split(".")[:3] if part.isdigit())
    if version < (3, 1, 6):  # as transformers: older sandboxes have known escapes
        raise ValueError(f"chat templates need jinja2 >= 3.1.6 (older versions have sandbox "
                         f"escapes), found {jinja2.__version__}: pip install -U jinja2")

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    class Generation(jinja2.ext.Extension):
        """transformers' ``{% generation %}...{% endgeneration %}`` marks the assistant's text for
        training masks; rendered, it is its body."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", Generation])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception,
                               strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return environment.from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens)
    except jinja2.exceptions.TemplateError as error:
        raise ValueError(f"the chat template failed: {error}") from None
