"""Token ids as the client sees them: stop strings found in a turn's text and cut from its ids,
and each token's piece of text for streaming.

- ``stop_cut(ids, stops, decode)``: the engine stops on token ids only; a ``stop`` string of
  several tokens is found in the decoded turn afterwards. Returns the number of leading ids to
  keep (``None``: no stop string occurs): the tokens that decode entirely before the earliest
  stop string. The turn's text is then ``decode(ids[:keep])``, so the ids the session trains
  are exactly the text the client was shown. A stop string that begins inside a token drops
  that whole token (its text before the stop string is not shown either).
- ``pieces(ids, decode)``: the text each token adds (``""`` for a token that ends inside a
  multi-byte character or decodes to nothing), joined equal to ``decode(ids)``; when the
  incremental decode cannot guarantee that (a tokenizer whose decode is not prefix-stable),
  the whole text comes as the last token's piece.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]
_WINDOW = 6  # tokens of left context for decoding one more token (byte-level BPE, SentencePiece)


def stop_cut(ids: Sequence[int], stops: Sequence[str], decode: Decode) -> int | None:
    """How many of ``ids`` to keep before the earliest of ``stops`` (module doc); None: none occurs."""
    if not stops or not ids:
        return None
    text = decode(ids)
    found = [at for at in (text.find(s) for s in stops) if at >= 0]
    if not found:
        return None
    pos = min(found)
    low, high = 0, len(ids)  # decode(ids[:low]) fits before pos; decode(ids[:high]) reaches the stop string
    while high - low > 1:
        mid = (low + high) // 2
        head = decode(ids[:mid])
        if len(head) <= pos and text.startswith(head) and not head.endswith("\ufffd"):
            low = mid
        else:
            high = mid
    return low


def pieces(ids: Sequence[int], decode: Decode) -> tuple[str, ...]:
    """Each token's piece of ``decode(ids)`` (module doc)."""
    out: list[str] = []
    done = 0  # ids[:done] are covered by the pieces so far
    for end in range(1, len(ids) + 1):
        start = max(0, done - _WINDOW)
        head, grown = decode(ids[start:done]), decode(ids[start:end])
        if (grown.endswith("\ufffd") and end < len(ids)) or not grown.startswith(head):
            out.append("")  # wait for the next token (an unfinished character)
            continue
        out.append(grown[len(head) :])
        done = end
    whole = decode(ids)
    if "".join(out) != whole:
        return (*([""] * (len(ids) - 1)), whole) if ids else ()
    return tuple(out)
