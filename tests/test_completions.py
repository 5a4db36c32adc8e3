"""Shell completions: the committed scripts under ``completions/`` are what the CLI generates now (regenerate with
``python -m reef_cli.completions``); real bash, zsh and fish complete commands, options and choices from them;
``reef completions install|show`` put them where each shell looks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer.main

from reef_cli.completions import FILES, generate
from reef_cli.main import app

ROOT = Path(__file__).resolve().parent.parent
ROOT_COMMAND = typer.main.get_command(app)  # the real `reef` command tree


@pytest.mark.parametrize("shell", sorted(FILES))
def test_committed_completions_are_current(shell: str) -> None:
    committed = (ROOT / "completions" / FILES[shell]).read_text()
    assert committed == generate(shell, ROOT_COMMAND), (
        f"completions/{FILES[shell]} is stale: run `python -m reef_cli.completions` and commit the result"
    )


def bash_complete(*words: str, env: dict[str, str] | None = None) -> list[str]:
    script = (
        f"source {ROOT / 'completions' / 'reef.bash'}\n"
        'COMP_WORDS=("$@"); COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); _reef; printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    out = subprocess.run(["bash", "-c", script, "bash", "reef", *words], capture_output=True, text=True, timeout=30,
                         env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_bash_completes_commands_options_and_choices() -> None:
    assert bash_complete("rel") == ["releases"]
    assert bash_complete("releases", "") == ["bundle", "canary", "canary-end", "list", "open", "promote", "rollback", "show",
                                             "--help"]
    assert bash_complete("releases", "list", "-s", "alpha", "--j") == ["--json"]
    assert bash_complete("completions", "install", "") == ["bash", "zsh", "fish", "--help"]
    assert "tui" in bash_complete("") and "doctor" in bash_complete("d")


def test_fish_completes_with_descriptions() -> None:
    script = f'source {ROOT / "completions" / "reef.fish"}; complete -C "reef releases "; complete -C "reef tui --"'
    out = subprocess.run(["fish", "--no-config", "-c", script], capture_output=True, text=True, timeout=30)
    lines = out.stdout.splitlines()
    assert any(line.startswith("rollback\t") and "earlier release" in line for line in lines), out.stdout
    assert any(line.startswith("--scenario\t") for line in lines), out.stdout


def test_zsh_script_offers_commands_and_options() -> None:
    # zsh's completion system needs a terminal; stand in for its two entry points and run the real function
    script = (
        '_describe() { print -r -- "$3: ${(P@)4}" }; _files() { print files }; compdef() {}\n'
        f"source {ROOT / 'completions' / '_reef'}\n"
        'words=(reef releases ""); CURRENT=3; _reef\n'
        "words=(reef tui --); CURRENT=3; _reef\n"
    )
    out = subprocess.run(["zsh", "-f", "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    commands, options = out.stdout.splitlines()
    assert commands.startswith("reef command: bundle:Publish one release") and "rollback:" in commands
    assert "canary:Serve a held candidate" in commands
    assert options.startswith("reef option: --scenario:") and "--help:Show help" in options


def test_provider_names_are_offered_from_the_presets() -> None:
    """`reef serve --provider` and `reef daemon start --provider` take any text (the daemon refuses an unknown name,
    naming the known ones) and offer the presets of daemon/providers.py, in each shell; --upstream-format offers the
    formats. Bugs caught: no values offered, a list typed apart from the presets (a preset missing)."""
    from daemon.providers import FORMATS, PRESETS

    names = list(PRESETS)
    assert "openai-compatible" in names and "llamacpp" in names
    assert bash_complete("serve", "--provider", "") == names
    assert bash_complete("daemon", "start", "--provider", "ll") == ["llamacpp"]
    assert bash_complete("serve", "--upstream-format", "") == list(FORMATS)
    fish_out = subprocess.run(["fish", "--no-config", "-c", f'source {ROOT / "completions" / "reef.fish"}; '
                               'complete -C "reef serve --provider "; echo ---; complete -C "reef daemon start --provider o"'],
                              capture_output=True, text=True, timeout=30).stdout
    serve, start = fish_out.split("---\n")
    assert sorted(line.split("\t")[0] for line in serve.splitlines()) == sorted(names), fish_out
    assert [line.split("\t")[0] for line in start.splitlines()] == ["ollama", "openai", "openai-compatible"], fish_out
    script = ('compadd() { print -r -- "$@" }; _describe() {}; _files() {}; compdef() {}\n'
              f"source {ROOT / 'completions' / '_reef'}\n"
              'words=(reef serve --provider ""); CURRENT=4; _reef\n'
              'words=(reef daemon start --provider ""); CURRENT=5; _reef\n')
    out = subprocess.run(["zsh", "-f", "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["-- " + " ".join(names)] * 2, out.stdout


def test_the_wrappers_complete_their_flags_and_provider_names() -> None:
    """`reef-pi --reef-provider` (and every wrapper's) offers the presets in bash, zsh and fish; the committed wrapper
    scripts are current. Bugs caught: a wrapper without completions, provider names missing or typed apart from the
    presets, the agent's own arguments (files) taken away."""
    from daemon.providers import PRESETS
    from reef_cli.completions import wrapper_files

    names = list(PRESETS)
    for shell in FILES:
        for name, text in wrapper_files(shell).items():
            assert (ROOT / "completions" / name).read_text() == text, f"completions/{name} is stale"

    def wrapped(*words: str) -> list[str]:
        script = (f"source {ROOT / 'completions' / 'reef-wrappers.bash'}\n"
                  'COMP_WORDS=("$@"); COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); _reef_wrapper; '
                  'printf "%s\\n" "${COMPREPLY[@]}"\n')
        out = subprocess.run(["bash", "-c", script, "bash", *words], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert wrapped("reef-pi", "--reef-provider", "") == names
    assert wrapped("reef-codex", "-p", "--reef-provider", "ol") == ["ollama"]
    assert wrapped("reef-claude", "--reef-p") == ["--reef-provider"]
    assert wrapped("reef-pi", "pro") == ["propose"]
    assert wrapped("reef-pi", "-p", "fi") == []  # the agent's words: left to the shell's files (-o default)
    fish_out = subprocess.run(["fish", "--no-config", "-c", f'source {ROOT / "completions" / "reef-pi.fish"}; '
                               'complete -C "reef-pi --reef-provider "'], capture_output=True, text=True, timeout=30)
    assert sorted(line.split("\t")[0] for line in fish_out.stdout.splitlines()) == sorted(names), fish_out.stdout
    script = ('compadd() { print -r -- "$@" }; _files() { print files }; compdef() {}\n'
              f"source {ROOT / 'completions' / '_reef_wrappers'}\n"
              'words=(reef-opencode --reef-provider ""); CURRENT=3; _reef_wrapper\n'
              'words=(reef-opencode -p ""); CURRENT=3; _reef_wrapper\n')
    out = subprocess.run(["zsh", "-f", "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["-- " + " ".join(names), "files"], out.stdout


def reef(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reef_cli.main", *args], capture_output=True, text=True,
                          timeout=60, env=env, cwd=ROOT)


def test_install_and_show(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "ZDOTDIR", "REEF_"))}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(ROOT), REEF_HOME=str(tmp_path / "reef"))
    shown = reef("completions", "show", "bash", env=env)
    assert shown.returncode == 0 and shown.stdout == generate("bash", ROOT_COMMAND)
    done = reef("completions", "install", "bash", env=env)
    assert done.returncode == 0, done.stderr
    target = tmp_path / ".local/share/bash-completion/completions/reef"
    assert target.read_text() == generate("bash", ROOT_COMMAND) and str(target) in done.stdout
    for wrapper in ("reef-pi", "reef-claude", "reef-opencode", "reef-codex"):  # bash-completion loads by name
        assert "--reef-provider" in (target.parent / wrapper).read_text()
    again = reef("completions", "install", env={**env, "SHELL": "/usr/bin/fish"})  # the shell from $SHELL
    assert again.returncode == 0 and (tmp_path / ".config/fish/completions/reef.fish").read_text() == generate("fish", ROOT_COMMAND)
    assert (tmp_path / ".config/fish/completions/reef-pi.fish").exists()
    zsh = reef("completions", "install", "zsh", env=env)
    assert (tmp_path / ".zfunc/_reef").exists() and "fpath=" in zsh.stdout
    assert (tmp_path / ".zfunc/_reef_wrappers").read_text().startswith("#compdef reef-pi ")
    unknown = reef("completions", "install", env={**env, "SHELL": "/bin/tcsh"})
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1 and "tcsh" in unknown.stderr


def shell_env(home: Path) -> dict[str, str]:
    """The user's shell: this checkout's ``reef`` on PATH, a daemon's home (or one where none runs)."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
            "REEF_HOME": str(home)}


def test_scenarios_and_release_ids_come_from_the_running_daemon(daemon: Any, tmp_path: Path) -> None:
    """A scenario option, a scenario argument and a release id argument are completed with what the daemon has
    (the release ids of the scenario named on the command line, pending ones too), in bash, zsh and fish; with no
    daemon the static words still come and nothing is printed on the terminal."""
    with daemon.unix() as c:
        for name in ("cmpl-alpha", "cmpl-beta"):
            c.post("/reef/scenarios", json={"name": name})
        alpha_head = c.get("/reef/scenarios/cmpl-alpha/releases").json()["head"]
        beta_head = c.get("/reef/scenarios/cmpl-beta/releases").json()["head"]
    env = shell_env(daemon.home)
    assert {"cmpl-alpha", "cmpl-beta"} <= set(bash_complete("releases", "list", "-s", "", env=env))
    assert bash_complete("scenarios", "pause", "cmpl-a", env=env) == ["cmpl-alpha"]
    ids = bash_complete("releases", "rollback", "-s", "cmpl-alpha", "", env=env)
    assert alpha_head in ids and beta_head not in ids  # the scenario on the command line, not another's
    assert "--yes" in ids  # the static words stay
    zsh = subprocess.run(["zsh", "-f", "-c", (
        "compadd() { shift; print -l -- \"$@\" }; _describe() { print -l -- \"${(P@)4}\" }; compdef() {}\n"
        f"source {ROOT / 'completions' / '_reef'}\n"
        'words=(reef releases list -s ""); CURRENT=5; _reef\n')], capture_output=True, text=True, timeout=30, env=env)
    assert {"cmpl-alpha", "cmpl-beta"} <= set(zsh.stdout.split()), zsh.stdout + zsh.stderr
    fish = subprocess.run(["fish", "--no-config", "-c", f"source {ROOT / 'completions' / 'reef.fish'}; "
                           "complete -C 'reef releases show -s cmpl-beta '"], capture_output=True, text=True,
                          timeout=30, env=env)
    assert beta_head in fish.stdout and alpha_head not in fish.stdout, fish.stdout + fish.stderr
    down = shell_env(tmp_path)  # no daemon here
    out = subprocess.run(["reef", "__complete", "scenarios"], capture_output=True, text=True, env=down, timeout=30)
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")
    assert bash_complete("releases", "rollback", "", env=down) == ["--scenario", "-s", "--yes", "-y", "--json",
                                                                    "--help"]
