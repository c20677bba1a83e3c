"""Reliability suite (issue 7): faults, long runs, property tests, resume, bad inputs."""
