"""Language codes of multilingual translation checkpoints (NLLB-200, M2M100, mBART-50, mBART):
where the source and target codes go, read from the tokenizer files as ``transformers`` reads them.

    tokenizer_class          source ids                 decoder input (generate)
    NllbTokenizer            [src_lang] tokens </s>     </s> [tgt_lang] ...   (code forced)
    NllbTokenizer, legacy    tokens </s> [src_lang]     </s> [tgt_lang] ...   (code forced)
    M2M100Tokenizer          [__src__] tokens </s>      </s> [__tgt__] ...    (code forced)
    MBart50Tokenizer         [src_lang] tokens </s>     </s> [tgt_lang] ...   (code forced)
    MBartTokenizer           tokens </s> [src_lang]     [tgt_lang] ...        (code as start)

"Code forced": the decoder starts from ``decoder_start_token_id`` (</s>) and the target code is
forced as the first generated token, which is transformers' ``forced_bos_token_id``; aiayn's
searches take it as ``forced`` tokens (``aiayn.decoding.greedy.first_tokens``). NLLB's legacy
format (``legacy_behaviour: true``) moves only the source code. "Code as start": mBART's own
tokenizer (mbart-large-cc25, mbart-large-en-ro, and any ``mbart`` checkpoint that names no other
tokenizer class, as ``AutoTokenizer`` picks it) puts the source code after ``</s>`` and starts the
decoder from the target code, which is ``generate(..., decoder_start_token_id=...)`` (the searches'
``start``). The codes are the tokenizer's ``additional_special_tokens`` (tokenizer_config.json or
special_tokens_map.json); mBART's, where its files list none, are the 25 languages
``MBartTokenizer`` always adds; M2M100's own tokenizer (``sentencepiece.bpe.model``,
``aiayn.interop.hf_m2m100_tokenizer``) has its language set, listed or not, as
``M2M100Tokenizer.get_lang_id`` takes them. M2M100's may be given bare (``en`` for ``__en__``), as
transformers' ``M2M100Tokenizer`` takes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aiayn.interop.hf_m2m100_tokenizer import language_tokens
from aiayn.interop.hf_tokenizer import (additional_special_tokens, is_m2m100_directory,
                                        read_json_object)

# tokenizer_class (without "Fast") -> the family named in messages
LANGUAGE_TOKENIZERS = {"NllbTokenizer": "NLLB", "M2M100Tokenizer": "M2M100",
                       "MBart50Tokenizer": "mBART-50", "MBartTokenizer": "mBART"}
# mbart-large-cc25's languages: the codes MBartTokenizer adds after the SentencePiece vocabulary
MBART_CODES = ("ar_AR", "cs_CZ", "de_DE", "en_XX", "es_XX", "et_EE", "fi_FI", "fr_XX", "gu_IN",
               "hi_IN", "it_IT", "ja_XX", "kk_KZ", "ko_KR", "lt_LT", "lv_LV", "my_MM", "ne_NP",
               "nl_XX", "ro_RO", "ru_RU", "si_LK", "tr_TR", "vi_VN", "zh_CN")
SHOWN = 6  # codes listed in an error message


@dataclass(frozen=True)
class LanguageCodes:
    """What a checkpoint directory's tokenizer says about languages.

    Attributes:
        family: "NLLB", "M2M100", "mBART-50" or "mBART"; None for a tokenizer without language
            codes.
        codes: its language codes, in the tokenizer's order.
        legacy: an NLLB tokenizer with ``legacy_behaviour`` (the source code after </s>).
    """

    directory: Path
    family: str | None
    codes: tuple[str, ...]
    legacy: bool = False

    def examples(self) -> str:
        shown = ", ".join(self.codes[:SHOWN])
        return f"{shown}, ... ({len(self.codes)} codes)" if len(self.codes) > SHOWN else shown

    def code(self, value: str, option: str) -> str:
        """The tokenizer's token for ``value`` (M2M100: ``en`` -> ``__en__``).

        Raises:
            ValueError: ``value`` is not one of the codes; the message lists some.
        """
        if value in self.codes:
            return value
        if self.family == "M2M100" and f"__{value}__" in self.codes:
            return f"__{value}__"
        raise ValueError(f"{self.directory}: {option} {value!r} is not a language code of this "
                         f"{self.family} tokenizer; it has {self.examples()}")


def language_codes(directory: str | Path, *, model_type: str | None = None) -> LanguageCodes:
    """The language codes of a checkpoint directory's tokenizer (``family`` None: it has none).
    ``model_type`` "m2m_100" marks the checkpoint as multilingual whatever its tokenizer class."""
    directory = Path(directory)
    settings = read_json_object(directory / "tokenizer_config.json")
    name = str(settings.get("tokenizer_class") or "").removesuffix("Fast")
    family = LANGUAGE_TOKENIZERS.get(name)
    if family is None and model_type == "m2m_100":
        family = "NLLB" if name.startswith("Nllb") else "M2M100"
    if family is None and model_type == "mbart" and not name:  # AutoTokenizer's MBartTokenizer
        family = "mBART"
    if family == "M2M100" and not (directory / "tokenizer.json").is_file() \
            and is_m2m100_directory(directory):  # M2M100's own tokenizer: its language set
        codes = language_tokens(directory)
    else:
        codes = tuple(additional_special_tokens(directory))
    if family == "mBART" and not codes:
        codes = MBART_CODES
    return LanguageCodes(directory, family, codes,
                         legacy=bool(settings.get("legacy_behaviour", False)))


@dataclass(frozen=True)
class LanguageIds:
    """Where the codes of one language pair go, as ids (all empty: a checkpoint without codes).

    Attributes:
        source_prefix: put before each source's tokens.
        source_suffix: put after each source's </s> (mBART, legacy NLLB).
        decoder_start: the decoder's first input in place of the model's ``decoder_start_id``
            (mBART: the target code); None: the model's.
        forced: generated first after the start symbol, scored 0 (``forced_bos_token_id``);
            training targets start with them.
    """

    source_prefix: tuple[int, ...] = ()
    source_suffix: tuple[int, ...] = ()
    decoder_start: int | None = None
    forced: tuple[int, ...] = ()


def language_ids(languages: LanguageCodes, tokenizer, src_lang: str | None,
                 tgt_lang: str | None) -> LanguageIds:
    """Where the codes go for a translation from ``src_lang`` to ``tgt_lang`` (the table above);
    ``LanguageIds()`` for a checkpoint without language codes, given none.

    Raises:
        ValueError: a multilingual checkpoint without ``src_lang`` or ``tgt_lang`` (naming the
            missing option, listing some codes), a code the tokenizer lacks, or codes given to a
            checkpoint without language codes.
    """
    given = [name for name, value in (("--src-lang", src_lang), ("--tgt-lang", tgt_lang))
             if value is not None]
    if languages.family is None:
        if given:
            verb = "apply" if len(given) > 1 else "applies"
            raise ValueError(f"{languages.directory}: {' / '.join(given)} {verb} to multilingual "
                             f"checkpoints (NLLB, M2M100, mBART-50, mBART); this tokenizer has "
                             f"no language codes")
        return LanguageIds()
    missing = [name for name, value in (("--src-lang", src_lang), ("--tgt-lang", tgt_lang))
               if value is None]
    if missing:
        raise ValueError(f"{languages.directory}: a {languages.family} checkpoint translates "
                         f"between languages: give {' and '.join(missing)} (src_lang / tgt_lang "
                         f"in Python), codes such as {languages.examples()}")
    ids = []
    for value, option in ((src_lang, "--src-lang"), (tgt_lang, "--tgt-lang")):
        token = languages.code(value, option)
        index = tokenizer.token_to_id(token)
        if index is None:
            raise ValueError(f"{languages.directory}: {option} {value!r}: the tokenizer lists "
                             f"{token!r} but its vocabulary has no such token")
        ids.append(index)
    source, target = ids
    if languages.family == "mBART":
        return LanguageIds(source_suffix=(source,), decoder_start=target)
    if languages.legacy:
        return LanguageIds(source_suffix=(source,), forced=(target,))
    return LanguageIds(source_prefix=(source,), forced=(target,))
