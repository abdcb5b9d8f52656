"""`tradeloop show RUN`: the dashboard over runs on disk — one run directory, or a directory of runs (a study's
seeds, the `runs/` of `tradeloop up`) — with no service and no Redis.

    tradeloop show runs/run-20261201-101500          one run
    tradeloop show runs --port 8050                   every run under runs/, side by side

Serves on 127.0.0.1 (loopback: the page reads files of this machine), port `--port` (default: a free one), and
prints the URL; Ctrl-C stops it. The page is the live loop's dashboard, reading the run directories' files
(`shared/runfiles.py`).
"""
from __future__ import annotations

import sys
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    """Add the `show` command."""

    @app.command("show")
    def show(
        run: Path = typer.Argument(..., help="a run directory, or a directory holding run directories"),
        port: int = typer.Option(0, "--port", help="port on 127.0.0.1 (0: a free one)"),
        log_level: str = typer.Option("warning", "--log-level", help="uvicorn log level"),
    ) -> None:
        """Browse finished runs: equity against buy-and-hold, drawdown, monthly returns, trades, loss curves."""
        import socket

        import uvicorn

        from services.dashboard.app import create_app
        from shared.config import LOOPBACK, DashboardSettings
        from shared.runfiles import find_runs

        from tradeloop.cmd_serve import LOG_LEVELS

        if log_level.lower() not in LOG_LEVELS:
            print(f"tradeloop show: --log-level {log_level!r} is not one of {', '.join(LOG_LEVELS)}", file=sys.stderr)
            raise typer.Exit(2)
        if not run.is_dir():
            print(f"tradeloop show: {run}: {'not a directory' if run.exists() else 'no such directory'}",
                  file=sys.stderr)
            raise typer.Exit(2)
        if not find_runs(run):
            where = (" — a study whose runs went through Redis keeps them in its workers' --out directories: show "
                     "one of those" if (run / "study.json").is_file() else "")
            print(f"tradeloop show: {run}: no run directory here (a run directory holds reports/, epochs/, run.json or "
                  f"trainer/run.json){where}", file=sys.stderr)
            raise typer.Exit(2)
        if not 0 <= port <= 65535:
            print(f"tradeloop show: --port must be in 0..65535, got {port}", file=sys.stderr)
            raise typer.Exit(2)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, port))
        except OSError as exc:
            print(f"tradeloop show: cannot listen on {LOOPBACK}:{port} ({exc.strerror})", file=sys.stderr)
            raise typer.Exit(2)
        sock.listen(64)
        url = f"http://{LOOPBACK}:{sock.getsockname()[1]}/"
        app_ = create_app(DashboardSettings(run_id="show", embedded=True, host=LOOPBACK), runs_dir=run.resolve())
        print(f"tradeloop show: {run.resolve()} at {url} (Ctrl-C stops)", flush=True)
        server = uvicorn.Server(uvicorn.Config(app_, log_level=log_level.lower(), access_log=False))
        server.run(sockets=[sock])
