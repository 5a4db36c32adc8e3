"""Verifiable task families for learning demos and gates.

``say`` (the ``reef demo`` family): the user asks for one word (``Say file.``, ``Echo window back.``) and the
answer is that word, alone. Why this one: the tiny model can learn it (copy the word it attends to, then stop:
two layers and tied embeddings suffice), the verifier is exact and obvious, and held-out prompts use words that
training never uses, so a rising held-out reward means the model learned the skill, not a lookup table.
Words are the tiny tokenizer's vocabulary words (1030); after a space each is one token for the tokenizer of
any seed tried (bar 0-3 words per seed), so the answer the model learns is that same token (``" file"``: the
verifier ignores surrounding whitespace) followed by ``<|im_end|>``.

Split by ``crc32(word) % 5``, fixed for all seeds: 0 held out (206 words: the gate's and the demo's evaluation),
1 validation (the warm-up's stopping check), 2-4 training (618 words x 6 templates). Held-out and validation
words never occur in any training prompt, so the warm-up, the RL prompts and the gate always agree.

Score: 1.0 for the exact word; partial credit below 0.5 otherwise (``SayWord.score``), which gives prompts whose
samples are all wrong some signal. ``exact`` is the 0/1 metric; reward targets ("held-out 0.8") are exact matches.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    prompt: str  # the user message
    answer: str  # what the verifier wants


class TaskFamily:
    """A family of verifiable tasks: training prompts, disjoint held-out prompts, a verifier."""

    name = ""

    def sample(self, rng: random.Random) -> Task:
        raise NotImplementedError

    def train_tasks(self, seed: int = 0) -> list[Task]:
        raise NotImplementedError

    def held_out(self, n: int, seed: int = 0) -> list[Task]:
        raise NotImplementedError

    def validation(self, n: int, seed: int = 0) -> list[Task]:
        """Prompts disjoint from both training and held-out ones, for decisions such as when the warm-up stops."""
        raise NotImplementedError

    def score(self, task: Task, completion: str) -> float:
        raise NotImplementedError

    def exact(self, task: Task, completion: str) -> float:
        return float(self.score(task, completion) >= 1.0)

    def target(self, task: Task) -> str:
        """The completion text supervised learning (the warm-up) teaches for ``task``."""
        return task.answer


def _vocabulary() -> list[str]:
    from daemon.models import _WORDS  # the words the tiny tokenizer was trained on

    return sorted(set(_WORDS))


class SayWord(TaskFamily):
    name = "say"
    templates = (
        "Say {w}.",
        "Repeat {w}.",
        "Echo {w} back.",
        "Write {w}, nothing else.",
        "Please say {w}!",
        "Reply with {w} only.",
    )

    def __init__(self, words: list[str] | None = None) -> None:
        words = sorted(set(words or _vocabulary()))
        part = {w: zlib.crc32(w.encode()) % 5 for w in words}
        self.held_words = [w for w in words if part[w] == 0]
        self.validation_words = [w for w in words if part[w] == 1]
        self.train_words = [w for w in words if part[w] >= 2]

    def _task(self, word: str, template: str) -> Task:
        return Task(prompt=template.format(w=word), answer=word)

    def sample(self, rng: random.Random) -> Task:
        """A random training task."""
        return self._task(rng.choice(self.train_words), rng.choice(self.templates))

    def train_tasks(self, seed: int = 0) -> list[Task]:
        """Every training prompt (word x template), shuffled by ``seed``."""
        tasks = [self._task(w, t) for w in self.train_words for t in self.templates]
        random.Random(seed).shuffle(tasks)
        return tasks

    def held_out(self, n: int, seed: int = 0) -> list[Task]:
        """``n`` held-out prompts: distinct words never used for training (cycling if ``n`` exceeds them)."""
        return self._pick(self.held_words, n, f"held-out:{seed}")

    def validation(self, n: int, seed: int = 0) -> list[Task]:
        return self._pick(self.validation_words, n, f"validation:{seed}")

    def _pick(self, pool: list[str], n: int, key: str) -> list[Task]:
        rng = random.Random(key)
        words = rng.sample(pool, len(pool))
        return [self._task(words[i % len(words)], rng.choice(self.templates)) for i in range(n)]

    def target(self, task: Task) -> str:
        return " " + task.answer  # the word's own token (as it appears in the prompt), see the module docstring

    def score(self, task: Task, completion: str) -> float:
        """1.0: exactly the word (surrounding whitespace ignored). Partial credit, always < 0.5 so it never
        passes for right: 0.4 if the answer's first word is the word (it did not stop), 0.2 if the word is
        elsewhere in the answer, else 0."""
        words, word = completion.split(), task.answer
        if words == [word]:
            return 1.0
        bare = [w.strip(".,;:!?\"'`") for w in words]
        if bare and bare[0] == word:
            return 0.4
        return 0.2 if word in bare else 0.0


FAMILIES: dict[str, type[TaskFamily]] = {SayWord.name: SayWord}


def get_family(name: str) -> TaskFamily:
    try:
        return FAMILIES[name]()
    except KeyError:
        raise ValueError(f"unknown task family {name!r}; known: {', '.join(sorted(FAMILIES))}") from None


# --- single problems with a continuous score (ttt-discover: one problem, many attempts) ------------------------


class Problem:
    """One problem asked again and again, and a continuous score of an attempt (higher is better)."""

    name = ""
    prompt = ""

    def score(self, completion: str) -> float:
        raise NotImplementedError


class LongestWord(Problem):
    """``longest-word``: "Say one long word." The score of an attempt is the length of the word it answers
    with over the longest word the tiny tokenizer knows (12 letters: ``conversation``, ``professional``), when the
    answer is one known word; half that when a known word comes first and more follows; 0 otherwise.

    Why this one: the score is continuous (12 levels), the best is known and rare (2 of 1030 words have 12 letters,
    9 have 11), and the demo model, warmed up to say one word and stop, starts by copying a word of the prompt
    (``Answer``: 6/12) or sampling another word at temperature 1, so the best attempt has room to rise through
    search and the mean through learning where the long words are."""

    name = "longest-word"
    prompt = "Say one long word."

    def __init__(self, words: list[str] | None = None) -> None:
        self.words = set(words or _vocabulary())
        self.longest = max(len(w) for w in self.words)

    def score(self, completion: str) -> float:
        bare = [w.strip(".,;:!?\"'`") for w in completion.split()]
        if not bare or bare[0] not in self.words:
            return 0.0
        full = len(bare[0]) / self.longest
        return full if len(bare) == 1 else full / 2


class ManyWords(Problem):
    """``many-words``: "Say many different words." The score is the number of distinct words the tiny tokenizer
    knows in the answer over ``target`` (10), capped at 1."""

    name = "many-words"
    prompt = "Say many different words."
    target = 10

    def __init__(self, words: list[str] | None = None) -> None:
        self.words = set(words or _vocabulary())

    def score(self, completion: str) -> float:
        bare = {w.strip(".,;:!?\"'`") for w in completion.split()}
        return min(1.0, len(bare & self.words) / self.target)


PROBLEMS: dict[str, type[Problem]] = {LongestWord.name: LongestWord, ManyWords.name: ManyWords}


def get_problem(name: str) -> Problem:
    try:
        return PROBLEMS[name]()
    except KeyError:
        raise ValueError(f"unknown problem {name!r}; known: {', '.join(sorted(PROBLEMS))}") from None
