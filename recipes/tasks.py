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

import math
import random
import shlex
import subprocess
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


class _Split(TaskFamily):
    """Tasks of a template and an item, the items split by ``crc32(item) % 5``: 0 held out, 1 validation, 2-4
    training. A family says what a task of an item and a template is (``_task``) and how ``n`` are drawn
    (``_pick``)."""

    templates: tuple[str, ...] = ()

    def __init__(self, items: list[str]) -> None:
        items = sorted(set(items))
        part = {x: zlib.crc32(x.encode()) % 5 for x in items}
        self.held_items = [x for x in items if part[x] == 0]
        self.validation_items = [x for x in items if part[x] == 1]
        self.train_items = [x for x in items if part[x] >= 2]

    def sample(self, rng: random.Random) -> Task:
        """A random training task."""
        return self._task(rng.choice(self.train_items), rng.choice(self.templates))

    def train_tasks(self, seed: int = 0) -> list[Task]:
        """Every training prompt (item x template), shuffled by ``seed``."""
        tasks = [self._task(x, t) for x in self.train_items for t in self.templates]
        random.Random(seed).shuffle(tasks)
        return tasks

    def held_out(self, n: int, seed: int = 0) -> list[Task]:
        """``n`` held-out prompts, of items never used for training."""
        return self._pick(self.held_items, n, f"held-out:{seed}")

    def validation(self, n: int, seed: int = 0) -> list[Task]:
        return self._pick(self.validation_items, n, f"validation:{seed}")

    def _task(self, item: str, template: str) -> Task:
        raise NotImplementedError  # each family's own

    def _pick(self, pool: list[str], n: int, key: str) -> list[Task]:
        raise NotImplementedError  # each family's own


class SayWord(_Split):
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
        super().__init__(words or _vocabulary())

    def _task(self, word: str, template: str) -> Task:
        return Task(prompt=template.format(w=word), answer=word)

    def _pick(self, pool: list[str], n: int, key: str) -> list[Task]:
        """``n`` distinct words from ``pool`` (cycling only past all of them), each with a random template."""
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


class YesNoFirst(_Split):
    """``yes-no`` (the ``reef demo --model smollm2`` preference): the user asks a yes/no question (``Can cats
    swim?``) and wants the answer to start with ``Yes`` or ``No``, the direct answer first, whatever follows.

    Why this one: a person sees it at a glance, and SmolLM2-135M-Instruct does not have it: greedy, it opens with
    a sentence about the subject (``Cats are known for...``), 0 of 16 questions tried; sampled at temperature 1 it
    opens with Yes or No about 16% of the time, which is what RL needs (most groups of 8 samples hold one). The
    verifier looks at the first word only, so answers need only a few tokens (``max_new_tokens`` 8: cheap on a
    CPU). It does not check that the answer is true (a 135M model's facts are not the point: the preference is).

    Questions are templates over plural nouns (``Can {x} swim?``), split by ``crc32(noun) % 5`` like ``say``: 0
    held out, 1 validation (the gate's), 2-4 training. Score: 1.0 when the first word is yes or no (any case,
    punctuation ignored); 0.3 when yes or no comes later in the answer (``The answer is yes``: closer); else 0.
    """

    name = "yes-no"
    nouns = (
        "cats dogs horses cows sheep goats pigs rabbits mice rats bats owls eagles ducks geese chickens penguins "
        "parrots crows pigeons frogs toads snakes lizards turtles crocodiles sharks whales dolphins salmon trout "
        "crabs lobsters snails worms bees ants spiders butterflies mosquitoes elephants giraffes lions tigers "
        "bears wolves foxes deer camels zebras monkeys gorillas kangaroos koalas squirrels hedgehogs "
        "apples bananas oranges lemons grapes strawberries cherries peaches pears tomatoes potatoes carrots onions "
        "cabbages mushrooms peanuts almonds eggs cookies cakes sandwiches pizzas noodles cheeses "
        "chairs tables beds sofas lamps clocks mirrors windows doors keys coins books pencils pens scissors "
        "hammers nails bottles cups plates spoons forks knives candles pillows blankets shoes socks hats gloves "
        "umbrellas bicycles cars buses trains boats ships airplanes rockets balloons kites phones computers "
        "televisions radios cameras guitars pianos drums violins trumpets rocks pebbles bricks diamonds "
        "mountains rivers lakes clouds volcanoes deserts forests islands stars planets rainbows snowflakes "
        "raindrops trees flowers roses tulips cactuses ferns leaves seeds acorns"
    ).split()
    templates = (
        "Can {x} swim?",
        "Can {x} fly?",
        "Are {x} alive?",
        "Are {x} animals?",
        "Do {x} need water?",
        "Can you eat {x}?",
        "Are {x} bigger than a house?",
        "Are {x} made of metal?",
        "Do people keep {x} at home?",
        "Can {x} talk?",
        "Are {x} heavy?",
        "Do {x} live in the sea?",
    )
    words = frozenset({"yes", "no"})

    def __init__(self) -> None:
        super().__init__(self.nouns)

    def _task(self, noun: str, template: str) -> Task:
        return Task(prompt=template.format(x=noun), answer="")

    def _pick(self, pool: list[str], n: int, key: str) -> list[Task]:
        """``n`` distinct (noun, template) questions from ``pool`` (cycling only past all of them)."""
        rng = random.Random(key)
        pairs = [(x, t) for x in pool for t in self.templates]
        rng.shuffle(pairs)
        return [self._task(*pairs[i % len(pairs)]) for i in range(n)]

    def target(self, task: Task) -> str:
        return "Yes."

    def score(self, task: Task, completion: str) -> float:
        bare = [w.strip(".,;:!?\"'`*").lower() for w in completion.split()]
        if bare and bare[0] in self.words:
            return 1.0
        return 0.3 if self.words & set(bare) else 0.0


FAMILIES: dict[str, type[TaskFamily]] = {SayWord.name: SayWord, YesNoFirst.name: YesNoFirst}


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


class ScorerFailed(RuntimeError):
    """A user's scorer command could not score an attempt: the evaluation could not run (never a score of 0)."""


class CommandScorer(Problem):
    """A user's own problem, scored by their command (ttt-discover's ``scorer`` setting): the attempt's text on
    stdin, its score (a finite number, higher is better) on the last line of stdout, exit status 0. Anything else
    (not found, a non-zero exit, no number, longer than ``timeout_s``) is a ``ScorerFailed`` naming the command and
    what it did: the step that needed the score fails with that reason, and no attempt is scored 0 for it."""

    name = "scorer"

    def __init__(self, argv: list[str], timeout_s: float) -> None:
        self.argv, self.timeout_s = list(argv), timeout_s

    def score(self, completion: str) -> float:
        cmd = shlex.join(self.argv)
        try:
            done = subprocess.run(self.argv, input=completion, capture_output=True, text=True,
                                  timeout=self.timeout_s)
        except FileNotFoundError:
            raise ScorerFailed(f"scorer {cmd}: {self.argv[0]} not found") from None
        except subprocess.TimeoutExpired:
            raise ScorerFailed(f"scorer {cmd} took longer than {self.timeout_s:g} s (scorer_timeout_s)") from None
        if done.returncode != 0:
            raise ScorerFailed(f"scorer {cmd} exited {done.returncode}: {done.stderr.strip()[-300:]!r}")
        lines = done.stdout.strip().splitlines()
        try:
            value = float(lines[-1])
        except (IndexError, ValueError):
            raise ScorerFailed(f"scorer {cmd} printed {done.stdout.strip()[-200:]!r}, not a score (a number on "
                               "its last line)") from None
        if not math.isfinite(value):
            raise ScorerFailed(f"scorer {cmd} printed {value}, not a finite score")
        return value


PROBLEMS: dict[str, type[Problem]] = {LongestWord.name: LongestWord, ManyWords.name: ManyWords}


def get_problem(name: str) -> Problem:
    try:
        return PROBLEMS[name]()
    except KeyError:
        raise ValueError(f"unknown problem {name!r}; known: {', '.join(sorted(PROBLEMS))}") from None
