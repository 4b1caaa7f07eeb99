"""ragspeed's engines: the native engine and the backends behind one `EngineClient` protocol."""
