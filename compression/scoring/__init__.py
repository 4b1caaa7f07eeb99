"""Scorers: turn (question, texts) into relevance scores. Encoders cache by content hash."""
