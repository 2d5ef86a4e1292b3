"""The model's tokenizer (Hugging Face ``tokenizer.json`` + ``tokenizer_config.json``), with its chat template."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tokenizers


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer  # heavy import: only when a tokenizer is needed

        try:
            self._tok = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load a tokenizer from {path}: {e}") from e

    @property
    def hf(self) -> Any:
        """The transformers tokenizer (for libraries that read one, such as llguidance)."""
        return self._tok

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    @property
    def stream_backend(self) -> tokenizers.Tokenizer | None:
        """The Rust tokenizer, for ``tokenizers.decoders.DecodeStream``: None unless ``decode`` is
        exactly its decode. That takes a fast tokenizer (``tokenizer.json``) and no clean-up of
        spaces, which transformers would apply to the Rust text afterwards (DeepSeek's configs
        turn it off)."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None or getattr(self._tok, "clean_up_tokenization_spaces", False):
            return None
        return backend

    def special_ids(self, texts: tuple[str, ...]) -> frozenset[int]:
        """The ids of those of ``texts`` that are special tokens of this tokenizer (decoding skips them)."""
        special = set(getattr(self._tok, "all_special_ids", []) or [])
        decoder = getattr(self._tok, "added_tokens_decoder", {}) or {}
        special |= {i for i, t in decoder.items() if getattr(t, "special", False)}
        unk = getattr(self._tok, "unk_token_id", None)  # what an absent token converts to
        ids = {self._tok.convert_tokens_to_ids(t) for t in texts}
        return frozenset(i for i in ids if isinstance(i, int) and i in special and i != unk)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok(text, add_special_tokens=add_special_tokens).input_ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)  # one sequence in, one string out (a batch would give a list)
        return text

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Chat messages (and ``tools``, OpenAI's function specs, for a template that renders them) ->
        prompt token ids (the template adds the BOS token itself)."""
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             tools=list(tools) if tools is not None else None)
        assert isinstance(text, str)  # tokenize=False: the rendered prompt
        return self.encode(text, add_special_tokens=False)
