"""Benchmarks of ragspeed, run as `ragspeed bench ...`: contenders side by side in one run,
printed as a table and written as flat JSON. Not imported by the serving path."""
