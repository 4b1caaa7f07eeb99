"""ragspeed retrieval."""
