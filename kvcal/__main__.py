"""`python -m kvcal` is the `kvcal` command."""

from kvcal.cli import main

main()
