"""`python -m streamoe`: the `streamoe` command."""

from .cli import main

main()
