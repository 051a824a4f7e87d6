"""The server: `rpycdl serve` (app), the forking server (forking), the RPyC service (service), a
job's request (request) and its flow from queue to outcome (jobflow), the job process (runner),
per-job containers (containers), and what one server's connections share (context)."""
