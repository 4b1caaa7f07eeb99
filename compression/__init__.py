"""ragspeed compression."""
