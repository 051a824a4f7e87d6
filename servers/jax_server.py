"""`python servers/jax_server.py [rpycdl serve options]`: the JAX service (see `rpycdl serve --help`)."""

from rpycdl.cli import serve_service

serve_service("jax")
