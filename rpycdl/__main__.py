"""`python -m rpycdl` is the `rpycdl` command."""

from rpycdl.cli import main

raise SystemExit(main())
