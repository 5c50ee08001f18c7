"""The ``dlmix`` command line (typer). Each sub-command lives in its own module; this file only wires them."""
from __future__ import annotations

from typing import List

import typer

# click's plain help and errors (rich_markup_mode=None): typer's rich tables cut long option names at 80 columns
app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  help="dlmix: heterogeneous LLM serving.")
models_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                         help="Prepare the models dlmix tests and demos use.")
app.add_typer(models_app, name="models")


@models_app.command("prepare")
def models_prepare(
    name: str = typer.Argument(..., help="smollm2 (real SmolLM2-135M-Instruct), tiny-llama or tiny-deepseek (random weights; MLA)"),
    cache_dir: str = typer.Option(None, "--cache-dir", help="Cache root (default $DLMIX_CACHE or ~/.cache/dlmix)"),
) -> None:
    """Build the model's Hugging Face folder once (cached) and print its path."""
    from dlmix import models

    try:
        path = models.prepare(name, cache_dir=cache_dir)
    except models.ModelError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(str(path))


@app.command("demo")
def demo(
    deployment: List[str] = typer.Option(None, "--deployment", help="Deployment file, repeatable (default: "
                                         "examples/cpu-pd.yaml, then examples/cpu-lmdeploy-prefill-vllm-decode.yaml)"),
    max_tokens: int = typer.Option(48, "--max-tokens", help="Output tokens per request"),
    free_ports: bool = typer.Option(False, "--free-ports", help="Use free ports instead of the file's"),
    json_out: str = typer.Option(None, "--json", help="Also write the per-request rows to this JSON file"),
) -> None:
    """Launch the CPU PD examples with SmolLM2 (across block size and dtype; across engines), send real requests
    through the router, print a table per request; exit code 0 only if every request succeeded, the decode instance
    received KV and every answer equals a single instance's up to near-ties (measured)."""
    from dlmix.demo import run_demo

    raise typer.Exit(run_demo(list(deployment or ()) or None, max_tokens=max_tokens, free_ports=free_ports,
                              json_out=json_out))


from dlmix.bench.cli import bench as _bench  # noqa: E402

app.command("bench")(_bench)

from dlmix.launch.cli import launch_cmd as _launch  # noqa: E402

app.command("launch")(_launch)


from dlmix.router.cli import register as _register_router  # noqa: E402

_register_router(app)

from dlmix.sim.cli import register as _register_sim  # noqa: E402

_register_sim(app)

from dlmix.plan.cli import register as _register_plan  # noqa: E402

_register_plan(app)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
