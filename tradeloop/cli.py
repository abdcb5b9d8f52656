"""The `tradeloop` command line.

Each sub-command lives in its own module (`tradeloop/cmd_*.py`) with a `register(app)` function, so the
commands stay small and the heavy imports (torch, the web stack) happen only for the command that runs.
"""
from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="tradeloop",
    help="Train, evaluate and backtest distributional RL trading agents in a closed loop.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)



@app.callback()
def _root() -> None:
    """Train, evaluate and backtest distributional RL trading agents in a closed loop."""


COMMAND_MODULES = ("cmd_data", "cmd_backtest", "cmd_train", "cmd_evaluate", "cmd_up", "cmd_serve", "cmd_study",
                   "cmd_show")

for _name in COMMAND_MODULES:
    try:
        _mod = importlib.import_module(f"tradeloop.{_name}")
    except ModuleNotFoundError as exc:  # a command module not written yet
        if exc.name != f"tradeloop.{_name}":
            raise
        continue
    _mod.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
