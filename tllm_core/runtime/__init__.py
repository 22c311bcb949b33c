"""The engine-neutral runtime: the consumers built in the engine, each step's reads cut into
bundles and delivered over the bus, and the reports that come back."""
