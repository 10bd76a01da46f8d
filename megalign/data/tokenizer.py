"""Tokenizers behind one small interface: a built-in character tokenizer and a thin HF wrapper.

Design choices:

- The trainer, datasets and rollout only need `encode`, `decode`, the special ids, `vocab_size`
  and `apply_chat_template(messages, add_generation_prompt=True) -> ids`; the `Tokenizer`
  protocol is exactly that, so a tiny model on a laptop and a 7B HF model share the same code.
- `CharTokenizer` needs no files: ids 0..2 are `<pad>`, `<bos>`, `<eos>`, then newline and the 95
  printable ASCII characters (vocab_size 99). An unknown character is an error naming it and its
  position: replacing it with a placeholder would silently change the task.
  Its chat template is plain text, `"{role}: {content}\\n"` per message, then `"assistant: "`
  when a generation prompt is asked for, after one `<bos>`.
- `HFTokenizer` loads `AutoTokenizer` from a local folder (never the network). Chat prompts are
  rendered to text with the tokenizer's own template and then encoded without adding special
  tokens, because templates write their own BOS; this is also stable across transformers versions
  (v5 returns a BatchEncoding from `apply_chat_template(tokenize=True)`). A tokenizer without a
  pad token pads with EOS (pad positions are masked, so the id only has to be valid).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping, Optional, Protocol, Sequence

from megalign.config import option

Message = Mapping[str, str]
"""One chat message: {"role": "system" | "user" | "assistant" | ..., "content": str}."""


class Tokenizer(Protocol):
    """What megalign needs from a tokenizer; ids are plain Python ints."""

    vocab_size: int
    pad_id: int
    eos_id: int
    bos_id: Optional[int]

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]: ...


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


class CharTokenizer:
    """Character-level tokenizer over printable ASCII and newline, for small tasks (see module doc)."""

    SPECIALS = ("<pad>", "<bos>", "<eos>")
    CHARS = "\n" + "".join(chr(c) for c in range(32, 127))

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
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return self.encode(text + ("assistant: " if add_generation_prompt else ""), add_bos=True)


class HFTokenizer:
    """`transformers.AutoTokenizer` from a local folder, behind the `Tokenizer` interface."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.path = path
        self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if self.hf.eos_token_id is None:
            raise ValueError(f"tokenizer at {path!r} has no eos token; generation needs one to stop")
        self.eos_id = int(self.hf.eos_token_id)
        self.pad_id = int(self.hf.pad_token_id) if self.hf.pad_token_id is not None else self.eos_id
        self.bos_id = int(self.hf.bos_token_id) if self.hf.bos_token_id is not None else None
        self.vocab_size = len(self.hf)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(self.hf.encode(text, add_special_tokens=False))
        return [self.bos_id] + ids if add_bos and self.bos_id is not None else ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        check_messages(messages)
        if not self.hf.chat_template:
            raise ValueError(f"tokenizer at {self.path!r} has no chat template; use `prompt` rows or add one")
        text = self.hf.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
        return self.encode(text)


@dataclasses.dataclass
class TokenizerConfig:
    """Which tokenizer to build."""

    kind: Literal["char", "hf"] = option("char", doc="'char': built-in character tokenizer; 'hf': AutoTokenizer from `path`")
    path: Optional[str] = option(None, doc="local folder of an HF tokenizer (required when kind is 'hf')")

    def __post_init__(self):
        if (self.kind == "hf") != (self.path is not None):
            raise ValueError(f"tokenizer.path is required for kind 'hf' and unused for kind 'char' (kind={self.kind!r}, path={self.path!r})")


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """The tokenizer `cfg` describes."""
    return HFTokenizer(cfg.path) if cfg.kind == "hf" else CharTokenizer()
