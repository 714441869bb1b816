"""Retrieval tasks generated offline: passkey, needle in a haystack, key-value lookup.

Each trial is a prompt of about ``context - max_new_tokens`` tokens with one fact hidden at a
given depth (the fraction of the filler placed before it) and a question at the end, answered by
greedy generation through :class:`oasiskv.LLM` (dense prefill, then dense or sparse decode, as a
user would run it). Trials are a pure function of (task, context, trial index, seed), and depths
cycle through ``depths``.

* ``passkey`` — the classic filler ("The grass is green. The sky is blue. ...") with
  "The pass key is 12345. Remember it." inside; the answer is the 5-digit key.
* ``needle`` — held-out corpus text as the haystack with "The special magic number for <word>
  is 1234567." inside; the answer is the 7-digit number.
* ``kv`` — a JSON object of random 8-hex-digit keys and values; the question names one key
  (placed at the depth); the answer is its value.
* ``copy`` — exact copy out of a long source file: generated Python (functions, constants, and
  ``TOKEN_<WORD> = "<code>"`` lines, each with its own random code) where one line, at the depth,
  holds the code the question asks for; the answer is that 11-character code (``xxxxx-xxxxx``,
  lower-case letters and digits). Every other token line is a near-distractor: same shape, other
  word, other code, so only an exact read of the right line scores. Not in the default task list
  (``--retrieval-tasks copy``).
* ``copy-digits`` — the same file with 7-digit codes (``TOKEN_<WORD> = "4829137"``) on the
  asked line and on every distractor token line: SmolLM2-135M answers the ``copy`` question with
  a digit whatever the code, so at its size only digit codes tell selections apart.

Scoring: ``passkey``/``needle``/``copy-digits`` — the first integer in the generated text equals
the answer;
``kv``/``copy`` — the generated text, stripped of spaces and quotes, starts with the value.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

TASKS = ("passkey", "needle", "kv", "copy", "copy-digits")
#: The tasks ``oasis eval`` runs unless ``--retrieval-tasks`` says otherwise.
DEFAULT_TASKS = ("passkey", "needle", "kv")
MAX_NEW_TOKENS = {"passkey": 10, "needle": 12, "kv": 14, "copy": 16, "copy-digits": 12}
#: Tasks scored by the first integer of the answer.
_INTEGER_TASKS = ("passkey", "needle", "copy-digits")
_CODE_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"

_PASSKEY_HEAD = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n\n"
)
_PASSKEY_FILLER = [
    "The grass is green. ",
    "The sky is blue. ",
    "The sun is yellow. ",
    "Here we go. ",
    "There and back again. ",
]
_WORDS = (
    "apple river mountain violet harbor lantern meadow copper falcon glacier orchid thunder "
    "cedar compass ember marble willow saffron canyon beacon quartz juniper tundra velvet "
    "sparrow cobalt prairie summit lagoon topaz"
).split()


def _rng(task: str, context: int, trial: int, seed: int) -> random.Random:
    return random.Random(f"{seed}:{task}:{context}:{trial}")


class _Lengths:
    """Token counts of text pieces, cached (pieces repeat a lot)."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self._cache: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        n = self._cache.get(text)
        if n is None:
            n = self._cache[text] = len(self.tok.encode(text))
        return n


def _assemble(
    lengths: _Lengths, head: str, units: Sequence[str], needle: str, depth: float, tail: str, n_tokens: int
) -> tuple[str, float]:
    """head + filler units (cycled) with ``needle`` after the first ``depth`` share of them + tail,
    with as many units as keep the whole prompt within ``n_tokens`` tokens (pieces tokenize a bit
    shorter together than apart, so the budget is corrected from the measured length a few times).
    Returns (text, actual depth)."""
    if not units:
        raise ValueError("no filler units")

    def build(budget: int) -> list[str]:
        chosen: list[str] = []
        total = 0
        for i in range(100 * n_tokens):
            u = units[i % len(units)]
            if total + lengths(u) > budget:
                break
            chosen.append(u)
            total += lengths(u)
        return chosen

    def render(chosen: list[str]) -> tuple[str, float]:
        pos = round(depth * len(chosen))
        text = head + "".join(chosen[:pos]) + needle + "".join(chosen[pos:]) + tail
        return text, (pos / len(chosen) if chosen else 0.0)

    budget = n_tokens - lengths(head) - lengths(needle) - lengths(tail)
    best: list[str] = []
    for _ in range(6):
        chosen = build(budget)
        n = len(lengths.tok.encode(render(chosen)[0]))
        if n <= n_tokens:
            best = chosen if len(chosen) > len(best) else best
            if n_tokens - n <= max(8, n_tokens // 100):
                break
            budget += n_tokens - n
        else:
            budget -= n - n_tokens
    while best and len(lengths.tok.encode(render(best)[0])) > n_tokens:
        best.pop()
    return render(best)


def _code(rng: random.Random) -> str:
    return (
        "".join(rng.choice(_CODE_CHARS) for _ in range(5))
        + "-"
        + "".join(rng.choice(_CODE_CHARS) for _ in range(5))
    )


def _digit_code(rng: random.Random) -> str:
    return str(rng.randint(1000000, 9999999))


def _source_units(rng: random.Random, word: str, code=_code) -> list[str]:
    """Filler of the ``copy`` tasks: a few hundred small Python units (functions, constants and
    distractor token lines with ``code(rng)`` codes), none naming ``word``'s token."""
    others = [w for w in _WORDS if w != word]
    units = []
    for i in range(600):
        a, b = rng.choice(others), rng.choice(others)
        kind = i % 6
        if kind == 0:
            units.append(
                f"\ndef {a}_{b}_{i}(x):\n    return x * {rng.randint(2, 97)} + {rng.randint(100, 9999)}\n"
            )
        elif kind == 2:
            units.append(f"{a.upper()}_{b.upper()}_LIMIT = {rng.randint(1, 65535)}\n")
        elif kind == 4:
            units.append(f"# {a} before {b}\n")
        else:
            units.append(f'TOKEN_{a.upper()}_{i} = "{code(rng)}"\n')
    return units


def make_trial(
    task: str,
    tokenizer,
    context: int,
    trial: int,
    depth: float,
    *,
    haystack_lines: Sequence[str] = (),
    seed: int = 0,
    lengths: _Lengths | None = None,
) -> dict:
    """One trial: ``{"task", "trial", "depth", "prompt", "answer", "max_new_tokens"}``."""
    if task not in TASKS:
        raise ValueError(f"unknown retrieval task {task!r}; use one of {TASKS}")
    rng = _rng(task, context, trial, seed)
    lengths = lengths or _Lengths(tokenizer)
    max_new = MAX_NEW_TOKENS[task]
    n_tokens = context - max_new
    if task == "passkey":
        key = str(rng.randint(10000, 99999))
        needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
        tail = "\n\nWhat is the pass key? The pass key is"
        text, d = _assemble(lengths, _PASSKEY_HEAD, _PASSKEY_FILLER, needle, depth, tail, n_tokens)
        answer = key
    elif task == "needle":
        if not haystack_lines:
            raise ValueError("the needle task needs haystack_lines (held-out corpus text)")
        word = rng.choice(_WORDS)
        num = str(rng.randint(1000000, 9999999))
        needle = f"\nThe special magic number for {word} is: {num}.\n"
        head = "Below is some text. A special magic number is hidden in it. Memorize it.\n\n"
        tail = f"\n\nWhat is the special magic number for {word}? The special magic number for {word} is:"
        start = rng.randrange(max(1, len(haystack_lines)))
        lines = list(haystack_lines[start:]) + list(haystack_lines[:start])
        text, d = _assemble(lengths, head, lines, needle, depth, tail, n_tokens)
        answer = num
    elif task == "kv":
        n_pairs = max(4, n_tokens // 6)
        pairs = [(f"{rng.getrandbits(32):08x}", f"{rng.getrandbits(32):08x}") for _ in range(n_pairs + 1)]
        qkey, qval = pairs[-1]
        head = "Extract the value corresponding to the specified key in the JSON object below.\n\n{\n"
        units = [f'  "{k}": "{v}",\n' for k, v in pairs[:-1]]
        needle = f'  "{qkey}": "{qval}",\n'
        tail = f'}}\n\nKey: "{qkey}"\nThe value associated with the specified key is: "'
        text, d = _assemble(lengths, head, units, needle, depth, tail, n_tokens)
        answer = qval
    elif task in ("copy", "copy-digits"):
        word = rng.choice(_WORDS)
        name = f"TOKEN_{word.upper()}"
        make_code = _code if task == "copy" else _digit_code
        code = make_code(rng)
        head = '"""Service configuration and helpers (generated)."""\n\nimport os\n\n'
        needle = f'{name} = "{code}"\n'
        tail = f'\n\n# Question: what is the exact value of {name} in the file above?\n# Answer: {name} = "'
        text, d = _assemble(lengths, head, _source_units(rng, word, make_code), needle, depth, tail, n_tokens)
        answer = code
    if len(tokenizer.encode(text)) > n_tokens:
        raise ValueError(
            f"a {context}-token context is too small for the {task} task (its instructions alone do not fit)"
        )
    return {
        "task": task,
        "trial": trial,
        "depth": depth,
        "actual_depth": d,
        "prompt": text,
        "answer": answer,
        "max_new_tokens": max_new,
    }


def score(task: str, answer: str, generated: str) -> bool:
    if task not in TASKS:
        raise ValueError(f"unknown retrieval task {task!r}; use one of {TASKS}")
    if task in _INTEGER_TASKS:
        m = re.search(r"\d+", generated)
        return m is not None and m.group(0) == answer
    return generated.strip().lstrip("\"' ").startswith(answer)


def decided(task: str, answer: str, generated: str) -> bool:
    """True when no continuation of ``generated`` can change :func:`score` (so generation can stop
    there with the same outcome): for ``passkey``/``needle`` once the first integer is followed by
    another character or is no longer a prefix of the answer; for ``kv`` once the stripped text
    is as long as the answer or no longer a prefix of it. Never while the text ends in U+FFFD: a
    partial character, which a later token may complete (into whitespace, say)."""
    if generated.endswith("\ufffd"):
        return False
    if task in _INTEGER_TASKS:
        m = re.search(r"\d+", generated)
        return m is not None and (m.end() < len(generated) or not answer.startswith(m.group(0)))
    s = generated.strip().lstrip("\"' ")
    return bool(s) and (len(s) >= len(answer) or not answer.startswith(s))


def make_trials(
    tokenizer,
    tasks: Sequence[str],
    context: int,
    trials: int,
    depths: Sequence[float],
    *,
    haystack_lines: Sequence[str] = (),
    seed: int = 0,
) -> list[dict]:
    """``trials`` trials per task, depth ``depths[i % len(depths)]`` for trial i."""
    lengths = _Lengths(tokenizer)
    out = []
    for task in tasks:
        for i in range(trials):
            out.append(
                make_trial(
                    task,
                    tokenizer,
                    context,
                    i,
                    depths[i % len(depths)],
                    haystack_lines=haystack_lines,
                    seed=seed,
                    lengths=lengths,
                )
            )
    return out
