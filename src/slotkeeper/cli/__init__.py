"""The command line (`slotkeeper ...`): the parser and `serve` (commandline.py), the commands that talk to a running
slotkeeper (manage.py, doctor.py, story.py) and their HTTP client and formatting."""

from slotkeeper.cli.commandline import main

__all__ = ["main"]
