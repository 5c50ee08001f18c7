"""``dlmix router --config router.yaml [--KEY VALUE ...]``: every config key is also a flag (see
:mod:`dlmix.router.config`); ``--help`` lists them all, generated from the config schema
(:func:`dlmix.router.config.flag_rows`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import typer
from typer.core import TyperCommand

if TYPE_CHECKING:  # typer >= 0.22 vendors click; a plain install may have no top-level click
    import click

CONFIG_FLAGS_TITLE = "Config flags (each a router.yaml key; a flag wins over the file)"


class RouterCommand(TyperCommand):
    """The ``router`` command: its help adds a section with every config flag (they are parsed by
    :meth:`dlmix.router.config.RouterConfig.apply_flags`, not by click, so click alone would list only ``--config``)."""

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from dlmix.router.config import flag_rows

        super().format_help(ctx, formatter)
        with formatter.section(CONFIG_FLAGS_TITLE):  # the dlmix CLI's help is click's plain text (dlmix.cli)
            formatter.write_dl([(", ".join(names) + " " + metavar, text) for names, metavar, text in flag_rows()])


def register(app: typer.Typer) -> None:
    """Add the ``router`` sub-command to the dlmix CLI."""

    @app.command("router", cls=RouterCommand,
                 context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
                 help="Run the dlmix router (OpenAI endpoint, KV-cache-aware PD placement). Every config key is "
                      "also a flag (listed below): --policy cost --port 8000 --instance "
                      "url=http://h:8000,role=decode,chip=H20 ...")
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
