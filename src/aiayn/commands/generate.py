"""``aiayn generate RUN_DIR --prompt TEXT``: continue a prompt with a trained language model (a run
of ``aiayn train lm`` or a Hugging Face GPT-2 / Llama / Mistral / Qwen / Gemma checkpoint
directory, with its tokenizer); ``--chat TEXT`` answers a message through the checkpoint's chat
template instead, and ``--chat -`` holds a conversation read from stdin.

A checkpoint directory generates as ``transformers``' ``generate`` does with it: it stops at its
end-of-sequence ids and picks tokens by its ``generation_config.json`` (greedy unless
``do_sample``; then its temperature, top-k, top-p and min-p; its repetition penalty either way),
each overridden by the option given.

Tokens stream to stdout as they are produced (one prompt), or each continuation is printed once done
(several prompts, generated together as one left-padded batch). A prompt longer than the model's
context keeps its last ``context`` tokens, with a warning on stderr. Past the context the
cache slides (rebuilt from the last half of the context, like nanoGPT's sampler cropping its input)
unless ``--no-slide`` makes that an error.

``--chat -`` (``aiayn.commands.chat_loop``) holds a conversation: user messages from stdin, one a
line (surrounding whitespace stripped, blank lines skipped; ``/reset`` forgets the turns so far but
not ``--system``; ``/exit`` or the end of stdin ends it), each answered with the whole conversation
laid out by the chat template. A reply is printed as a single ``--chat`` prints it (streamed,
decoded alone as ``transformers`` decodes the new tokens, end token and ``--stop`` string left out,
then a newline; a reply may hold newlines of its own) and joins the conversation as that text, an
``assistant`` message. At a terminal ``> `` on stderr asks for each line; piped, stdout holds the
replies alone. Longer than the context, the conversation drops its oldest turns, with a warning.
``--seed`` seeds one random stream at the start, which every reply draws from in turn: the same
messages give the same replies, and the first reply is the one ``--chat`` with the same seed gives.
Each turn keeps the KV cache of the turn before and prefills only what the conversation does not
share with the ids it holds (``aiayn.decoding.prefix_cache``; ``/reset`` drops it,
``--no-prefix-cache`` prefills the whole conversation every turn): the same replies, sooner.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from aiayn.commands import DefaultsHelpFormatter, engine
from aiayn.commands.train import device_name, positive_int

if TYPE_CHECKING:
    import torch

    from aiayn.decoding.generation import GenerationConfig
    from aiayn.decoding.prefix_cache import PrefixCache
    from aiayn.fast import InferenceEngine

CONVERSATION = "-"  # --chat -: a conversation read from stdin


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text from a trained language model (aiayn train lm)",
        description="Continue a prompt with the model of RUN_DIR; tokens stream to stdout.",
        formatter_class=DefaultsHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory ('aiayn train lm') or "
                        "a Hugging Face GPT-2 / Llama / Mistral / Qwen / Gemma checkpoint "
                        "directory")
    parser.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                        help="text to continue (repeat for a batch of prompts; default: a newline)")
    parser.add_argument("--chat", default=None, metavar="TEXT",
                        help="a user message to answer through the tokenizer's chat template "
                             "(instruct checkpoints); only the reply is printed. '-': a "
                             "conversation, one message a line of stdin ('/reset' forgets the "
                             "turns so far, '/exit' or the end of stdin ends it)")
    parser.add_argument("--system", default=None, metavar="TEXT",
                        help="with --chat: a system message before it (kept by '/reset')")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="with --chat -: prefill the whole conversation every turn instead "
                             "of keeping the cached positions it shares with the turn before "
                             "(the same replies, slower; for debugging)")
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


def check_request(args: argparse.Namespace) -> None:
    """The checks made before the model loads or anything is printed.

    Raises:
        ValueError: options that do not go together, an empty message or prompt, an impossible
            sampling option, or ``--chat`` with a directory whose tokenizer has no chat template.
    """
    if args.chat is not None and args.prompt:
        raise ValueError("give --prompt (text to continue) or --chat (a message to answer, or "
                         "'-' for a conversation on stdin), not both")
    if args.system is not None and args.chat is None:
        raise ValueError("--system goes with --chat")
    if args.no_prefix_cache and args.chat != CONVERSATION:
        raise ValueError("--no-prefix-cache goes with --chat - (a conversation)")
    if args.chat == "" or args.system == "":
        raise ValueError("--chat and --system messages must not be empty")
    for number, prompt in enumerate(args.prompt or [], start=1):
        if not prompt:
            raise ValueError(f"prompt {number} is empty; leave out --prompt to start from a "
                             f"newline")
    sampling = [f"--{name.replace('_', '-')}" for name in ("temperature", "top_k", "top_p", "min_p")
                if getattr(args, name) is not None and not (name == "temperature"
                                                            and getattr(args, name) == 0)]
    if args.greedy and sampling:
        raise ValueError(f"--greedy always picks the likeliest token, so {', '.join(sampling)} "
                         f"would do nothing: give one or the other")
    generation_config(args, None)  # the options' own values (e.g. --top-p 2) are checked now
    if args.chat is not None:
        check_chat_template(Path(args.run_dir))


def check_chat_template(run_dir: Path) -> None:
    """That ``run_dir`` has a chat template, read from its files before the model loads: a
    checkpoint's own, or the one a run fine-tuned from a checkpoint copied with its tokenizer.
    Directories of other tasks are left to ``load_model_dir``'s error."""
    from aiayn.interop.hf_generation import require_chat_template
    from aiayn.tasks.checkpoints import TOKENIZER_DIR, directory_task
    from aiayn.training.run import RUN_FILE

    if directory_task(run_dir) != "lm":
        return
    directory = run_dir / TOKENIZER_DIR if (run_dir / RUN_FILE).is_file() else run_dir
    if not directory.is_dir():
        raise ValueError(f"{run_dir}: --chat needs a Hugging Face tokenizer with a chat "
                         f"template; this run's vocabulary has none")
    require_chat_template(directory)


@dataclasses.dataclass(frozen=True)
class Session:
    """A loaded model and what the options make of it: one prompt's continuation streamed (or
    printed when done), several prompts' continuations printed as one batch.

    Attributes:
        generator: the random stream sampling draws from when ``config.seed`` is None (None:
            torch's global stream).
        prefix_cache: the cache each reply keeps for the next (``--chat -``), or None.
    """

    inference: "InferenceEngine"
    vocabulary: object
    context: int
    config: "GenerationConfig"
    stops: StopStrings
    stream: bool
    generator: "torch.Generator | None" = None
    prefix_cache: "PrefixCache | None" = None

    def fit(self, ids: list[int], name: str) -> list[int]:
        """``ids``, or their last ``context`` with a warning on stderr where they are more."""
        from aiayn.data.text import CharVocabulary

        if len(ids) <= self.context:
            return ids
        unit = "characters" if isinstance(self.vocabulary, CharVocabulary) else "tokens"
        print(f"aiayn generate: warning: {name} has {len(ids)} {unit}, more than the context of "
              f"{self.context} allows; keeping its last {self.context}", file=sys.stderr)
        return ids[-self.context:]

    def cut(self, text: str) -> str:
        """``text`` up to its first stop string."""
        cut = self.stops.cut(text)
        return text if cut is None else text[:cut]

    def reply(self, ids: list[int], *, echo: str | None = None) -> str:
        """Continue one prompt: print ``echo`` (the prompt's text) and the continuation decoded
        after the prompt's tokens, or (``echo`` None: a chat) the reply decoded alone, as
        ``transformers`` decodes a reply's new tokens; end token and stop string left out, then a
        newline. Returns the text printed after ``echo``."""
        continuation = Continuation(self.vocabulary, [] if echo is None else ids)
        echo = echo or ""
        streamed: list[int] = []
        shown, done, echoed = 0, False, False

        def on_step(step: int, tokens, finished) -> None:
            nonlocal shown, done, echoed
            if not echoed:  # the prompt goes out with the first step: a refused request prints
                sys.stdout.write(echo)  # nothing
                sys.stdout.flush()
                echoed = True
            if done or bool(finished[0]):  # a stop string is out, or the row stopped at an end
                return  # id: the end token is not shown (the final text leaves it out too)
            # The whole continuation decoded again: a subword tokenizer's bytes of one character
            # can span tokens (held back while incomplete, shown as U+FFFD by the decoder).
            streamed.append(int(tokens[0]))
            text = continuation.text(streamed[:continuation.settled(streamed)])
            cut = self.stops.cut(text)
            done = cut is not None
            visible = cut if cut is not None else self.stops.safe(text.rstrip("\ufffd"))
            if visible > shown:
                sys.stdout.write(text[shown:visible])
                sys.stdout.flush()
                shown = visible

        def stop(row: int, tokens: list[int]) -> bool:
            return self.stops.cut(continuation.text(tokens)) is not None

        result = self.inference.generate(
            [ids], self.config, generator=self.generator, prefix_cache=self.prefix_cache,
            stop=stop if self.stops.stops else None, on_step=on_step if self.stream else None)
        text = self.cut(continuation.text(result.tokens[0]))
        sys.stdout.write((text[shown:] if echoed else echo + text) + "\n")
        sys.stdout.flush()
        return text

    def batch(self, rows: list[list[int]], prompts: list[str]) -> None:
        """Continue several prompts together; print each with its continuation when all are done."""
        continuations = [Continuation(self.vocabulary, ids) for ids in rows]

        def stop(row: int, tokens: list[int]) -> bool:
            return self.stops.cut(continuations[row].text(tokens)) is not None

        result = self.inference.generate(rows, self.config, generator=self.generator,
                                         stop=stop if self.stops.stops else None)
        for prompt, continuation, tokens in zip(prompts, continuations, result.tokens):
            sys.stdout.write(f"=== {prompt!r}\n{prompt}{self.cut(continuation.text(tokens))}\n")
        sys.stdout.flush()


def load(args: argparse.Namespace) -> Session:
    """The model of RUN_DIR on ``--device`` with its tokenizer, and the generation settings of its
    checkpoint (where it has one) under the options."""
    import torch

    from aiayn.interop.hf_generation import GENERATION_FILE, read_generation_settings
    from aiayn.tasks.checkpoints import load_model_dir
    from aiayn.training.run import RUN_FILE

    if args.threads:
        torch.set_num_threads(args.threads)
    run_ = load_model_dir(args.run_dir, task="lm")
    vocabulary = run_.assets
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
    return Session(
        inference=engine.engine(run_.model.to(torch.device(args.device)), args),
        vocabulary=vocabulary, context=run_.model_config.max_length,
        config=generation_config(args, checkpoint), stops=StopStrings(args.stop),
        stream=not args.no_stream)


def converse(session: Session, args: argparse.Namespace) -> None:
    """``--chat -``: the conversation of ``aiayn.commands.chat_loop`` on stdin. With ``--seed``
    one random stream, seeded here, serves every reply (``generate`` would seed a fresh one per
    call). One ``PrefixCache`` serves every reply (unless ``--no-prefix-cache``); ``/reset``
    drops what it holds."""
    import torch

    from aiayn.commands import chat_loop
    from aiayn.decoding.prefix_cache import PrefixCache

    if not args.no_prefix_cache:
        session = dataclasses.replace(session, prefix_cache=PrefixCache())
    if session.config.seed is not None:
        generator = torch.Generator(device=torch.device(args.device))
        session = dataclasses.replace(session, config=session.config.replace(seed=None),
                                      generator=generator.manual_seed(session.config.seed))
    chat_loop.converse(getattr(sys.stdin, "buffer", sys.stdin), system=args.system,
                       encode=session.vocabulary.encode_chat, respond=session.reply,
                       context=session.context,
                       marker=sys.stderr if sys.stdin.isatty() else None,
                       on_reset=session.prefix_cache.reset if session.prefix_cache else None)


def run(args: argparse.Namespace) -> int:
    check_request(args)
    session = load(args)
    if args.chat == CONVERSATION:
        converse(session, args)
    elif args.chat is not None:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.chat})
        session.reply(session.fit(session.vocabulary.encode_chat(messages), "prompt 1"))
    else:
        prompts = args.prompt or ["\n"]
        rows = [session.fit(session.vocabulary.encode(prompt, source=f"prompt {number}"),
                            f"prompt {number}")
                for number, prompt in enumerate(prompts, start=1)]
        if len(rows) == 1:
            session.reply(rows[0], echo=prompts[0])
        else:
            session.batch(rows, prompts)
    return 0
