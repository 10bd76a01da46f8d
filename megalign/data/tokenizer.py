"""Tokenizers behind one small interface: a built-in character tokenizer, HF tokenizers and SentencePiece models.

Design choices:

- The trainer, datasets and rollout only need `encode`, `decode`, the special ids, `vocab_size`
  and `apply_chat_template(messages, add_generation_prompt=True) -> ids`; the `Tokenizer`
  protocol is exactly that, plus `save(path)` (HF files for the export) and a `name` for messages,
  so a tiny model on a laptop and a 7B HF model share the same code. `vocab_size` is one more than
  the largest id the tokenizer can produce, which is what the model's embedding must hold
  (`check_vocab`).
- `CharTokenizer` needs no files: ids 0..2 are `<pad>`, `<bos>`, `<eos>`, then newline and the 95
  printable ASCII characters (vocab_size 99). An unknown character is an error naming it and its
  position: replacing it with a placeholder would silently change the task.
  Its chat template is plain text after one `<bos>`: `"{role}: {content}\\n"` per message, except
  that an assistant message ends with `<eos>` instead of the newline (the model learns to stop
  where generation stops, and a [user, assistant] conversation gives the same ids as the (prompt,
  response) pair of `encode_sft` with `template_prompts`); `"assistant: "` follows when a
  generation prompt is asked for.
  `save` writes it as an HF fast tokenizer (`tokenizers` WordLevel over single characters, a
  pre-tokenizer that isolates every character, a decoder that fuses them, BOS added by
  `tokenizer(text)` as megalign adds it to prompts) with the same template in Jinja, so
  `AutoTokenizer` gives the same ids. One difference is inherent to HF: a text holding the literal
  spelling of a special token (`"<eos>"`) is encoded by HF as that token, where `CharTokenizer`
  spells it out character by character (a prompt cannot inject an EOS here).
- `HFTokenizer` loads `AutoTokenizer` from a local folder (never the network). Chat prompts are
  rendered to text with the tokenizer's own template and then encoded without adding special
  tokens, because templates write their own BOS; this is also stable across transformers versions
  (v5 returns a BatchEncoding from `apply_chat_template(tokenize=True)`). A tokenizer without a
  pad token pads with EOS (pad positions are masked, so the id only has to be valid). A text it cannot
  encode (the exported character tokenizer has no unknown token) is a ValueError naming the character
  and its position, as for `CharTokenizer`, so the data loaders name the row and `skip_invalid` skips it.
  Qwen3's template has a thinking switch, the template variable `enable_thinking` (unset: thinking;
  false: an empty `<think></think>` block closes the generation prompt, so the model answers
  directly). `tokenizer.enable_thinking` passes it to every rendering of the run (prompts, SFT
  conversations, multi-turn episodes alike); set on a template that never reads the variable, or on
  a tokenizer without HF templates, it is an error rather than a silent no-op.
- `SentencePieceTokenizer` reads a bare `tokenizer.model` (Llama-2 style) with the `sentencepiece`
  package itself rather than through transformers, whose handling of a folder without
  `tokenizer_config.json` differs between versions; ids are exactly `SentencePieceProcessor`'s.
  Such a file has no chat template, so chat rendering is an error (as for an HF tokenizer
  without one). `save` copies the file, which `AutoTokenizer` reads beside the exported config.json.
- `tokenizer_fingerprint` identifies a tokenizer by what decides its ids, in three parts hashed apart so that a
  mismatch can say which differs: "vocabulary" (every token with its id, and for an HF fast tokenizer its model
  section: BPE merges, unknown token), "special tokens" (pad / bos / eos / unk ... with their ids, and the added
  tokens with their flags) and "normaliser" (an HF fast tokenizer's normaliser, pre-tokeniser, post-processor and
  decoder; a slow one's class and SentencePiece model; a bare SentencePiece model's whole file). Names, paths, chat templates and length limits are left
  out: they do not change which id a text gets. `CharTokenizer`'s fingerprint is that of its export (`save`),
  which gives the same ids, so a character-tokenizer run and a checkpoint exported from one agree.
- Which tokenizer a run uses (`build_tokenizer`): `kind: auto` (the default) takes the tokenizer
  of `path` if given, else of the model folder when it holds tokenizer files, else the character
  tokenizer; a folder with `tokenizer.json` or `tokenizer_config.json` is an HF tokenizer, one with
  only `tokenizer.model` a SentencePiece model. `char`, `hf` and `sentencepiece` force a kind.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any, Literal, Mapping, Optional, Protocol, Sequence

from megalign.config import option

Message = Mapping[str, str]
"""One chat message: {"role": "system" | "user" | "assistant" | ..., "content": str}."""


class Tokenizer(Protocol):
    """What megalign needs from a tokenizer; ids are plain Python ints in [0, vocab_size)."""

    name: str
    """What it is and where it came from, for messages: "char", "hf '/models/x'", ..."""
    vocab_size: int
    pad_id: int
    eos_id: int
    bos_id: Optional[int]

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]: ...

    def save(self, path: str) -> None:
        """Write files into the existing folder `path` from which `transformers.AutoTokenizer` loads this tokenizer."""


def check_messages(messages: Any) -> None:
    """Raise ValueError unless `messages` is a non-empty list of {"role": str, "content": str}."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{role, content}}, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a mapping with role and content, got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(f"messages[{i}].{key} must be a string, got {message.get(key)!r}")


def check_vocab(tokenizer: Tokenizer, vocab_size: int, what: str) -> None:
    """Raise ValueError unless every id of `tokenizer` is a row of a model vocabulary of `vocab_size`.

    `what` names the model side in the message (e.g. "actor.path '/models/x'"). A tokenizer with more
    ids than the model has rows is an error: its extra ids would index past the embedding. A larger
    model vocabulary is fine, because HF models often pad the embedding to a multiple of 64 or 128
    and the tokenizer's ids all fit; the model can still sample an unused row, which
    `decode` then rejects (CharTokenizer) or renders as nothing (HF, SentencePiece).
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"{what}: vocab_size must be a positive int, got {vocab_size!r}")
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"tokenizer ({tokenizer.name}, {tokenizer.vocab_size} ids) does not match {what} "
                         f"(vocab_size {vocab_size}): the model has no rows for ids {vocab_size}.."
                         f"{tokenizer.vocab_size - 1}")


class CharTokenizer:
    """Character-level tokenizer over printable ASCII and newline, for small tasks (see module doc)."""

    SPECIALS = ("<pad>", "<bos>", "<eos>")
    CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
    CHAT_TEMPLATE = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
        "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    """`apply_chat_template`'s rendering in Jinja, for the HF files `save` writes."""

    name = "char"

    def __init__(self):
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self._ids = {ch: i + len(self.SPECIALS) for i, ch in enumerate(self.CHARS)}
        self.vocab_size = len(self.SPECIALS) + len(self.CHARS)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = [self.bos_id] if add_bos else []
        for i, ch in enumerate(text):
            if ch not in self._ids:
                raise ValueError(f"CharTokenizer cannot encode {ch!r} at position {i}: only printable ASCII and newline")
            ids.append(self._ids[ch])
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"CharTokenizer cannot decode id {i}: vocab_size is {self.vocab_size}")
            if i < len(self.SPECIALS):
                if not skip_special:
                    out.append(self.SPECIALS[i])
            else:
                out.append(self.CHARS[i - len(self.SPECIALS)])
        return "".join(out)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        check_messages(messages)
        ids = [self.bos_id]
        for i, m in enumerate(messages):
            try:
                ids += self.encode(f"{m['role']}: {m['content']}")
            except ValueError as exc:
                raise ValueError(f"messages[{i}]: {exc}") from None
            ids += [self.eos_id] if m["role"] == "assistant" else self.encode("\n")
        return ids + (self.encode("assistant: ") if add_generation_prompt else [])

    def save(self, path: str, vocab_size: Optional[int] = None) -> None:
        """Write tokenizer.json, tokenizer_config.json and the chat template (module doc); needs transformers.

        `vocab_size` (default: this tokenizer's own) fills the vocabulary with tokens `<|xN|>` that encoding never
        produces (every character is its own word), so a model with that many rows (a real-size vocabulary, as the
        GPU check builds) and the saved tokenizer agree id for id."""
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as CoreTokenizer
        from tokenizers import decoders, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        base = self.SPECIALS + tuple(self.CHARS)
        vocab_size = len(base) if vocab_size is None else vocab_size
        if vocab_size < len(base):
            raise ValueError(f"vocab_size {vocab_size} < the character tokenizer's {len(base)} ids")
        filler = tuple(f"<|x{i}|>" for i in range(len(base), vocab_size))
        pad, bos, eos = self.SPECIALS
        core = CoreTokenizer(models.WordLevel({tok: i for i, tok in enumerate(base + filler)}))
        core.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # every character is its own word
        core.decoder = decoders.Fuse()  # joined without spaces
        core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in self.SPECIALS])
        core.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                            special_tokens=[(bos, self.bos_id)])
        fast = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=pad, bos_token=bos, eos_token=eos,
                                       clean_up_tokenization_spaces=False)
        fast.chat_template = self.CHAT_TEMPLATE
        fast.save_pretrained(path)


class HFTokenizer:
    """`transformers.AutoTokenizer` from a local folder, behind the `Tokenizer` interface."""

    # tokenizer_config.json classes that mean "exactly the tokenizer.json beside me" (transformers 4 / 5)
    GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")

    def __init__(self, path: str, enable_thinking: Optional[bool] = None):
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        self.path = path
        self.name = f"hf {path!r}"
        # A generic fast tokenizer (CharTokenizer.save writes one) is loaded as that class: from
        # transformers 5, AutoTokenizer lets a config.json beside it choose the model family's class
        # instead (model_type qwen2 -> Qwen2Tokenizer), which adds its own <|endoftext|> and so one
        # id more than the exported model has rows.
        config_path = os.path.join(path, "tokenizer_config.json")
        generic = False
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as fh:
                generic = json.load(fh).get("tokenizer_class") in self.GENERIC_CLASSES
        loader = PreTrainedTokenizerFast if generic else AutoTokenizer
        self.hf = loader.from_pretrained(path, local_files_only=True)
        if self.hf.eos_token_id is None:
            raise ValueError(f"tokenizer at {path!r} has no eos token; generation needs one to stop")
        self.eos_id = int(self.hf.eos_token_id)
        self.pad_id = int(self.hf.pad_token_id) if self.hf.pad_token_id is not None else self.eos_id
        self.bos_id = int(self.hf.bos_token_id) if self.hf.bos_token_id is not None else None
        self.vocab_size = max(len(self.hf), max(self.hf.get_vocab().values()) + 1)  # ids need not be dense
        self.template_kwargs = {}
        if enable_thinking is not None:
            if not _template_reads(self.hf.chat_template, "enable_thinking"):
                raise ValueError(f"tokenizer.enable_thinking={enable_thinking} but the chat template of {path!r} "
                                 "does not read enable_thinking; unset it for this tokenizer")
            self.template_kwargs["enable_thinking"] = enable_thinking

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        try:
            ids = list(self.hf.encode(text, add_special_tokens=False))
        except Exception as exc:  # `tokenizers` raises its Rust errors as plain Exception
            raise ValueError(self._encode_error(text, exc)) from None
        return [self.bos_id] + ids if add_bos and self.bos_id is not None else ids

    def _encode_error(self, text: str, exc: Exception) -> str:
        """What `encode` says when `text` cannot be encoded: the first character that cannot be encoded alone (the
        exported character tokenizer's WordLevel vocabulary has no unknown token) and its position (module doc)."""
        for i, ch in enumerate(text):
            try:
                self.hf.encode(ch, add_special_tokens=False)
            except Exception:  # as in `encode`
                return f"{self.name} cannot encode {ch!r} at position {i}: {exc}"
        return f"{self.name} cannot encode the text: {exc}"

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        check_messages(messages)
        if not self.hf.chat_template:
            raise ValueError(f"tokenizer at {self.path!r} has no chat template; use `prompt` rows or add one")
        text = self.hf.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                           **self.template_kwargs)
        return self.encode(text)

    def save(self, path: str) -> None:
        self.hf.save_pretrained(path)


def _template_reads(chat_template: Optional[str | dict[str, str]], variable: str) -> bool:
    """Whether a Jinja chat template (or any of a tokenizer's named templates) reads `variable`."""
    import jinja2
    from jinja2 import meta

    if not chat_template:
        return False
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    env = jinja2.Environment()
    return any(variable in meta.find_undeclared_variables(env.parse(t)) for t in templates)


class SentencePieceTokenizer:
    """A SentencePiece `tokenizer.model` read with `sentencepiece` itself (see module doc)."""

    def __init__(self, path: str):
        try:
            import sentencepiece
        except ImportError as exc:
            raise ImportError(f"reading {path!r} needs the sentencepiece package: pip install 'megalign[sentencepiece]'") from exc
        self.path = path
        self.name = f"sentencepiece {path!r}"
        self.sp = sentencepiece.SentencePieceProcessor()
        try:
            self.sp.Load(path)
        except (OSError, RuntimeError) as exc:
            raise ValueError(f"{path}: cannot read as a SentencePiece model: {exc}") from exc
        if self.sp.eos_id() < 0:
            raise ValueError(f"SentencePiece model {path!r} has no eos piece; generation needs one to stop")
        self.eos_id = self.sp.eos_id()
        self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.eos_id
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.vocab_size = self.sp.get_piece_size()

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self.sp.encode(text)
        return [self.bos_id] + ids if add_bos and self.bos_id is not None else ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"SentencePieceTokenizer cannot decode id {i}: vocab_size is {self.vocab_size}")
        if skip_special:
            return self.sp.decode(ids)  # control pieces (bos, eos, pad) decode to nothing
        out, run = [], []
        for i in ids:  # decode runs of ordinary pieces; spell control pieces out where they stand
            if self.sp.is_control(i):
                out += [self.sp.decode(run), self.sp.id_to_piece(i)]
                run = []
            else:
                run.append(i)
        return "".join(out + [self.sp.decode(run)])

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        check_messages(messages)
        raise ValueError(f"SentencePiece model {self.path!r} has no chat template; use `prompt` rows or an HF "
                         "tokenizer folder with a template")

    def save(self, path: str) -> None:
        shutil.copyfile(self.path, os.path.join(path, "tokenizer.model"))


HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SENTENCEPIECE_FILE = "tokenizer.model"


def _detect(folder: str) -> Optional[Literal["hf", "sentencepiece"]]:
    """The kind of tokenizer `folder` holds (module doc), or None when it holds no tokenizer files."""
    if any(os.path.isfile(os.path.join(folder, f)) for f in HF_TOKENIZER_FILES):
        return "hf"
    if os.path.isfile(os.path.join(folder, SENTENCEPIECE_FILE)):
        return "sentencepiece"
    return None


@dataclasses.dataclass
class TokenizerConfig:
    """Which tokenizer to build (rule in the module doc)."""

    kind: Literal["auto", "char", "hf", "sentencepiece"] = option(
        "auto", doc="'auto': the tokenizer of `path`, else of the model folder, else 'char'; 'char': built-in "
                    "character tokenizer; 'hf': AutoTokenizer from `path`; 'sentencepiece': a tokenizer.model at `path`")
    path: Optional[str] = option(None, doc="local tokenizer folder (required for 'hf' and 'sentencepiece', which also "
                                           "takes the tokenizer.model file itself; optional for 'auto')")
    enable_thinking: Optional[bool] = option(
        None, doc="the chat template's thinking switch (Qwen3): false renders non-thinking prompts (an empty "
                  "<think></think> block), true thinking ones; null: the template's default. Only for an HF "
                  "tokenizer whose template reads enable_thinking")

    def __post_init__(self):
        if self.kind == "char" and self.path is not None:
            raise ValueError(f"tokenizer.path is unused for kind 'char' (path={self.path!r})")
        if self.kind in ("hf", "sentencepiece") and self.path is None:
            raise ValueError(f"tokenizer.path is required for kind {self.kind!r}")


def build_tokenizer(cfg: TokenizerConfig, model_path: Optional[str] = None) -> Tokenizer:
    """The tokenizer `cfg` describes; `model_path` is the model folder `kind: auto` looks in."""
    kind, path = cfg.kind, cfg.path
    if kind == "auto":
        if path is not None:
            kind = _detect(path) if os.path.isdir(path) else None
            if kind is None:
                raise ValueError(f"tokenizer.path {path!r} is not a folder holding tokenizer.json, "
                                 "tokenizer_config.json or tokenizer.model")
        elif model_path is not None and os.path.isdir(model_path) and _detect(model_path) is not None:
            kind, path = _detect(model_path), model_path
        else:
            kind = "char"
    if cfg.enable_thinking is not None and kind != "hf":
        raise ValueError(f"tokenizer.enable_thinking={cfg.enable_thinking} needs an HF tokenizer whose chat template "
                         f"reads it; this run's tokenizer is {kind!r}")
    if kind == "char":
        return CharTokenizer()
    if kind == "hf":
        return HFTokenizer(path, cfg.enable_thinking)
    if os.path.isdir(path):
        path = os.path.join(path, SENTENCEPIECE_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer.path: no SentencePiece model at {path!r}")
    return SentencePieceTokenizer(path)


FINGERPRINT_PARTS = ("vocabulary", "special tokens", "normaliser")
"""The parts of `tokenizer_fingerprint`, in the order a mismatch names them."""


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


@functools.cache
def _char_fingerprint() -> tuple[tuple[str, str], ...]:
    """The fingerprint of `CharTokenizer`'s export (module doc), computed once per process."""
    with tempfile.TemporaryDirectory() as folder:
        CharTokenizer().save(folder)
        return tuple(tokenizer_fingerprint(HFTokenizer(folder)).items())


def tokenizer_fingerprint(tokenizer: Tokenizer) -> dict[str, str]:
    """{part: sha256 hex} for each of `FINGERPRINT_PARTS`: what decides the ids `tokenizer` gives a text (module doc).

    Two tokenizers give the same ids for every text exactly when all three parts are equal (up to hash collisions),
    so the roles that read the actor's token ids compare them (`megalign.trainers.model_checks.check_tokenizer`)."""
    if isinstance(tokenizer, CharTokenizer):
        return dict(_char_fingerprint())
    specials = {"pad": tokenizer.pad_id, "bos": tokenizer.bos_id, "eos": tokenizer.eos_id}
    if isinstance(tokenizer, HFTokenizer):
        hf = tokenizer.hf
        vocab = sorted(hf.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
        named = {role: [token, hf.convert_tokens_to_ids(token)] for role, token in hf.special_tokens_map.items()
                 if isinstance(token, str)}
        added = {i: [t.content, t.special, t.normalized, t.lstrip, t.rstrip, t.single_word]
                 for i, t in hf.added_tokens_decoder.items()}
        if getattr(hf, "backend_tokenizer", None) is not None:
            core = json.loads(hf.backend_tokenizer.to_str())
            model, normaliser = core["model"], {k: core.get(k) for k in ("normalizer", "pre_tokenizer",
                                                                         "post_processor", "decoder")}
        else:  # a slow tokenizer: its class and, for SentencePiece ones, the model file decide the rest
            sp = getattr(hf, "sp_model", None)
            model = None
            normaliser = {"class": type(hf).__name__,
                          "sentencepiece": hashlib.sha256(sp.serialized_model_proto()).hexdigest() if sp else None}
        return {"vocabulary": _digest([vocab, model]), "special tokens": _digest([specials, named, added]),
                "normaliser": _digest(normaliser)}
    if isinstance(tokenizer, SentencePieceTokenizer):
        sp = tokenizer.sp
        pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
        control = sorted(i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i))
        return {"vocabulary": _digest([pieces, [sp.get_score(i) for i in range(sp.get_piece_size())]]),
                "special tokens": _digest([specials, control]),
                "normaliser": hashlib.sha256(sp.serialized_model_proto()).hexdigest()}
    raise TypeError(f"tokenizer_fingerprint: no fingerprint for {type(tokenizer).__name__} ({tokenizer.name})")
