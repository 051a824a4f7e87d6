"""The client: `rpycdl.connect(...)` finds a server and returns a Connection, whose `root.run_code`
runs a function on the server's GPUs."""

from rpycdl.client.arrays import ArrayJob, ArrayStatus
from rpycdl.client.connection import Connection, RemoteRoot
from rpycdl.client.discovery import connect, connect_to, job
from rpycdl.client.jobs import Job, JobStatus
from rpycdl.client.session import Session

__all__ = ["ArrayJob", "ArrayStatus", "Connection", "Job", "JobStatus", "RemoteRoot", "Session", "connect",
           "connect_to", "job"]
