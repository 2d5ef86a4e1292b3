"""Structured output: grammar-constrained decoding (vLLM's ``structured_outputs``) with llguidance.

A request's ``StructuredOutputsParams`` names one constraint: a JSON schema, any JSON object, a regex,
a choice among strings, or a Lark grammar. Each sampled row then gets a mask of the tokens its
grammar allows next (``mask_logits``), and each token taken advances its matcher (``Grammar.advance``).
Speculative decoding (``engine.speculative``) keeps the drafts the grammar takes (``Grammar.draftable``)
and masks each verify row by the matcher's state after the drafts before it (``mask_drafted``: advanced
through them and rolled back, llguidance's ``fill_next_token_bitmask_par_with_draft_tokens``).

llguidance was picked over xgrammar by measurement (``benchmarks/grammar_mask.py``, V2-Lite's
102,400-token vocabulary): every output of a medium schema parsed and validated with llguidance, while
xgrammar let raw control characters into JSON strings (7 of 10 outputs invalid); its mask fill is
about 30 µs per token (xgrammar's 4 µs), small beside a decode step.

JSON is compact by default: fixed ``", "`` and ``": "`` separators, no free whitespace, so a model
cannot loop on whitespace; ``any_whitespace`` allows it (vLLM's default).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache, cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the proxy imports this module (to check constraints): neither torch nor llguidance here
    import llguidance
    import torch

    from engine.tokenizer import Tokenizer

MAX_CHOICES = 256  # strings in one ``choice``
MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar's size
# llguidance's JSON options for compact output (vLLM's default, disable_any_whitespace): one space after each
# separator and none elsewhere; also a schema's "x-guidance" inside a Lark grammar's %json rule.
COMPACT_JSON: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class StructuredOutputsParams:
    """One constraint on the output (vLLM's field names): ``json`` (a JSON schema, as text or a dict),
    ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings exactly) or
    ``grammar`` (Lark syntax, as llguidance reads it). Raises ValueError for none or several, or for a
    constraint that does not compile."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    any_whitespace: bool = False

    def _kinds(self) -> list[str]:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        return given + ["json_object"] if self.json_object else given

    def __post_init__(self) -> None:
        kinds = self._kinds()
        if len(kinds) != 1:
            raise ValueError("structured output takes exactly one of json, json_object, regex, choice, grammar; "
                             f"got {', '.join(kinds) or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("json must be a JSON schema (an object, or its JSON text)")
        if self.choice is not None:
            if not isinstance(self.choice, list):
                raise ValueError("choice must be a list of strings")
            if not self.choice or len(self.choice) > MAX_CHOICES:
                raise ValueError(f"choice must list 1 to {MAX_CHOICES} strings, got {len(self.choice)}")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("choice must list non-empty strings")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{k} must be a non-empty string")
        self.lark  # noqa: B018 (compiles it: a bad constraint fails here, before any work)

    @property
    def kind(self) -> str:
        return self._kinds()[0]

    def schema(self) -> dict[str, Any] | bool | None:
        """The JSON schema (parsed), or None for a non-JSON constraint."""
        if self.json_object:
            return {"type": "object"}
        if self.json is None:
            return None
        if isinstance(self.json, dict):
            return self.json
        try:
            schema = json.loads(self.json)
        except ValueError as e:
            raise ValueError(f"the JSON schema is not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema must be an object (or true/false)")
        return schema

    @cached_property
    def lark(self) -> str:
        """The constraint as llguidance's grammar text; ValueError when it does not compile."""
        from llguidance import LLMatcher

        schema = self.schema()
        try:
            if schema is not None:
                text = json.dumps(schema)
                if len(text) > MAX_SPEC_CHARS:
                    raise ValueError(f"the JSON schema is larger than {MAX_SPEC_CHARS} characters")
                options: Any = {"whitespace_flexible": True} if self.any_whitespace else COMPACT_JSON
                grammar = LLMatcher.grammar_from_json_schema(text, defaults=options)
            elif self.regex is not None:
                grammar = LLMatcher.grammar_from_regex(self._sized(self.regex))
            elif self.choice is not None:
                grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
            else:
                grammar = LLMatcher.grammar_from_lark(self._sized(self.grammar or ""))
        except ValueError as e:
            raise ValueError(f"{self.kind} does not compile: {e}") from None
        error = LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(f"{self.kind} does not compile: {error.strip()}")
        return grammar

    @staticmethod
    def _sized(text: str) -> str:
        if len(text) > MAX_SPEC_CHARS:
            raise ValueError(f"a constraint larger than {MAX_SPEC_CHARS} characters")
        return text


class GuidanceTokenizers:
    """llguidance's view of the tokenizer (every token's bytes), made once per model vocabulary: it
    takes ~2 s for 100k tokens, so the first constrained request of an engine pays it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self._args = (tokenizer, vocab_size, eos_ids)
        self._tok: llguidance.LLTokenizer | None = None

    def get(self) -> llguidance.LLTokenizer:
        if self._tok is None:
            import llguidance.hf

            tokenizer, vocab, eos = self._args
            self._tok = llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=vocab, eos_token=list(eos) or None)
        return self._tok


class Grammar:
    """One request's matcher: which tokens may come next, advanced by each token taken."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, params: StructuredOutputsParams) -> None:
        from llguidance import LLMatcher

        self.matcher = LLMatcher(tokenizer, params.lark, log_level=0)  # errors: ``error``, logged by the engine
        if self.matcher.is_error():
            raise ValueError(f"{params.kind} does not compile: {self.matcher.get_error()}")

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next (the matcher does not move)."""
        return bool(self.matcher.validate_tokens([token]) == 1)

    def draftable(self, tokens: list[int]) -> int:
        """How many of ``tokens``, from the first, may come next one after another, none past one that
        ends the output (after it nothing but the end may follow); the matcher ends where it began."""
        valid = self.matcher.validate_tokens(tokens)
        taken = 0
        while taken < valid and not self.matcher.is_stopped():
            self.matcher.consume_token(tokens[taken])
            taken += 1
        if taken:
            self.matcher.rollback(taken)
        return taken

    def accepting_after(self, tokens: list[int]) -> list[bool]:
        """``accepting`` after each of ``tokens[:0]`` .. ``tokens[:n]`` taken, for tokens it takes
        (``draftable``); the matcher ends where it began."""
        states = [self.accepting]
        for t in tokens:
            self.matcher.consume_token(t)
            states.append(self.accepting)
        if tokens:
            self.matcher.rollback(len(tokens))
        return states

    def advance(self, token: int) -> bool:
        """Take ``token``; False when the grammar does not allow it."""
        return bool(self.matcher.consume_token(token))

    @property
    def error(self) -> str:
        return str(self.matcher.get_error())

    @property
    def done(self) -> bool:
        """Nothing can follow: the output is complete."""
        return bool(self.matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        """The output so far is a complete match (more may still follow)."""
        return bool(self.matcher.is_accepting())


_EXECUTOR: llguidance.LLExecutor | None = None


def _executor() -> llguidance.LLExecutor:
    """llguidance's thread pool for filling several rows' masks at once (one per process)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


def mask_logits(logits: torch.Tensor, grammars: list[Grammar | None]) -> torch.Tensor:
    """logits [N, V] -> the same tensor with, in each row whose request has a grammar (``grammars[i]``,
    None for an unconstrained row), every token the grammar does not allow next at -inf."""
    rows = [(i, g) for i, g in enumerate(grammars) if g is not None]
    return mask_rows(logits, [i for i, _ in rows], [g for _, g in rows]) if rows else logits


def mask_rows(logits: torch.Tensor, rows: list[int], grammars: list[Grammar]) -> torch.Tensor:
    """``logits`` with row ``rows[j]`` masked by ``grammars[j]``, in place. The masks are filled on the host
    before anything waits for the device (on a GPU this overlaps the step still running), into a
    whole-batch bitmask (other rows allow every token) that goes over asynchronously from pinned memory
    and is applied to every row at once: nothing here makes the host wait for the device (an index
    tensor made from a list would, and the sampler's launches after it would then no longer overlap)."""
    import llguidance.numpy as ln

    bitmask = allocate_bitmask(logits.shape[0], logits.shape[-1], pin=logits.is_cuda)
    if len(rows) == 1:
        ln.fill_next_token_bitmask(grammars[0].matcher, bitmask.numpy(), rows[0])
    else:  # rows in parallel on llguidance's threads (16 rows of a medium schema: 0.50 -> 0.36 ms on 2 cores)
        ln.fill_next_token_bitmask_par(_executor(), [(g.matcher, row) for row, g in zip(rows, grammars)],
                                       bitmask.numpy())
    return apply_bitmask(logits, bitmask)


def allocate_bitmask(rows: int, vocab: int, pin: bool = False) -> torch.Tensor:
    """A host bitmask for ``rows`` x ``vocab`` logits, every token allowed: one bit a token, 32 to an int32
    (llguidance's layout); ``pin`` for logits on a GPU, so that the copy over is asynchronous."""
    import torch

    return torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32, pin_memory=pin)


@cache
def _forbidden_table(device: torch.device) -> torch.Tensor:
    """Byte value -> which of its 8 tokens (bit i: token 8 * byte + i) are not allowed, bool [256, 8]."""
    import torch

    return ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1 == 0).to(device)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` [N, V] with every token whose bit in ``bitmask`` (host int32 [N, ceil(V / 32)], llguidance's
    layout) is clear at -inf, in place, in a few plain launches with no host wait.

    Not llguidance.torch's ``apply_token_bitmask_inplace``: that is a ``torch.compile`` function, so the first
    structured request in every process imported torch._dynamo and compiled a kernel (seconds, and a C++
    compiler on CPU nodes; docs/benchmarks.md). Here each byte of the mask looks up its 8 tokens' verdicts in
    a 256-row table (an embedding lookup) and one ``masked_fill_`` applies them."""
    import torch

    n, vocab = logits.shape
    # int32 words are little-endian, so byte t // 8 of a row holds token t's bit as its bit t % 8.
    index = bitmask.view(torch.uint8).to(logits.device, non_blocking=True).long()
    forbidden = torch.nn.functional.embedding(index, _forbidden_table(logits.device)).view(n, -1)
    width = min(forbidden.shape[1], vocab)
    logits[:, :width].masked_fill_(forbidden[:, :width], float("-inf"))
    if width < vocab:  # tokens past the mask's words are not allowed (as in llguidance's own)
        logits[:, width:] = float("-inf")
    return logits


def mask_drafted(logits: torch.Tensor, starts: list[int], grammars: list[Grammar],
                 drafts: list[list[int]]) -> torch.Tensor:
    """Speculative decoding's verify rows (``engine.speculative``): ``logits`` [N, V] with, for each request j,
    its rows ``starts[j]`` to ``starts[j] + len(drafts[j])`` masked in place, row i by ``grammars[j]`` after
    ``drafts[j][:i]``: what single-token decoding would mask there had it taken those drafts. The drafts
    must be ones the grammar takes (``Grammar.draftable``); each matcher is advanced through them on
    llguidance's threads and rolled back, so it ends where it began."""
    import llguidance.numpy as ln

    bitmask = allocate_bitmask(logits.shape[0], logits.shape[-1], pin=logits.is_cuda)
    drafted = [(g.matcher, row, list(d)) for row, g, d in zip(starts, grammars, drafts) if d]
    if drafted:
        ln.fill_next_token_bitmask_par_with_draft_tokens(_executor(), drafted, bitmask.numpy())
    plain = [(g.matcher, row) for row, g, d in zip(starts, grammars, drafts) if not d]  # (llguidance wants drafts)
    if plain:
        ln.fill_next_token_bitmask_par(_executor(), plain, bitmask.numpy())
    return apply_bitmask(logits, bitmask)
