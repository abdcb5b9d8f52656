"""`tradeloop serve trainer|evaluator|feedback|dashboard`: run one service with uvicorn.

Configuration comes from `TL_*` environment variables (shared/config.py; the trainer and evaluator add a
few in their worker modules). Bad settings print the variables at fault and exit 2. The process binds
`TL_HOST` on the service's port (`TL_TRAINER_PORT`, ...), or, under `tradeloop up`, serves on the socket the
launcher bound and passed down (`TL_LISTEN_FD`, held by the launcher across restarts); SIGTERM / Ctrl-C stop
it cleanly (uvicorn runs the app's shutdown: the worker stops after the item in hand).

`tradeloop serve dashboard --runs DIR` serves the runs on disk under DIR (no service, no Redis): the run browser
of `services/dashboard/runs.py`.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Callable

from pathlib import Path

import typer

SERVICES = ("trainer", "evaluator", "feedback", "dashboard")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
"""uvicorn's and logging's levels: what `--log-level` takes (serve, show)."""


def _factory(service: str) -> tuple[type, Callable]:
    """(settings class, create_app) of a service — imported lazily so each process loads only its own."""
    if service == "trainer":
        from services.trainer.app import create_app
        from services.trainer.worker import TrainerServiceSettings as S
    elif service == "evaluator":
        from services.evaluator.app import create_app
        from services.evaluator.worker import EvaluatorServiceSettings as S
    elif service == "feedback":
        from services.feedback.app import create_app
        from shared.config import FeedbackSettings as S
    else:
        from services.dashboard.app import create_app
        from shared.config import DashboardSettings as S
    return S, create_app


def serve(service: str, *, log_level: str = "info", runs: Path | None = None) -> None:
    """Load the service's settings, build its app, run uvicorn until SIGTERM/SIGINT. `runs` (dashboard only): serve
    the runs under that directory instead of the live run."""
    import uvicorn

    from shared.config import ConfigError, is_loopback, load_settings

    listen_fd = os.environ.pop("TL_LISTEN_FD", None)  # not inherited by anything this process starts
    settings_cls, create_app = _factory(service)
    try:
        settings = load_settings(settings_cls)
    except ConfigError as exc:
        print(f"tradeloop serve {service}: {exc}", file=sys.stderr)
        raise typer.Exit(2)
    try:
        app = create_app(settings) if runs is None else create_app(settings, runs_dir=runs)
    except ValueError as exc:
        print(f"tradeloop serve {service}: {exc}", file=sys.stderr)
        raise typer.Exit(2)
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")
    if listen_fd is None:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=log_level, access_log=False,
                    timeout_graceful_shutdown=10)
        return
    try:
        sock = socket.socket(fileno=int(listen_fd))
        bound = sock.getsockname()[0]
    except (ValueError, OSError) as exc:
        print(f"tradeloop serve {service}: TL_LISTEN_FD={listen_fd!r} is not an open socket ({exc})", file=sys.stderr)
        raise typer.Exit(2)
    if settings.embedded and not is_loopback(bound):
        print(f"tradeloop serve {service}: TL_LISTEN_FD is bound to {bound}; embedded mode serves on loopback only",
              file=sys.stderr)
        raise typer.Exit(2)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=10))
    server.run(sockets=[sock])
    if not server.started:
        raise typer.Exit(3)  # as uvicorn.run: the app's startup failed


def register(app: typer.Typer) -> None:
    """Add the `serve` command."""

    @app.command("serve")
    def serve_cmd(
        service: str = typer.Argument(..., help="trainer, evaluator, feedback or dashboard"),
        log_level: str = typer.Option("info", "--log-level", help="uvicorn/python log level"),
        runs: Path = typer.Option(None, "--runs", help="dashboard only: serve the runs on disk under this directory "
                                  "(no live services, no Redis)"),
    ) -> None:
        """Run one tradeloop service (configured by TL_* environment variables)."""
        if service not in SERVICES:
            print(f"tradeloop serve: unknown service {service!r}; choose one of {', '.join(SERVICES)}",
                  file=sys.stderr)
            raise typer.Exit(2)
        if log_level.lower() not in LOG_LEVELS:
            print(f"tradeloop serve: --log-level {log_level!r} is not one of {', '.join(LOG_LEVELS)}",
                  file=sys.stderr)
            raise typer.Exit(2)
        if service == "dashboard":
            import importlib.util

            if importlib.util.find_spec("services.dashboard") is None or \
                    importlib.util.find_spec("services.dashboard.app") is None:
                print("tradeloop serve dashboard: services/dashboard/app.py is not installed", file=sys.stderr)
                raise typer.Exit(2)
        if runs is not None:
            if service != "dashboard":
                print(f"tradeloop serve: --runs is for the dashboard, not the {service}", file=sys.stderr)
                raise typer.Exit(2)
            if not runs.is_dir():
                print(f"tradeloop serve dashboard: --runs {runs}: no such directory", file=sys.stderr)
                raise typer.Exit(2)
        serve(service, log_level=log_level.lower(), runs=runs)
