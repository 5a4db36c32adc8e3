"""``reef model init``: build local models (no download)."""

from __future__ import annotations

import time

import typer

from reef_cli.common import config, edge, fail

app = typer.Typer(help="Build local models.", no_args_is_help=True)


@app.command("init")
@edge
def init(
    name: str = typer.Argument("tiny", help="Which model to build: tiny, or tiny-demo (tiny + a warm-up on the "
                               "demo's task family)."),
    seed: int = typer.Option(0, help="Random seed."),
    force: bool = typer.Option(False, "--force", help="Rebuild even if it exists."),
) -> None:
    """Build the tiny model (a tokenizer trained on the spot, random weights) into $REEF_HOME/models/<name>."""
    built_in = ("tiny", "tiny-demo")  # recipes.warmup.BUILT_IN (not imported here: it pulls in torch)
    if name not in built_in:
        fail(f"unknown model {name!r}; reef can build: {', '.join(built_in)}", 2)
    import shutil

    from rich.console import Console

    from recipes.warmup import init_built_in

    cfg = config()
    dest = cfg.models_dir / name
    if force and dest.exists():
        shutil.rmtree(dest)
    t0 = time.monotonic()
    with Console(stderr=True).status(f"building the {name} model") as status:
        init_built_in(dest, name, seed=seed, progress=lambda msg: status.update(msg))
    print(f"{name} model ready at {dest} ({time.monotonic() - t0:.1f}s)")
