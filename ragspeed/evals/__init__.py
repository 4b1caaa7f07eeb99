"""Quality evaluations: `ragspeed eval compression` and `ragspeed eval retrieval`."""
