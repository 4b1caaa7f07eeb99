"""ragspeed prompt_cache."""
