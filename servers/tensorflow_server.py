"""`python servers/tensorflow_server.py [rpycdl serve options]`: the TENSORFLOW service (see `rpycdl serve --help`)."""

from rpycdl.cli import serve_service

serve_service("tensorflow")
