"""Data in and out of jobs: a working directory packed on the client and unpacked for the job
(workdir), and the artifact store its outputs go to (store)."""
