"""`python servers/deeplearning_server.py [rpycdl serve options]`: the DEEPLEARNING service (`rpycdl serve --help`)."""

from rpycdl.cli import serve_service

serve_service("deeplearning")
