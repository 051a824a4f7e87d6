"""The operator's side: service containers up and down (up), the docker helpers both sides share
(docker), the embedded local cluster of the demo and the tests (local), the site's subcommands
(cli), and the self-test on a machine with real GPUs (selftest)."""
