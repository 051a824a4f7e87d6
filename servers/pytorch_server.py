"""`python servers/pytorch_server.py [rpycdl serve options]`: the PYTORCH service (see `rpycdl serve --help`)."""

from rpycdl.cli import serve_service

serve_service("pytorch")
