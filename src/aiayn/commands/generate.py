"""``aiayn generate RUN_DIR --prompt TEXT``: continue a prompt with a trained language model (a run
of ``aiayn train lm`` or a Hugging Face GPT-2 / Llama / Mistral / Qwen / Gemma 3 checkpoint
directory, with its tokenizer); ``--chat TEXT`` answers a message through the checkpoint's chat
template instead.

A checkpoint directory generates as ``transformers``' ``generate`` does with it: it stops at its
end-of-sequence ids and picks tokens by its ``generation_config.json`` (greedy unless
``do_sample``; then its temperature, top-k, top-p and min-p; its repetition penalty either way),
each overridden by the option given.

Tokens stream to stdout as they are produced (one prompt), or each continuation is printed once done
(several prompts, generated together as one left-padded batch). A prompt longer than the model's
context keeps its last ``context`` tokens, with a warning on stderr. Past the context the
cache slides (rebuilt from the last half of the context, like nanoGPT's sampler cropping its input)
unless ``--no-slide`` makes that an error.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from aiayn.commands import engine
from aiayn.commands.train import device_name, positive_int

if TYPE_CHECKING:
    from aiayn.decoding.generation import GenerationConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text from a trained language model (aiayn train lm)",
        description="Continue a prompt with the model of RUN_DIR; tokens stream to stdout.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory ('aiayn train lm') or "
                        "a Hugging Face GPT-2 / Llama / Mistral / Qwen / Gemma 3 checkpoint "
                        "directory")
    parser.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                        help="text to continue (repeat for a batch of prompts; default: a newline)")
    parser.add_argument("--chat", default=None, metavar="TEXT",
                        help="a user message to answer through the tokenizer's chat template "
                             "(instruct checkpoints); only the reply is printed")
    parser.add_argument("--system", default=None, metavar="TEXT",
                        help="with --chat: a system message before it")
    parser.add_argument("--max-new-tokens", type=positive_int, default=200)
    parser.add_argument("--temperature", type=float, default=None,
                        help="0 = greedy (default: 1, or a checkpoint's generation_config.json)")
    parser.add_argument("--top-k", type=positive_int, default=None,
                        help="sample from the k likeliest (default: all, or a checkpoint's)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="nucleus sampling mass (default: off, or a checkpoint's)")
    parser.add_argument("--min-p", type=float, default=None,
                        help="sample from tokens at least this fraction as likely as the "
                             "likeliest (default: off, or a checkpoint's)")
    parser.add_argument("--repetition-penalty", type=float, default=None,
                        help="> 1 makes tokens already in the text less likely, greedy or sampled "
                             "(default: 1 = off, or a checkpoint's)")
    parser.add_argument("--greedy", action="store_true", help="always the likeliest token")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="a checkpoint: go on past its end-of-sequence tokens")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible samples")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="stop a continuation at this string (repeatable; not printed)")
    parser.add_argument("--no-slide", action="store_true",
                        help="error instead of sliding the context when it fills up")
    parser.add_argument("--no-stream", action="store_true", help="print when done")
    engine.add_arguments(parser)
    parser.add_argument("--device", type=device_name, default="cpu")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    parser.set_defaults(run=run)


class StopStrings:
    """Finds the earliest stop string in a text; knows how much of a text is safe to show while
    a stop string could still be completing at its end."""

    def __init__(self, stops: list[str]):
        if any(not stop for stop in stops):
            raise ValueError("--stop strings must not be empty")
        self.stops = stops

    def cut(self, text: str) -> int | None:
        """Index of the earliest stop string in ``text``, or None."""
        hits = [index for index in (text.find(stop) for stop in self.stops) if index >= 0]
        return min(hits) if hits else None

    def safe(self, text: str) -> int:
        """Length of the prefix of ``text`` that no stop string can still reach into."""
        hold = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    hold = max(hold, size)
                    break
        return len(text) - hold


class Continuation:
    """The text of a continuation, decoded after its prompt's tokens: a SentencePiece-style decoder
    (Llama, T5) drops the leading space of the first token it decodes, so the continuation alone
    would lose the space that separates it from the prompt. Where the prompt's text is not a
    prefix of the whole (bytes of one character split across the boundary), the continuation is
    decoded alone."""

    def __init__(self, vocabulary, prompt_ids: list[int]):
        self.vocabulary, self.prompt_ids = vocabulary, list(prompt_ids)
        self.prefix = vocabulary.decode(self.prompt_ids)

    def text(self, tokens: list[int]) -> str:
        whole = self.vocabulary.decode(self.prompt_ids + [int(t) for t in tokens])
        if whole.startswith(self.prefix):
            return whole[len(self.prefix):]
        return self.vocabulary.decode(tokens)

    def settled(self, tokens: list[int]) -> int:
        """How many leading tokens have text that later tokens cannot change: all but a trailing
        run of byte-fallback tokens (``<0xE2>``...), which decode together or as U+FFFD each."""
        pending = getattr(self.vocabulary, "pending_tokens", None)
        return len(tokens) - (pending(tokens) if pending else 0)


def generation_config(args: argparse.Namespace, checkpoint) -> "GenerationConfig":
    """The options, over a checkpoint's own settings (``CheckpointGeneration``; None for a run of
    ``aiayn train lm``, whose default is sampling at temperature 1 from every token)."""
    from aiayn.decoding.generation import GenerationConfig
    from aiayn.interop.hf_generation import CheckpointGeneration

    given = [args.temperature, args.top_k, args.top_p, args.min_p]
    own = checkpoint or CheckpointGeneration(sample=True, top_k=None)
    sample = any(value is not None for value in given) or own.sample

    def option(name: str):
        value = getattr(args, name)
        return getattr(own, name) if value is None else value

    return GenerationConfig(
        max_new_tokens=args.max_new_tokens, greedy=args.greedy or not sample,
        temperature=option("temperature"), top_k=option("top_k"), top_p=option("top_p"),
        min_p=option("min_p"), repetition_penalty=option("repetition_penalty"), seed=args.seed,
        stop_ids=() if args.ignore_eos else own.stop_ids, slide=not args.no_slide)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from aiayn.data.text import CharVocabulary
    from aiayn.interop.hf_generation import GENERATION_FILE, read_generation_settings
    from aiayn.tasks.checkpoints import TextTokenizer, load_model_dir
    from aiayn.training.run import RUN_FILE

    # Checked before the model loads or anything is printed.
    if args.chat is not None and args.prompt:
        raise ValueError("give --prompt (text to continue) or --chat (a message to answer), "
                         "not both")
    if args.system is not None and args.chat is None:
        raise ValueError("--system goes with --chat")
    if args.chat == "" or args.system == "":
        raise ValueError("--chat and --system messages must not be empty")
    generation_config(args, None)  # the options' own values (e.g. --top-p 2) are checked now
    if args.threads:
        torch.set_num_threads(args.threads)
    run_ = load_model_dir(args.run_dir, task="lm")
    vocabulary, context = run_.assets, run_.model_config.max_length
    # A checkpoint's settings: in its own directory, or copied with its tokenizer into a run
    # fine-tuned from it (both are the tokenizer's directory); a run from scratch has none
    settings = getattr(vocabulary, "directory", None)
    is_run = (Path(args.run_dir) / RUN_FILE).is_file()
    checkpoint = None
    if settings is not None and (not is_run or (settings / GENERATION_FILE).is_file()):
        checkpoint = read_generation_settings(settings)
        for setting in checkpoint.unsupported:
            print(f"aiayn generate: warning: {settings / GENERATION_FILE} sets {setting}, which "
                  f"aiayn does not apply", file=sys.stderr)
    config = generation_config(args, checkpoint)
    if args.chat is not None and not isinstance(vocabulary, TextTokenizer):
        raise ValueError(f"{args.run_dir}: --chat needs a Hugging Face tokenizer with a chat "
                         f"template; this run's vocabulary has none")
    inference = engine.engine(run_.model.to(torch.device(args.device)), args)
    stops = StopStrings(args.stop)
    prompts = [args.chat] if args.chat is not None else (args.prompt or ["\n"])
    rows = []
    for number, prompt in enumerate(prompts, start=1):
        if not prompt:
            raise ValueError(f"prompt {number} is empty; leave out --prompt to start from a "
                             f"newline")
        if args.chat is not None:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            ids = vocabulary.encode_chat(messages + [{"role": "user", "content": args.chat}])
        else:
            ids = vocabulary.encode(prompt, source=f"prompt {number}")
        if len(ids) > context:
            unit = "characters" if isinstance(vocabulary, CharVocabulary) else "tokens"
            print(f"aiayn generate: warning: prompt {number} has {len(ids)} {unit}, more than "
                  f"the context of {context} allows; keeping its last {context}",
                  file=sys.stderr)
            ids = ids[-context:]
        rows.append(ids)
    stream = len(rows) == 1 and not args.no_stream
    continuations = [Continuation(vocabulary, ids) for ids in rows]
    texts, streamed = [""] * len(rows), []
    shown, done = [0], [False]

    def on_step(step: int, tokens, finished) -> None:
        if done[0] or bool(finished[0]):  # a stop string is out, or the row stopped at an end
            return  # id: the end token is not shown (the final text leaves it out too)
        # The whole continuation decoded again: a subword tokenizer's bytes of one character can
        # span tokens (held back while incomplete, shown as U+FFFD by the decoder).
        streamed.append(int(tokens[0]))
        texts[0] = continuations[0].text(streamed[:continuations[0].settled(streamed)])
        cut = stops.cut(texts[0])
        done[0] = cut is not None
        visible = cut if cut is not None else stops.safe(texts[0].rstrip("\ufffd"))
        if visible > shown[0]:
            sys.stdout.write(texts[0][shown[0]:visible])
            sys.stdout.flush()
            shown[0] = visible

    def stop(row: int, tokens: list[int]) -> bool:
        return stops.cut(continuations[row].text(tokens)) is not None

    if stream and args.chat is None:  # a chat prints the reply alone
        sys.stdout.write(prompts[0])
        sys.stdout.flush()
    result = inference.generate(rows, config, stop=stop if args.stop else None,
                                on_step=on_step if stream else None)
    for index, tokens in enumerate(result.tokens):
        text = continuations[index].text(tokens)
        cut = stops.cut(text)
        text = text if cut is None else text[:cut]
        if stream:
            sys.stdout.write(text[shown[0]:] + "\n")
        else:
            if len(rows) > 1:
                sys.stdout.write(f"=== {prompts[index]!r}\n")
            sys.stdout.write((prompts[index] if args.chat is None else "") + text + "\n")
    sys.stdout.flush()
    return 0
