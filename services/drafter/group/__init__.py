"""The drafter group across processes and hosts: joining and leaving it and every collective the ranks
call (collectives.py), the elastic agent that restarts the group as one (agent.py, a job of its own),
its rendezvous (rendezvous.py) and the run's authenticated key store behind it (keystore.py)."""
