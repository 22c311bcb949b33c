"""The engine-neutral runtime: settings that travel to the engine, the consumers built there,
each step's reads cut into bundles and delivered over the bus, and the reports that come back.
Knows nothing of vLLM (the bridge feeds it ``StepCapture``s)."""
