"""Constrained decoding: an answer that must follow a grammar (a JSON schema, any JSON object), by llguidance.

llguidance (a Rust library with no Python dependencies) keeps the grammar's state on the host and gives, for
each next token, a bitmask of the tokens the grammar allows, in well under a millisecond; the mask goes to
the device and the sampler draws among the allowed tokens (`Sampler(..., allowed=...)`). The grammar can wait
for the reasoning to close: with thinking on, the answer runs free until the template's `</think>` token and
the constraint starts after it, so the JSON lands in the content, as vLLM's reasoning parsers arrange.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..formats.errors import StreamoeError

BITS = mx.array(np.arange(32, dtype=np.uint32))


def guide_tokenizer(tokenizer, vocab: int, stop_ids: set[int]):
    """llguidance's view of the model's tokenizer (`tokenizers.Tokenizer`), made once per model: ~0.1 s at a
    4K vocabulary, ~1 s at the real one."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab, eos_token=sorted(stop_ids))


def json_grammar(schema: dict | None) -> str:
    """The grammar of a JSON value following `schema` (None: any JSON object). A schema llguidance cannot
    compile is the request's fault: StreamoeError with its message."""
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"})
    except (ValueError, TypeError, RuntimeError) as e:
        raise StreamoeError(f"the JSON schema does not compile ({str(e).splitlines()[0][:200]})") from None


class Constraint:
    """The grammar an answer follows, from the token after `after` (None: from the first token)."""

    def __init__(self, tokens, grammar: str, vocab: int, after: int | None = None):
        import llguidance

        err = llguidance.LLMatcher.validate_grammar(grammar, tokens)
        if err and not err.startswith("WARNING"):
            raise StreamoeError(f"the grammar does not compile ({err.splitlines()[0][:200]})")
        self.matcher = llguidance.LLMatcher(tokens, grammar, log_level=0)
        self.vocab, self.after, self.active = vocab, after, after is None

    def allowed(self) -> mx.array | None:
        """[V] bool of the tokens the grammar allows next; None while the answer runs free."""
        if not self.active:
            return None
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint32)
        bits = (mx.array(words)[:, None] >> BITS) & 1
        return bits.reshape(-1)[: self.vocab].astype(mx.bool_)

    def advance(self, tok: int) -> None:
        """Feed the token drawn. A token the grammar refuses cannot be drawn from its mask; it would leave the
        matcher in its error state, which ends the constraint rather than the answer."""
        if not self.active:
            self.active = tok == self.after
            return
        self.matcher.consume_token(tok)
        if self.matcher.is_error():
            self.active = False
