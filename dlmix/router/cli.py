"""``dlmix router --config router.yaml [--KEY VALUE ...]``: every config key is also a flag (see
:mod:`dlmix.router.config`)."""
from __future__ import annotations

from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    """Add the ``router`` sub-command to the dlmix CLI."""

    @app.command("router", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
                 help="Run the dlmix router (OpenAI endpoint, KV-cache-aware PD placement). Every config key is "
                      "also a flag: --policy cost --port 8000 --instance url=http://h:8000,role=decode,chip=H20 ...")
    def router(ctx: typer.Context,
               config: Optional[str] = typer.Option(None, "--config", help="router YAML file")) -> None:
        from dlmix.hw.profiles import CatalogError
        from dlmix.router.config import ConfigError, RouterConfig
        from dlmix.router.server import RegistrationError, run

        try:
            cfg = RouterConfig.from_yaml(config) if config else RouterConfig()
            cfg.apply_flags(list(ctx.args))
            from dlmix.router.server import Router

            Router(cfg)  # validate everything before binding
        except (ConfigError, CatalogError, RegistrationError, ValueError, KeyError) as ex:
            typer.echo(f"error: {ex}", err=True)
            raise typer.Exit(2)
        run(cfg)
