"""Plugin discovery: the pluggy manager (``loader``) and what the plugins contribute (``registry``)."""
