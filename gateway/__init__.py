"""ragspeed gateway."""
