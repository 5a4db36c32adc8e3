"""Shell completions for ``reef``, generated from the command tree: ``reef completions show|install``.

The scripts are static (subcommands, options, choices and their help, read from the typer app), so a Tab
never starts Python, except where the values come from the running daemon: a scenario (``--scenario``, or a
scenario argument) and a release id (``reef releases show|open|promote|rollback|canary``), asked with ``reef __complete``
(``reef_cli/fast.py``: the standard library, the Unix socket, half a second at most, silent when the daemon is
down). The wrappers (``reef-pi`` ...) get their own: their subcommands, their ``--reef-*`` flags, a scenario or a
provider (``daemon/providers.py``'s presets) after the flag that takes one, files for the rest (the agent's). They are
committed under ``completions/`` and a test fails when they are stale; after changing a command, regenerate them
with ``python -m reef_cli.completions``.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer

from reef_cli.common import edge, fail

SHELLS = ("bash", "zsh", "fish")
ROOT = Path(__file__).resolve().parent.parent

app = typer.Typer(help="Shell completions for bash, zsh and fish: show or install them.", no_args_is_help=True)


@dataclass
class Node:
    """One command or group: its path (``("releases", "list")``), help, options and subcommands."""

    path: tuple[str, ...]
    help: str
    options: list[tuple[list[str], str, list[str]]] = field(default_factory=list)  # (flags, help, choices)
    choices: list[str] = field(default_factory=list)  # of its arguments
    children: dict[str, Node] = field(default_factory=dict)
    asks: str | None = None  # its argument's values come from the daemon: "scenarios" | "releases"
    asks_for: dict[str, str] = field(default_factory=dict)  # option flag -> what its value's come from

    @property
    def key(self) -> str:
        return "".join(f"/{p}" for p in self.path)


def _first_line(text: str | None) -> str:
    """The first paragraph of a help text, as one line."""
    return " ".join((text or "").strip().split("\n\n")[0].split()).rstrip(".")


def _choices(param: Any) -> list[str]:
    """The values an option or argument takes, when it is a choice (an Enum, or click's Choice)."""
    import enum
    import typing

    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    for t in (annotation, *typing.get_args(annotation)):
        if isinstance(t, type) and issubclass(t, enum.Enum):
            return [str(m.value) for m in t]
    return [str(c) for c in getattr(getattr(param, "type", None), "choices", None) or []]


def tree(root: Any) -> Node:
    """The command tree under ``root``, the click command of the real ``reef`` app (typer's groups are walked by
    duck typing). The commands here take it from their context (``ctx.find_root().command``): this module is one
    of the groups ``reef_cli/main.py`` composes, so it never imports the app it describes."""

    def walk(cmd: Any, path: tuple[str, ...]) -> Node:
        node = Node(path, _first_line(getattr(cmd, "short_help", None) or cmd.help))
        for p in cmd.params:
            choices = _choices(p)
            if getattr(p, "param_type_name", "") == "option":
                if getattr(p, "hidden", False):
                    continue
                choices = choices or _known_values(p.opts)
                node.options.append(([*p.opts, *p.secondary_opts], _first_line(p.help), choices))
                if "--scenario" in p.opts or "--transfer" in p.opts:  # reef eval --transfer: a scenario too
                    node.asks_for.update(dict.fromkeys(p.opts, "scenarios"))
            else:
                node.choices.extend(choices)
                node.asks = node.asks or _asks(p, path)
        node.options.append((["--help"], "Show help and exit", []))
        for name, sub in sorted((getattr(cmd, "commands", None) or {}).items()):
            if not getattr(sub, "hidden", False):
                node.children[name] = walk(sub, (*path, name))
        return node

    return walk(root, ())


def _known_values(flags: list[str]) -> list[str]:
    """The values offered for an option that takes any text but has known ones: ``--provider``'s are the presets,
    ``--upstream-format``'s the formats (``daemon/providers.py``; an unknown value is the daemon's to refuse, naming
    the known ones). Imported here, at generation, never on a command's path."""
    from daemon import providers

    if "--provider" in flags or "--reef-provider" in flags:
        return list(providers.PRESETS)
    if "--upstream-format" in flags:
        return list(providers.FORMATS)
    return []


def _asks(param: Any, path: tuple[str, ...]) -> str | None:
    """Whether an argument names a release or an existing scenario (its values then come from the daemon)."""
    if param.name == "release_id":
        return "releases"
    if param.name == "name" and (param.help or "").startswith("The scenario") and path[:1] == ("scenarios",):
        return "scenarios"
    return None


ASK = 'reef __complete {kind} {scenario}2>/dev/null'  # the daemon's values (reef_cli/fast.complete)


def _ask(kind: str, scenario: str) -> str:
    return ASK.format(kind=kind, scenario=f"{scenario} " if kind == "releases" else "")


def _nodes(node: Node) -> list[Node]:
    out = [node]
    for child in node.children.values():
        out.extend(_nodes(child))
    return out


def _case(key: str) -> str:
    """A command path as a shell word (the root is the empty path)."""
    return shlex.quote(key) if key else '""'


HEADER = "# {shell} completion for reef: generated by `python -m reef_cli.completions` from the CLI; do not edit.\n"


def bash(root: Node) -> str:
    groups = [n.key for n in _nodes(root) if n.path]
    lines = [HEADER.format(shell="bash"), "_reef() {",
             '    local cur="${COMP_WORDS[COMP_CWORD]}" path="" scen="" i w words=""',
             "    for ((i = 1; i < COMP_CWORD; i++)); do",
             '        w="${COMP_WORDS[i]}"',
             '        case "${COMP_WORDS[i-1]}" in -s|--scenario) scen="$w" ;; esac',
             '        case "$path/$w" in',
             f"            {'|'.join(groups)}) path=\"$path/$w\" ;;",
             "        esac",
             "    done",
             '    case "$path" in']
    for n in _nodes(root):
        words = [*n.children, *n.choices, *(f for flags, _, _ in n.options for f in flags)]
        asked = f'" $({_ask(n.asks, chr(34) + "$scen" + chr(34))})"' if n.asks else ""
        lines.append(f"        {_case(n.key)}) words={shlex.quote(' '.join(words))}{asked} ;;")
    lines += ["    esac",
              '    case "$path:${COMP_WORDS[COMP_CWORD-1]}" in']
    for n in _nodes(root):
        for flags, _, choices in n.options:
            pats = "|".join(f"{n.key}:{f}" for f in flags)
            if choices:
                lines.append(f"        {pats}) words={shlex.quote(' '.join(choices))} ;;")
            elif flags[0] in n.asks_for:
                lines.append(f'        {pats}) words="$({_ask(n.asks_for[flags[0]], "")})" ;;')
    lines += ["    esac",
              '    COMPREPLY=($(compgen -W "$words" -- "$cur"))',
              "}",
              "complete -o default -F _reef reef",
              ""]
    return "\n".join(lines)


def _zsh_item(name: str, desc: str) -> str:
    return shlex.quote(f"{name.replace(':', chr(92) + ':')}:{desc}")


def zsh(root: Node) -> str:
    groups = [n.key for n in _nodes(root) if n.path]
    lines = ["#compdef reef", HEADER.format(shell="zsh"), "_reef() {",
             "    local path_ w i scen",
             "    local -a cmds opts vals",
             "    for ((i = 2; i < CURRENT; i++)); do",
             "        w=${words[i]}",
             '        case "${words[i-1]}" in (-s|--scenario) scen="$w" ;; esac',
             '        case "$path_/$w" in',
             f"            ({'|'.join(groups)}) path_=\"$path_/$w\" ;;",
             "        esac",
             "    done",
             '    case "$path_:${words[CURRENT-1]}" in']
    for n in _nodes(root):
        for flags, _, choices in n.options:
            pats = "|".join(f"{n.key}:{f}" for f in flags)
            if choices:
                lines.append(f"        ({pats}) compadd -- {' '.join(shlex.quote(c) for c in choices)}; return ;;")
            elif flags[0] in n.asks_for:
                lines.append(f'        ({pats}) compadd -- ${{(f)"$({_ask(n.asks_for[flags[0]], "")})"}}; return ;;')
    lines += ["    esac", '    case "$path_" in']
    for n in _nodes(root):
        cmds = " ".join(_zsh_item(name, c.help) for name, c in n.children.items())
        cmds += "".join(" " + shlex.quote(c) for c in n.choices)
        if n.asks:
            cmds += f' ${{(f)"$({_ask(n.asks, chr(34) + "$scen" + chr(34))})"}}'
        opts = " ".join(_zsh_item(f, h) for flags, h, _ in n.options for f in flags)
        lines.append(f"        ({_case(n.key)}) cmds=({cmds}); opts=({opts}) ;;")
    lines += ["    esac",
              "    if [[ ${words[CURRENT]} == -* ]]; then",
              "        _describe -t options 'reef option' opts",
              "    elif (( ${#cmds} )); then",
              "        _describe -t commands 'reef command' cmds",
              "    else",
              "        _files",
              "    fi",
              "}",
              'if [[ "$funcstack[1]" == "_reef" ]]; then _reef "$@"; else compdef _reef reef; fi',
              ""]
    return "\n".join(lines)


def _fish_quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def fish(root: Node) -> str:
    groups = " ".join(n.key for n in _nodes(root) if n.path)
    lines = [HEADER.format(shell="fish").rstrip("\n"),
             "function __reef_path",
             '    set -l path ""',
             "    for w in (commandline -opc)[2..-1]",
             f'        if contains -- "$path/$w" {groups}',
             '            set path "$path/$w"',
             "        end",
             "    end",
             '    echo "$path"',
             "end",
             "function __reef_at",
             "    set -l p (__reef_path)",
             '    test "$p" = "$argv[1]"',
             "end",
             "function __reef_scenario",
             "    set -l words (commandline -opc)",
             "    for i in (seq 2 (count $words))",
             "        if contains -- $words[(math $i - 1)] -s --scenario",
             "            echo $words[$i]",
             "        end",
             "    end",
             "end",
             "complete -c reef -f"]
    for n in _nodes(root):
        cond = f"-n {_fish_quote('__reef_at ' + _case(n.key))}"
        for name, child in n.children.items():
            lines.append(f"complete -c reef {cond} -a {name} -d {_fish_quote(child.help)}")
        for c in n.choices:
            lines.append(f"complete -c reef {cond} -a {shlex.quote(c)}")
        if n.asks:
            lines.append(f"complete -c reef {cond} -a {_fish_quote('(' + _ask(n.asks, '(__reef_scenario)') + ')')}")
        for flags, h, choices in n.options:
            spec = " ".join(f"-l {f[2:]}" if f.startswith("--") else f"-s {f[1:]}" for f in flags)
            extra = f" -x -a {_fish_quote(' '.join(choices))}" if choices else ""
            if not choices and flags[0] in n.asks_for:
                extra = f" -x -a {_fish_quote('(' + _ask(n.asks_for[flags[0]], '') + ')')}"
            lines.append(f"complete -c reef {cond} {spec} -d {_fish_quote(h)}{extra}")
    return "\n".join(lines) + "\n"


def _wrappers() -> tuple[list[str], list[str], list[str], list[str]]:
    """The wrapper commands (``reef-pi`` ...), their subcommands, their own flags, and ``--reef-provider``'s values."""
    from adapters import ADAPTERS
    from reef_cli.wrapper import FLAGS, SUBCOMMANDS

    return [a.command for a in ADAPTERS.values()], list(SUBCOMMANDS), list(FLAGS), _known_values(["--reef-provider"])


def wrappers_bash() -> str:
    """``reef-pi`` and the other wrappers: their subcommands and ``--reef-*`` flags, a scenario or a provider after
    the flag that takes it; everything else is the agent's (files)."""
    commands, subs, flags, providers = _wrappers()
    return "\n".join([
        HEADER.format(shell="bash").replace("for reef", "for the reef wrappers (" + ", ".join(commands) + ")"),
        "_reef_wrapper() {",
        '    local cur="${COMP_WORDS[COMP_CWORD]}" words=""',
        '    case "${COMP_WORDS[COMP_CWORD-1]}" in',
        f"        --reef-provider) words={shlex.quote(' '.join(providers))} ;;",
        f'        --reef-scenario) words="$({_ask("scenarios", "")})" ;;',
        "        *)",
        f"            if [[ $COMP_CWORD -eq 1 && $cur != -* ]]; then words={shlex.quote(' '.join(subs))}",
        f"            elif [[ $cur == --* ]]; then words={shlex.quote(' '.join(flags))}",
        "            else return",
        "            fi ;;",
        "    esac",
        '    COMPREPLY=($(compgen -W "$words" -- "$cur"))',
        "}",
        f"complete -o default -F _reef_wrapper {' '.join(commands)}",
        ""])


def wrappers_zsh() -> str:
    commands, subs, flags, providers = _wrappers()
    return "\n".join([
        f"#compdef {' '.join(commands)}",
        HEADER.format(shell="zsh").replace("for reef", "for the reef wrappers"),
        "_reef_wrapper() {",
        '    case "${words[CURRENT-1]}" in',
        f"        (--reef-provider) compadd -- {' '.join(shlex.quote(p) for p in providers)}; return ;;",
        f'        (--reef-scenario) compadd -- ${{(f)"$({_ask("scenarios", "")})"}}; return ;;',
        "    esac",
        f"    if [[ ${{words[CURRENT]}} == --* ]]; then compadd -- {' '.join(flags)}",
        f"    elif (( CURRENT == 2 )); then compadd -- {' '.join(subs)}; _files",
        "    else _files",
        "    fi",
        "}",
        f'if [[ "$funcstack[1]" == "_reef_wrapper" ]]; then _reef_wrapper "$@"; '
        f"else compdef _reef_wrapper {' '.join(commands)}; fi",
        ""])


def wrappers_fish(command: str) -> str:
    _, subs, flags, providers = _wrappers()
    lines = [HEADER.format(shell="fish").replace("for reef", f"for {command}").rstrip("\n")]
    for sub in subs:
        lines.append(f"complete -c {command} -n __fish_is_first_arg -a {sub}")
    for flag in flags:
        values = {"--reef-provider": f" -x -a {_fish_quote(' '.join(providers))}",
                  "--reef-scenario": f" -x -a {_fish_quote('(' + _ask('scenarios', '') + ')')}"}.get(flag, " -r")
        lines.append(f"complete -c {command} -l {flag[2:]}{values}")
    return "\n".join(lines) + "\n"


def wrapper_files(shell: str) -> dict[str, str]:
    """The wrappers' scripts of ``shell``, by the name each is committed under (``completions/``)."""
    if shell == "bash":
        return {"reef-wrappers.bash": wrappers_bash()}
    if shell == "zsh":
        return {"_reef_wrappers": wrappers_zsh()}
    return {f"{c}.fish": wrappers_fish(c) for c in _wrappers()[0]}


def wrapper_installs(shell: str, where: Path) -> dict[Path, str]:
    """Where ``install`` puts the wrappers' scripts, beside ``reef``'s: bash-completion loads a command's file by
    the command's name (one per wrapper), zsh reads one file naming them all, fish one file per command."""
    if shell == "bash":
        return {where / c: wrappers_bash() for c in _wrappers()[0]}
    return {where / name: text for name, text in wrapper_files(shell).items()}


GENERATORS = {"bash": bash, "zsh": zsh, "fish": fish}
FILES = {"bash": "reef.bash", "zsh": "_reef", "fish": "reef.fish"}


def generate(shell: str, root: Any) -> str:
    """The completion script of ``shell`` for the command tree under ``root`` (a click command)."""
    return GENERATORS[shell](tree(root))


def write_all(root: Any, dest: Path = ROOT / "completions") -> list[Path]:
    """Regenerate ``completions/`` (what ``python -m reef_cli.completions`` does)."""
    dest.mkdir(parents=True, exist_ok=True)
    nodes = tree(root)
    out = []
    for shell, name in FILES.items():
        path = dest / name
        path.write_text(GENERATORS[shell](nodes))
        out.append(path)
        for name, text in wrapper_files(shell).items():
            (dest / name).write_text(text)
            out.append(dest / name)
    return out


def install_path(shell: str, env: dict[str, str] | None = None) -> Path:
    """Where each shell looks for a user's completions without editing any rc file (zsh: see ``install``)."""
    env = dict(os.environ) if env is None else env
    home = Path(env.get("HOME", "~")).expanduser()
    if shell == "bash":
        data = Path(env.get("XDG_DATA_HOME") or home / ".local" / "share")
        return data / "bash-completion" / "completions" / "reef"
    if shell == "fish":
        conf = Path(env.get("XDG_CONFIG_HOME") or home / ".config")
        return conf / "fish" / "completions" / "reef.fish"
    return Path(env.get("ZDOTDIR") or home) / ".zfunc" / "_reef"


def _shell(choice: Shell | None) -> str:
    shell = choice.value if choice is not None else None
    if shell is None:
        shell = Path(os.environ.get("SHELL", "")).name
        if shell not in SHELLS:
            fail(f"cannot tell your shell from SHELL={os.environ.get('SHELL', '')!r}; name one: {', '.join(SHELLS)}",
                 2)
    return shell


class Shell(StrEnum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"


SHELL_HELP = "bash, zsh or fish (default: from $SHELL)."


@app.command("show")
@edge
def show(ctx: typer.Context, shell: Shell = typer.Argument(None, help=SHELL_HELP, show_default=False)) -> None:
    """Print the completion script for a shell (e.g. to source it: `source <(reef completions show bash)`)."""
    print(generate(_shell(shell), ctx.find_root().command), end="")


@app.command("install")
@edge
def install(
    ctx: typer.Context,
    shell: Shell = typer.Argument(None, help=SHELL_HELP, show_default=False),
) -> None:
    """Install the completion script where the shell finds it for your user (run again to update)."""
    name = _shell(shell)
    path = install_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    for dest, text in {path: generate(name, ctx.find_root().command), **wrapper_installs(name, path.parent)}.items():
        tmp = dest.with_name(f".{dest.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, dest)
    print(f"installed {name} completions: {path} (and the wrappers': reef-pi, reef-claude, ...)")
    if name == "zsh":
        print(f"zsh reads it if your ~/.zshrc has, before compinit:  fpath=({path.parent} $fpath)")
    else:
        print("open a new shell to use them")


@app.command("write", hidden=True)
def write(ctx: typer.Context) -> None:
    """Regenerate the committed scripts under completions/ in the source tree (for Reef's own developers)."""
    for written in write_all(ctx.find_root().command):
        print(f"wrote {written.relative_to(ROOT)}")


if __name__ == "__main__":
    # the whole app is needed: run it (as reef_cli/fast.py's --write-help does) rather than import it from here
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "reef_cli.main", "completions", "write"], check=True)
