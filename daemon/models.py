"""The tiny model: a local stand-in for a real LLM, built on the spot (nothing may be downloaded at run time).

``init_tiny(dest)`` writes a Hugging Face model directory that ``AutoTokenizer`` / ``AutoModelForCausalLM`` load:

- a byte-level BPE tokenizer (4096 entries) trained with ``tokenizers`` on a synthetic corpus (400 kB) shaped
  like what coding agents send (agent instructions, prose, JSON, tool schemas, code, markdown, tool calls): an
  80 kB Claude-Code-like request becomes about 21k tokens, other English or code about 2.5 characters a token;
  ChatML special tokens and a ``chat_template`` that renders system/user/assistant/tool messages, assistant tool
  calls and a ``tools`` list;
- a ``LlamaForCausalLM`` with random weights (2 layers, width 64, 4 heads) and a 65536-token context.

Everything derives from ``seed``, so a build is reproducible byte for byte. The directory is written next to
``dest`` and renamed into place, so ``dest`` is either absent or complete. The build itself takes about 0.3 s
on 2 cores; importing torch and transformers takes longer (2-4 s).

``build_tiny`` (tokenizer and model objects, no files) and ``save_model`` are the seams for later steps such as a
supervised warm-up (``recipes/warmup.py``, next to the task families it trains on): build, change the weights,
save. This module knows no recipe and no task family.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon import durable
from daemon.hf import LOAD_LOCK, no_progress_bars

if TYPE_CHECKING:  # heavy imports where they are used
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

CHAT_TEMPLATE = (
    "{%- set has_system = messages and messages[0].role == 'system' %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if has_system %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are within <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, answer with a JSON object within <tool_call></tool_call> tags:\\n'"
    ' + \'<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif has_system %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and has_system) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function or call %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + fn.name | tojson + ', \"arguments\": ' }}"
    "{{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 4096
    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    max_position_embeddings: int = 65536
    corpus_chars: int = 400_000


# The ``reef demo`` model (``tiny-demo``): the tiny model's tokenizer and width, a narrower MLP and 2 heads.
# Chosen with bench/learning_offline.py (one torch thread): from its warm-up, online RL reached held-out 0.8 in
# 250-400 steps of 32 samples for every seed tried, where the default shape stalled for some seeds.
DEMO_CONFIG = TinyConfig(intermediate_size=64, num_attention_heads=2)


def init_tiny(
    dest: Path,
    *,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    config: TinyConfig | None = None,
    transform: Callable[[Any, Any], None] | None = None,
) -> Path:
    """Build the tiny model into ``dest`` (atomically) unless a complete one is already there; return ``dest``.

    ``transform(tokenizer, model)`` changes the weights before they are saved (``recipes/warmup.py`` gives the
    ``reef demo`` model its warm-up this way). A directory already at ``dest`` is kept whatever it was built
    with, so give a transformed model its own ``dest``."""
    dest = Path(dest)
    if config is None:
        config = TinyConfig()
    if is_complete(dest):
        return dest
    say = progress or (lambda _msg: None)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        tokenizer, model = build_tiny(seed=seed, config=config, progress=say)
        if transform is not None:
            transform(tokenizer, model)
        say("saving")
        save_model(tokenizer, model, tmp)
        move_into_place(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in REQUIRED_FILES)


def build_tiny(*, seed: int = 0, config: TinyConfig = TinyConfig(), progress: Callable[[str], None] | None = None
               ) -> tuple[PreTrainedTokenizerFast, LlamaForCausalLM]:
    """The tokenizer (``PreTrainedTokenizerFast``) and a random-weight ``LlamaForCausalLM``, in memory. Holds the
    process's transformers lock (``daemon/hf.py``): a load in another thread must not patch the initialisers meanwhile."""
    with LOAD_LOCK:
        return _build_tiny(seed, config, progress)


def _build_tiny(seed: int, config: TinyConfig, progress: Callable[[str], None] | None
                ) -> tuple[PreTrainedTokenizerFast, LlamaForCausalLM]:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    say = progress or (lambda _msg: None)
    say("training tokenizer")
    tokenizer = train_tokenizer(corpus(seed, config.corpus_chars), config.vocab_size, config.max_position_embeddings)
    say("initialising weights")
    ids: dict[str, int] = {}
    for token in SPECIAL_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)  # int | list[int]: one token in, one id out
        assert isinstance(token_id, int), (token, token_id)
        ids[token] = token_id
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=eos,
        pad_token_id=ids["<|endoftext|>"],
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):  # seeded weights without touching the process-wide RNG
        torch.manual_seed(seed)
        model = LlamaForCausalLM(model_config).eval()  # type: ignore[no-untyped-call]  # transformers: unannotated
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]  # transformers: unannotated
        bos_token_id=ids["<|endoftext|>"], eos_token_id=eos, pad_token_id=ids["<|endoftext|>"]
    )
    return tokenizer, model


def move_into_place(tmp: Path, dest: Path) -> None:
    """Rename a finished model directory into place, durably; a complete one already there (another process
    made it meanwhile) is kept, anything else there is an error."""
    try:
        os.rename(tmp, dest)
    except OSError:
        if not is_complete(dest):  # someone else's half-written or unrelated directory: not ours to replace
            raise
    else:
        durable.sync_dir(dest.parent)


def save_model(tokenizer: Any, model: Any, path: Path) -> None:
    """Write a loadable model directory (safetensors weights) and fsync every file in it."""
    with no_progress_bars():
        model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path, save_jinja_files=False)
    # the generic class name keeps the directory loadable by transformers 4.x too (SGLang, other tools)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    durable.sync_tree(path)


def train_tokenizer(texts: list[str], vocab_size: int, model_max_length: int) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers: unannotated __init__
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


# --- the synthetic corpus ---------------------------------------------------------------------------------------

_WORDS = """
a about above accept access account across action active actual add address after again against agent all allow
already also always an and another answer any api append application apply approach are argument array as ask
assistant async at attempt attribute auth available avoid await back background base bash be because been before
behavior being below best better between binary block body bool boolean both branch break browser buffer bug build
but by byte cache call can cannot case catch cause change character check child choose class clean clear cli client
close code collect column command comment commit common compare complete component concise condition config
confirm connect consider console constant contain content context continue control convert copy correct could count
create current cursor data database date debug decide default define delete dependency describe description detail
detect development diff different directory disk display do document does done down each edit editor effect
element else empty enable encode end ensure entire entry environment equal error escape even event every exact
example exception exist exit expect explain export expression extension extract fail false feature fetch field file
filter final find first fix flag float folder follow for format found frame from full function future generate get
git given glob global go good group handle has hash have header help here hidden history hook host how however id
if ignore image implement import important include index information initial input insert inside install instead
instruction integer interface internal into invalid is issue it item its json just keep key kind know language large
last later layout least length less level library line link lint list load local location lock log long look loop
main make manage many map match max may memory merge message method might minimal missing mode model modify module
more most move much multiple must name need never new next no node none not note nothing now null number object of
off offset often old on once one only open operation option or order original other otherwise out output over own
package page parameter parent parse part pass patch path pattern per perform permission place plan please point
port possible post prefer prefix present prevent previous print priority private problem process produce project
prompt property provide public pull push python query question quick range rather read reason recent record reduce
refactor reference regex related relative release remote remove rename render replace report repository request
require required resolve resource response result return review root rule run safe same save schema scope script
search section security see select send separate server service session set setting shell short should show side
similar simple since single size skip small so some something source specific specify stack standard start state
statement status step still stop storage store string structure style such suggest support sure switch symbol
syntax system table tag take target task template terminal test text than that the their them then there these they
thing this those through time timeout to todo together token tool top track true try type under understand unique
unless until up update usage use user using valid validate value variable verify version view wait want warning was
way we web what when where whether which while who why will with within without work would write wrong yes you
your ability able accurate across activity actually adapt advance affect agree aim alternative although amount
analysis analyze angle animal appear area arrive article assume attach attention audience author automatic
average aware balance basic become begin believe benefit beyond bit board book bottom brief bring broad budget
business calculate capture care carry center certain chain challenge chance chapter character cheap circle claim
clause clear climate close collection combine comfort community company complex compute concept concern conclude
conduct connection consistent construct consume contact contract contribute conversation core corner cost couple
course cover crash credit critical cross culture customer cycle daily damage deal decade declare decline deep
degree deliver demand deploy depth design desire destroy determine develop device differ difficult digital direct
discover discuss distance distribute divide domain double draft draw drive drop duration during duty early easy
economy edge education effort either election emerge emphasize employ encourage energy engine enough enter
equipment especially establish estimate evaluate evidence examine except exchange execute expand experience expert
explore express extend factor fair familiar fast favor figure fill finally finish firm fit focus force foreign
form forward free frequent fresh front fund further gain gather general generation goal grow growth guess guide
happen hard health hear heavy high highlight hold huge human idea identify imagine impact improve increase
indicate individual industry influence inform initiate inner inspect instance intend interest introduce invest
involve itself job join judge justify knowledge label lack land later lead learn leave legal lesson let letter
light likely limit listen little live logic lose low maintain major manner mark market material matter mean
measure meet member mention mind minute mirror mistake mix modern moment monitor month motion multiply narrow
nature near necessary network normal notice observe obtain occur offer official operate opinion opportunity
organize outcome overall pair paper particular partner party peer people percent perhaps period person phase
physical pick picture piece pipeline plain platform player policy popular position positive power practice prepare
pressure pretty price primary principle prior probably proceed product professional profile program progress
promote proof proper propose protect prove publish purpose quality quarter quite raise rate reach ready real
receive recognize recommend recover reflect region regular relation rely remain remember repeat replace represent
research respond rest restore retain reveal rich right risk role round route routine sample scale scan scene
score second secure seem sense sentence sequence serious serve share shift shape sign signal significant simply
site situation skill slow social solution solve sort sound space speak special speed spend split spread stable
stage stand statement stay strategy stream strong study subject submit success sudden sum summary supply
surface survey sync teach team technical technique tell tend term thank theory think third though thread throw
title today total toward trace trade train transfer transform translate travel treat trend trigger trouble trust
turn typical unit upon upgrade upload urgent usual various vast vector verbose visible visit volume watch weak
weight whole wide window wish word worker world worth yield zero
""".split()
_INSTRUCTIONS = """
You are an interactive CLI tool that helps users with software engineering tasks.
Use the instructions below and the tools available to you to assist the user.
IMPORTANT: You must NEVER generate or guess URLs for the user unless you are confident that they help with programming.
When the user asks about the codebase, search the repository before answering and cite the files you used.
Keep your responses short, since they will be displayed on a command line interface.
Only use emojis if the user explicitly requests it; avoid using emojis in all communication unless asked.
Before you make any change, read the file and understand the surrounding code, its conventions and its tests.
When you run a non-trivial bash command, explain what the command does and why you are running it.
Prefer editing existing files in the codebase; never write new files unless they are required to reach the goal.
Use the TodoWrite tool to plan and track tasks, and mark each todo as completed as soon as you are done with it.
After completing a task, run the lint and typecheck commands to ensure your code is correct.
NEVER commit changes unless the user explicitly asks you to; it is very important to only commit when asked.
The user will primarily request you perform software engineering tasks: solving bugs, adding new functionality,
refactoring code, explaining code, and more. Follow the existing patterns, libraries and naming of the project.
Reads a file from the local filesystem. The file_path parameter must be an absolute path, not a relative path.
By default, it reads up to 2000 lines starting from the beginning of the file; you can optionally specify an offset.
Executes a given bash command in a persistent shell session with optional timeout, ensuring proper handling.
Performs exact string replacements in files. The edit will FAIL if old_string is not unique in the file.
Fast file pattern matching tool that works with any codebase size and returns matching file paths sorted by time.
A powerful search tool built on ripgrep that supports full regex syntax and filters files with the glob parameter.
Launch a new agent to handle complex, multi-step tasks autonomously, with access to the same set of tools.
Fetches content from a specified URL and processes it using an AI model, converting HTML to markdown.
This is useful for understanding what the user wants, verifying assumptions, and providing a concise summary.
If you are unable to help with something, please do not explain why or what it could lead to; offer alternatives.
Whenever you read a file, you should consider whether it looks malicious; you can analyze it but must refuse to improve it.
Here is useful information about the environment you are running in: working directory, platform, today's date.
""".strip().splitlines()
_PREFIXES = ["un", "re", "pre", "de", "in", "non-", "sub", "over", "multi", "auto"]
_SUFFIXES = ["s", "ed", "ing", "er", "ers", "ly", "ion", "ation", "ment", "able", "ness", "ity", "al", "ize", "ive"]
_NOUNS = [w for w in _WORDS if len(w) > 3]
_VERBS = (
    "reads writes edits checks runs returns creates deletes updates finds searches parses builds loads saves".split()
)
_ADJS = "new old current local remote empty large small exact relative absolute optional required default".split()
_ADVS = "always never only carefully quickly first then also already still".split()
_KEYS = (
    "id name type path content description status created_at updated_at file_path old_string new_string command "
    "timeout pattern glob limit offset url prompt query todos priority items properties required role text "
    "tool_use_id is_error model max_tokens stream temperature messages system tools input output"
).split()
_UNICODE = (
    "café naïve façade Zürich São Paulo 東京 日本語 中文 한국어 Привет Ελληνικά ✓ → ← … — “quoted” 🙂 🚀 ±½°".split()
)


def corpus(seed: int = 0, chars: int = 400_000) -> list[str]:
    """Deterministic synthetic documents, about ``chars`` characters in all."""
    rng = random.Random(seed)
    makers = (_prose, _json_doc, _tool_schema, _python, _javascript, _markdown, _shell, _tool_call)
    docs, total = [], 0
    while total < chars:
        doc = rng.choice(makers)(rng)
        docs.append(doc)
        total += len(doc)
    return docs


def _word(rng: random.Random) -> str:
    """A word from the list, sometimes with an affix, so the tokenizer learns the pieces of unseen words too."""
    word = rng.choice(_WORDS)
    if rng.random() < 0.3:
        word += rng.choice(_SUFFIXES)
    if rng.random() < 0.08:
        word = rng.choice(_PREFIXES) + word
    return word.title() if rng.random() < 0.1 else word


def _ident(rng: random.Random, camel: bool = False) -> str:
    words = rng.sample(_NOUNS, rng.randint(1, 3))
    return words[0] + "".join(w.title() for w in words[1:]) if camel else "_".join(words)


def _sentence(rng: random.Random) -> str:
    if rng.random() < 0.5:  # free word order: covers the whole word list
        words = [_word(rng) for _ in range(rng.randint(4, 16))]
    else:
        words = ["The", rng.choice(_ADJS), rng.choice(_NOUNS), rng.choice(_ADVS), rng.choice(_VERBS), "the"]
        words += [rng.choice(_NOUNS), rng.choice(["before", "after", "when", "if", "unless"]), "the", _ident(rng)]
    if rng.random() < 0.2:
        words.insert(
            rng.randrange(len(words)), rng.choice([f"`{_ident(rng)}`", rng.choice(_UNICODE), str(rng.randint(0, 999))])
        )
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "!", "?", ":", ","])


def _prose(rng: random.Random) -> str:
    paras = []
    for _ in range(rng.randint(1, 4)):
        parts = [rng.choice(_INSTRUCTIONS) if rng.random() < 0.4 else _sentence(rng) for _ in range(rng.randint(2, 7))]
        paras.append(" ".join(parts))
    return "\n\n".join(paras)


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randint(0, 7 if depth < 3 else 4)
    if kind == 0:
        return rng.randint(-10, 100_000)
    if kind == 1:
        return rng.choice([True, False, None, 0.5, 3.14])
    if kind == 2:
        return f"/{'/'.join(rng.choice(_NOUNS) for _ in range(rng.randint(1, 4)))}.{rng.choice(['py', 'ts', 'json', 'md'])}"
    if kind in (3, 4):
        return _sentence(rng)
    if kind == 5:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(_KEYS): _value(rng, depth + 1) for _ in range(rng.randint(1, 5))}


def _json_doc(rng: random.Random) -> str:
    obj = {rng.choice(_KEYS): _value(rng) for _ in range(rng.randint(2, 8))}
    return json.dumps(obj, indent=rng.choice([None, 2]), ensure_ascii=rng.random() < 0.5)


def _tool_schema(rng: random.Random) -> str:
    props = {}
    for key in rng.sample(_KEYS, rng.randint(1, 6)):
        prop: dict[str, Any] = {"type": rng.choice(["string", "number", "integer", "boolean", "array"])}
        if prop["type"] == "array":
            prop["items"] = {"type": "string"}
        prop["description"] = _sentence(rng)
        props[key] = prop
    schema = {
        "name": rng.choice(["Bash", "Read", "Edit", "Write", "Glob", "Grep", "WebFetch", "TodoWrite", "Task"]),
        "description": _prose(rng),
        "input_schema": {
            "type": "object",
            "properties": props,
            "required": sorted(rng.sample(sorted(props), rng.randint(0, len(props)))),
            "additionalProperties": False,
            "$schema": "http://json-schema.org/draft-07/schema#",
        },
    }
    return json.dumps(schema, indent=rng.choice([None, 2]))


def _python(rng: random.Random) -> str:
    name, args = _ident(rng), rng.sample(_KEYS, rng.randint(0, 3))
    body = [f'    """{_sentence(rng)}"""']
    for _ in range(rng.randint(1, 6)):
        a, b = rng.choice(_KEYS), rng.choice(_KEYS)
        body.append(
            rng.choice(
                [
                    f"    {a} = {b}.get({json.dumps(rng.choice(_KEYS))}, {rng.randint(0, 9)})",
                    f'    if not {a}:\n        raise ValueError(f"{rng.choice(_NOUNS)} {{{a}!r}} is invalid")',
                    f"    for {a} in {b}:\n        {_ident(rng)}({a})",
                    f'    with open({a}, encoding="utf-8") as f:\n        {b} = json.load(f)',
                    f"    {a}: list[str] = [x.strip() for x in {b}.splitlines() if x]",
                ]
            )
        )
    body.append(f"    return {rng.choice(args) if args else 'None'}")
    return f"def {name}({', '.join(args)}):\n" + "\n".join(body) + "\n"


def _javascript(rng: random.Random) -> str:
    a, b = rng.choice(_KEYS), rng.choice(_KEYS)
    name = _ident(rng, camel=True)
    return (
        f"export async function {name}({a}, options = {{}}) {{\n"
        f"  const {b} = await fetch(`/api/${{{a}}}`, {{ method: 'POST' }});\n"
        f"  if (!{b}.ok) throw new Error('{_sentence(rng)}');\n"
        f"  return {b}.json();\n}}\n"
    )


def _markdown(rng: random.Random) -> str:
    lines = [f"{'#' * rng.randint(1, 3)} {rng.choice(_ADJS).title()} {rng.choice(_NOUNS)}s", ""]
    lines += [f"- {_sentence(rng)}" for _ in range(rng.randint(1, 5))]
    if rng.random() < 0.5:
        lines += ["", "```python", _python(rng).rstrip(), "```"]
    if rng.random() < 0.3:
        lines += ["", "| name | value |", "|------|-------|"]
        lines += [f"| `{rng.choice(_KEYS)}` | {rng.randint(0, 999)} |" for _ in range(3)]
    return "\n".join(lines)


def _shell(rng: random.Random) -> str:
    cmds = [
        f"$ ls -la {_value(rng, 3) if rng.random() < 0.5 else '.'}",
        f"$ git diff --stat HEAD~{rng.randint(1, 5)}",
        f"$ python -m pytest tests/test_{rng.choice(_NOUNS)}.py -q",
        f"{rng.randint(1, 99)} passed, {rng.randint(0, 3)} failed in {rng.random():.2f}s",
        f'Traceback (most recent call last):\n  File "{rng.choice(_NOUNS)}.py", line {rng.randint(1, 500)}, '
        f"in {_ident(rng)}\nKeyError: '{rng.choice(_KEYS)}'",
        f"@@ -{rng.randint(1, 90)},7 +{rng.randint(1, 90)},8 @@\n-    {rng.choice(_KEYS)} = None\n+    {rng.choice(_KEYS)} = []",
    ]
    return "\n".join(rng.sample(cmds, rng.randint(1, len(cmds))))


def _tool_call(rng: random.Random) -> str:
    args = {k: _value(rng, 2) for k in rng.sample(_KEYS, rng.randint(1, 3))}
    call = {"name": rng.choice(["Bash", "Read", "Edit", "Grep"]), "arguments": args}
    return f"{_sentence(rng)}\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
