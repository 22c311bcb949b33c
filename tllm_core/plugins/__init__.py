"""Plugin discovery: the pluggy manager over the ``tllm`` entry points (``loader``) and the
registry of ports, consumers, request keys and commands they contribute (``registry``)."""
