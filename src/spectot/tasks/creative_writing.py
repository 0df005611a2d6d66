"""Tree-of-Thoughts Creative Writing (Yao et al. 2023): inputs and the chain-of-thought prompt.

Each input line holds four sentences; the passage's four paragraphs must end with them, in order.
The prompt is the ToT repository's ``cot_prompt`` (src/tot/prompts/text.py), paraphrase-free
because models were evaluated with exactly this text.
"""

from __future__ import annotations

from pathlib import Path

from spectot.data.jsonl import DataError

COT_PROMPT = (
    "Write a coherent passage of 4 short paragraphs. The end sentence of each paragraph must be: {input}\n\n"
    "Make a plan then write. Your output should be of the following format:\n\nPlan:\nYour plan here.\n\n"
    "Passage:\nYour passage here."
)


def read_inputs(path: str | Path, offset: int = 0, limit: int = 0) -> list[str]:
    """Lines ``offset``, ``offset + 1``, ... (``limit`` of them, 0 = all) of a ToT text file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    lines = path.read_text(encoding="utf-8").split("\n")
    picked = []
    for number, line in enumerate(lines, start=1):
        if number <= offset:
            continue
        if not line.strip():
            continue
        picked.append(line)
        if limit and len(picked) == limit:
            break
    return picked


def cot_prompt(sentences: str) -> str:
    return COT_PROMPT.format(input=sentences + "\n")
