"""ragspeed's engines: the seam (`protocol`: the `EngineClient` protocol; `config`: the frozen
configs), the backends behind it (`backends`), and the native engine in layers (`native`)."""
