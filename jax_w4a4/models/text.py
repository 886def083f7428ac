"""Real English prose for accuracy measurements: the Python documentation that ships with CPython.

``pydoc_data.topics`` (part of every CPython standard library) holds the language reference's help
topics as plain reStructuredText-rendered text: about half a megabyte of technical English. This module
keeps its prose paragraphs (it drops headings, code samples, grammar productions and tables) and splits
them into sentences:

    paragraphs()   # ≈ 3k paragraphs of running text (for perplexity)
    sentences()    # ≈ 3k sentences of 6–64 words (for sentence embeddings)

The text depends on the Python version (the docs change between releases); within one version the
output is deterministic.
"""

from __future__ import annotations

import functools
import re

_UNDERLINE = re.compile(r"^\s*([*=\-~^\"'`#+])\1{2,}\s*$")
_CODE_MARKERS = ("::=", ">>>", "...", "{", "}", "==", "->", "+---", "|")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"(])")
_ABBREVIATION_END = re.compile(r"\b(e\.g|i\.e|etc|vs|cf|Mr|Dr|No)\.$")
_WORD = re.compile(r"[A-Za-z]+(?:'[a-z]+)?")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _is_prose_block(lines: list[str]) -> bool:
    """A block of text is prose when it reads like sentences: not code, a heading or a table."""
    if any(_UNDERLINE.match(line) for line in lines):
        return False
    if len({_indent(line) for line in lines}) > 1:  # code and grammar blocks are ragged
        return False
    text = " ".join(line.strip() for line in lines)
    if any(marker in text for marker in _CODE_MARKERS):
        return False
    words = text.split()
    if len(words) < 6 or not text.rstrip().endswith((".", "?", "!", ":")):
        return False
    letters = sum(ch.isalpha() or ch.isspace() for ch in text)
    return letters / len(text) >= 0.85


def extract_paragraphs(text: str) -> list[str]:
    """Splits documentation text into blank-line-separated blocks and keeps the prose ones.

    Args:
      text: plain text (reStructuredText as rendered by pydoc: headings underlined, code indented).

    Returns:
      The prose paragraphs, each on one line with whitespace collapsed, in document order.
    """
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.splitlines() if line.strip()]
        if lines and _is_prose_block(lines):
            paragraphs.append(" ".join(" ".join(lines).split()))
    return paragraphs


def extract_sentences(text: str, *, min_words: int = 6, max_words: int = 64) -> list[str]:
    """Sentences of the prose paragraphs of ``text`` (see :func:`extract_paragraphs`).

    A sentence starts with a capital letter (or a quote / parenthesis), ends with ``.``, ``?`` or
    ``!``, has ``min_words``..``max_words`` words and is mostly letters. Duplicates are dropped (first
    occurrence kept).
    """
    if min_words < 1 or max_words < min_words:
        raise ValueError(f"extract_sentences: need 1 <= min_words <= max_words, got {min_words}, {max_words}")
    seen: set[str] = set()
    result = []
    for paragraph in extract_paragraphs(text):
        pieces = _SENTENCE_END.split(paragraph)
        merged: list[str] = []
        for piece in pieces:  # re-join splits made after abbreviations such as "e.g."
            if merged and _ABBREVIATION_END.search(merged[-1]):
                merged[-1] = f"{merged[-1]} {piece}"
            else:
                merged.append(piece)
        for sentence in merged:
            words = sentence.split()
            if not (min_words <= len(words) <= max_words):
                continue
            if not (sentence[0].isupper() or sentence[0] in "\"(") or not sentence.endswith((".", "?", "!")):
                continue
            if len(_WORD.findall(sentence)) < 0.8 * len(words) or sentence in seen:
                continue
            seen.add(sentence)
            result.append(sentence)
    return result


def _python_docs() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


@functools.cache
def paragraphs() -> tuple[str, ...]:
    """The prose paragraphs of CPython's bundled documentation (``pydoc_data.topics``)."""
    return tuple(extract_paragraphs(_python_docs()))


@functools.cache
def sentences() -> tuple[str, ...]:
    """The sentences of CPython's bundled documentation, 6–64 words each, deduplicated."""
    return tuple(extract_sentences(_python_docs()))
