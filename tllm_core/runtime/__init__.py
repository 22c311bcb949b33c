"""The engine-neutral runtime: consumers built in the engine, fed each step over the bus."""
