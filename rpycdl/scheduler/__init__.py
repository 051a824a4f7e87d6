"""Host-wide state shared by every server through the lock directory: GPU locks granted first
come, first served (locks, planning, lockdir), shares of a GPU (shares), job records (jobs), and the
processes of a job (procs)."""
